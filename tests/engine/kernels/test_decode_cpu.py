"""moeferry.engine.kernels.decode_cpu (one decoded token's norms, attention and routing on the CPU)
against the eager maths of moeferry.engine.runtime.model, on test_decode.py's cases: every
family's attention options, head sizes no power of two, sliding windows, many experts."""

from types import SimpleNamespace

import pytest
import torch

from benchmarks.kernel_bench import rel_err
from moeferry.engine.kernels.decode_cpu import add_rms_norm, rope_attention, route_topk
from moeferry.engine.runtime.model import OffloadedMixtral, attention_options, rms_norm
from tests.engine.kernels.test_decode import ATTENTION_CASES, attention_case, check_attention


@pytest.fixture(params=[1, 2], ids=["serial", "parallel"])
def torch_threads(request):
    """The attention's and the router's loops run on numba's threads only where torch has more
    than one (decode_cpu._parallel): both ways."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def close(got, want):
    assert rel_err(got, want) <= 1e-5, rel_err(got, want)


@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm(with_delta):
    g = torch.Generator().manual_seed(1)
    x, d = torch.randn(1, 4096, generator=g), torch.randn(1, 4096, generator=g)
    w = 1 + 0.1 * torch.randn(4096, generator=g)
    want_x = x + d if with_delta else x.clone()
    want = rms_norm(want_x, w, 1e-5)
    out = torch.empty_like(x)
    add_rms_norm(x, d if with_delta else None, w, 1e-5, out)
    close(x, want_x)
    close(out, want)


@pytest.mark.parametrize("span", ["compiled", "torch"])
@pytest.mark.parametrize("variant,pos,window", ATTENTION_CASES)
def test_rope_attention_matches_the_eager_attention(variant, pos, window, torch_threads, span, monkeypatch):
    """Both ways of computing the scores and their sum: rope_attention's own loops, and, over more
    than COMPILED_SPAN positions, torch's on the q its loops prepared."""
    from moeferry.engine.kernels import decode_cpu
    monkeypatch.setattr(decode_cpu, "COMPILED_SPAN", 10**9 if span == "compiled" else 0)
    c = attention_case(variant, pos, window, "cpu", torch.float32)
    out = torch.empty(c.want.shape[0])
    rope_attention(c.q, c.k, c.v, c.cos[pos], c.sin[pos], pos, c.kc, c.vc, window, out,
                   **attention_options(c.layer, c.eps))
    check_attention(c, out, close)


@pytest.mark.parametrize("experts,top_k,hidden,routing", [
    (8, 2, 4096, "softmax_topk_norm"), (6, 3, 4096, "softmax_topk_norm"), (5, 1, 4096, "softmax_topk_norm"),
    (128, 8, 2048, "softmax_topk"), (32, 4, 2880, "topk_softmax"), (64, 8, 2048, "softmax_topk")])
def test_route_topk_matches_the_model_router(experts, top_k, hidden, routing, torch_threads):
    """Mixtral's shapes and odd ones (renormalised), Qwen3's and OLMoE's many experts (not),
    gpt-oss's router (a bias, softmax over the top-k logits)."""
    g = torch.Generator().manual_seed(experts)
    h = torch.randn(1, hidden, generator=g)
    router = torch.randn(experts, hidden, generator=g) * 0.05
    bias = torch.randn(experts, generator=g) if routing == "topk_softmax" else None
    layer = {"router": router, "routing": routing, **({"router_bias": bias} if bias is not None else {})}
    want_w, want_ids = OffloadedMixtral.route(SimpleNamespace(cfg=SimpleNamespace(top_k=top_k, expert_units=1)),
                                              layer, h)
    w, ids = torch.empty(top_k), torch.empty(top_k, dtype=torch.long)
    route_topk(h, router, top_k, w, ids, bias, renormalize=routing != "softmax_topk")
    assert ids.tolist() == want_ids[0].tolist()
    close(w, want_w[0])


def test_rope_attention_refuses_a_position_past_the_cache():
    """The compiled loops check no bounds: the wrapper does, before a row past the cache is written."""
    kc, vc = torch.zeros(4, 2, 8), torch.zeros(4, 2, 8)
    q, k, v = torch.randn(4, 8), torch.randn(2, 8), torch.randn(2, 8)
    with pytest.raises(IndexError, match="position 4 in a cache of 4"):
        rope_attention(q, k, v, torch.ones(8), torch.zeros(8), 4, kc, vc, None, torch.empty(32))
    assert not kc.any() and not vc.any()
