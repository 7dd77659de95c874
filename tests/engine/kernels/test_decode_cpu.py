"""moeferry.engine.kernels.decode_cpu (one decoded token's norms, attention and routing on the CPU)
against the eager maths of moeferry.engine.runtime.model, on test_decode.py's cases: every
family's attention options, head sizes no power of two, sliding windows, many experts."""

from types import SimpleNamespace

import pytest
import torch

from benchmarks.kernel_bench import rel_err
from moeferry.engine.kernels.decode_cpu import add_rms_norm, rope_attention, route_topk
from moeferry.engine.runtime.model import OffloadedMixtral, attention_options, rms_norm, rope_cos_sin
from tests.engine.kernels.test_decode import ATTENTION_CASES, ATTENTION_VARIANTS, attention_layer


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


@pytest.mark.parametrize("variant,pos,window", ATTENTION_CASES)
def test_rope_attention_matches_the_eager_attention(variant, pos, window, torch_threads):
    o = ATTENTION_VARIANTS[variant]
    heads, kv_heads, D, cap, eps = 8, o.get("kv_heads", 2), o.get("D", 64), 300, 1e-5
    g = torch.Generator().manual_seed(pos)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    cos, sin = rope_cos_sin(inv, torch.arange(cap), torch.float32)  # [P, 1, D]
    q, k, v = (torch.randn(n, D, generator=g) for n in (heads, kv_heads, kv_heads))
    kc, vc = torch.randn(cap, kv_heads, D, generator=g), torch.randn(cap, kv_heads, D, generator=g)
    layer = {"q_proj": q.reshape(1, -1), "k_proj": k.reshape(1, -1), "v_proj": v.reshape(1, -1), "o_proj": None,
             **attention_layer(variant, heads, kv_heads, D, g)}
    # the eager path: model.attention for one token at pos, its projections replaced by the q,
    # k, v above and no output projection
    want_kc, want_vc = kc.clone(), vc.clone()
    model = SimpleNamespace(cfg=SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_dim=D,
                                                sliding_window=window, rms_norm_eps=eps),
                            kv=SimpleNamespace(k=want_kc[None], v=want_vc[None]),
                            linear=lambda x, w: x if w is None else w)
    model.project = lambda h, layer, name: OffloadedMixtral.project(model, h, layer, name)
    want = OffloadedMixtral.attention(model, 0, layer, q.reshape(1, -1), cos[pos:pos + 1], sin[pos:pos + 1],
                                      pos).reshape(-1)
    inputs = [t.clone() for t in (q, k, v)]
    out = torch.empty(heads * D)
    rope_attention(q, k, v, cos[pos], sin[pos], pos, kc, vc, window, out, **attention_options(layer, eps))
    close(out, want)
    close(kc[pos], want_kc[pos])
    close(vc[pos], want_vc[pos])
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), inputs))
    rows = torch.arange(cap) != pos
    assert torch.equal(kc[rows], want_kc[rows]) and torch.equal(vc[rows], want_vc[rows])


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
