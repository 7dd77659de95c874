"""moeferry.engine.kernels.decode against the eager maths of moeferry.engine.runtime.model (GPU; the CPU runs them only
under TRITON_INTERPRET=1, in float32)."""

import pytest
import torch

from benchmarks.kernel_bench import rel_err
from moeferry.engine.kernels import hqq_gpu

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not hqq_gpu.fused_available(),
                                                  reason="needs CUDA (or the Triton interpreter)")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])  # the interpreter's bf16 truncates


def close(got, want, dtype):
    assert rel_err(got, want) <= (1e-5 if dtype == torch.float32 else 8e-3), rel_err(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("delta", ["none", "delta", "delta+bias"])
def test_add_rms_norm(dtype, delta):
    """x += delta (+ an o projection's bias, rounded to the dtype first as the eager projection
    rounds it), then the RMS norm."""
    from moeferry.engine.kernels.decode import add_rms_norm
    from moeferry.engine.runtime.model import rms_norm
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 4096, generator=g).to(DEVICE, dtype)
    d = torch.randn(1, 4096, generator=g).to(DEVICE, dtype)
    b = torch.randn(4096, generator=g).to(DEVICE, dtype)
    want_x = {"none": x.clone(), "delta": x + d, "delta+bias": x + (d + b)}[delta]
    want = rms_norm(want_x, w := (1 + 0.1 * torch.randn(4096, generator=g)).to(DEVICE, dtype), 1e-5)
    out = torch.empty_like(x)
    add_rms_norm(x, None if delta == "none" else d, w, 1e-5, out, b if delta == "delta+bias" else None)
    assert torch.equal(x, want_x)
    close(out, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", [37, 2880])
def test_embed_row_reads_the_tokens_row_from_host_memory(dtype, H):
    """embed_row copies the row of the token held on the device; on a GPU the table lies in
    page-locked host memory, which the kernel reads over the link."""
    from moeferry.engine.kernels.decode import embed_row
    table = torch.randn(300, H, generator=torch.Generator().manual_seed(2)).to(dtype)
    if DEVICE == "cuda":
        table = table.pin_memory()
    out = torch.zeros(1, H, dtype=dtype, device=DEVICE)
    for t in (0, 257, 299):
        embed_row(table, torch.tensor([t], device=DEVICE), out)
        assert torch.equal(out.cpu(), table[t:t + 1])


@pytest.mark.parametrize("programs", [1, 3, 32])
def test_fetch_experts_copies_the_guesses_the_cache_lacks(programs):
    """fetch_experts copies each guessed expert whose table entry is -1 from (page-locked) host
    memory into its staging row, and leaves the rows of the guesses the cache holds alone."""
    from moeferry.engine.kernels.decode import fetch_experts
    from moeferry.engine.runtime import cuda_driver
    host = torch.randint(0, 256, (9, 3 * 256), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    if DEVICE == "cuda":
        host = host.pin_memory()
    table = torch.tensor([-1, 0, -1, -1, 1, -1, -1, -1, 2], dtype=torch.int32, device=DEVICE)
    guesses = torch.tensor([2, 4, 8, 7], dtype=torch.int32, device=DEVICE)
    staging = torch.zeros(4, 3 * 256, dtype=torch.uint8, device=DEVICE)
    host_at = cuda_driver.device_pointer(host.data_ptr()) if DEVICE == "cuda" else host.data_ptr()
    fetch_experts(guesses, table, staging, host_at - staging.data_ptr(), programs)
    got = staging.cpu()
    assert torch.equal(got[0], host[2]) and torch.equal(got[3], host[7])
    assert not got[1].any() and not got[2].any()  # experts 4 and 8 are cached: not fetched


# each family's attention options: qwen3_moe's per-head q/k norm, olmoe's norm over the whole
# projection with and without clip_qkv, qwen2_moe's q/k/v biases, gpt_oss's biases and sinks;
# head sizes that are not a power of two (the tests' tiny models) and no GQA once
ATTENTION_VARIANTS = {
    "plain": dict(),
    "head-norm": dict(qk_norm="head"),
    "full-norm": dict(qk_norm="full"),
    "full-norm-clip": dict(qk_norm="full", clip=0.9),
    "clip": dict(clip=0.9),
    "biases": dict(biases=True),
    "sinks-biases": dict(biases=True, sinks=True),
    "head-norm-d20": dict(qk_norm="head", D=20),
    "full-norm-clip-d12-mha": dict(qk_norm="full", clip=0.9, D=12, kv_heads=8),
    "sinks-biases-d12": dict(biases=True, sinks=True, D=12),
}
PLAIN_POSITIONS = [(0, None), (63, None), (64, None), (257, None), (257, 100), (20, 100)]
ATTENTION_CASES = ([("plain", p, w) for p, w in PLAIN_POSITIONS]
                   + [(v, p, w) for v in list(ATTENTION_VARIANTS)[1:] for p, w in ((0, None), (257, 100))])


def attention_layer(variant: str, heads: int, kv_heads: int, D: int, g: torch.Generator) -> dict:
    """A layer's attention options and their weights (random: an option the kernel skipped
    would show), as engine/model.layer_weights makes them."""
    o = ATTENTION_VARIANTS[variant]
    layer = {}
    if "qk_norm" in o:
        q_n, k_n = (D, D) if o["qk_norm"] == "head" else (heads * D, kv_heads * D)
        layer.update(qk_norm=o["qk_norm"], q_norm=1 + 0.3 * torch.randn(q_n, generator=g),
                     k_norm=1 + 0.3 * torch.randn(k_n, generator=g))
    if "clip" in o:
        layer["clip_qkv"] = o["clip"]
    if o.get("biases"):
        for n, rows in (("q_proj", heads), ("k_proj", kv_heads), ("v_proj", kv_heads)):
            layer[n + "_bias"] = 0.5 * torch.randn(rows * D, generator=g)
    if o.get("sinks"):
        layer["sinks"] = torch.randn(heads, generator=g)
    return layer


def attention_case(variant: str, pos: int, window: int | None, device, dtype):
    """A decoded token's attention at pos and what the eager path makes of it: (q, k, v as
    projected [heads or kv heads, D], cos and sin tables [P, 1, D], the KV cache k and v
    [P, kv heads, D], the layer's weights and options, its output [heads * D], and the cache
    rows it writes at pos). The eager path is model.attention with pos (prepare, rotate, write
    row pos, masked SDPA or grouped_attention), its projections replaced by q, k, v and no
    output projection; the returned caches are the untouched ones."""
    from types import SimpleNamespace

    from moeferry.engine.runtime.model import OffloadedMixtral, rope_cos_sin
    o = ATTENTION_VARIANTS[variant]
    heads, kv_heads, D, cap, eps = 8, o.get("kv_heads", 2), o.get("D", 64), 300, 1e-5
    g = torch.Generator().manual_seed(pos)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    cos, sin = rope_cos_sin(inv.to(device), torch.arange(cap, device=device), dtype)  # [P, 1, D]
    q = torch.randn(heads, D, generator=g).to(device, dtype)
    k = torch.randn(kv_heads, D, generator=g).to(device, dtype)
    v = torch.randn(kv_heads, D, generator=g).to(device, dtype)
    kc = torch.randn(cap, kv_heads, D, generator=g).to(device, dtype)
    vc = torch.randn(cap, kv_heads, D, generator=g).to(device, dtype)
    options = {n: t.to(device, dtype) if isinstance(t, torch.Tensor) else t
               for n, t in attention_layer(variant, heads, kv_heads, D, g).items()}
    want_kc, want_vc = kc.clone(), vc.clone()
    model = SimpleNamespace(cfg=SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_dim=D,
                                                sliding_window=window, rms_norm_eps=eps),
                            kv=SimpleNamespace(k=want_kc[None], v=want_vc[None]),
                            linear=lambda x, w: x if w is None else w)
    model.project = lambda h, layer, name: OffloadedMixtral.project(model, h, layer, name)
    layer = {"q_proj": q.reshape(1, -1), "k_proj": k.reshape(1, -1), "v_proj": v.reshape(1, -1), "o_proj": None,
             **options}
    want = OffloadedMixtral.attention(model, 0, layer, q.reshape(1, -1), cos[pos:pos + 1], sin[pos:pos + 1], pos,
                                      pos=torch.tensor([pos], device=device), span=cap).reshape(-1)
    return SimpleNamespace(pos=pos, q=q, k=k, v=v, cos=cos, sin=sin, kc=kc, vc=vc, layer=layer, eps=eps,
                           want=want, want_kc=want_kc, want_vc=want_vc, inputs=[t.clone() for t in (q, k, v)])


def check_attention(c, out, close_to) -> None:
    """out and the cache rows at pos are the eager path's (close_to(got, want)), q, k, v are
    untouched, and no other cache row moved."""
    pos = c.pos
    close_to(out, c.want)
    close_to(c.kc[pos], c.want_kc[pos])
    close_to(c.vc[pos], c.want_vc[pos])
    rows = torch.arange(c.kc.shape[0], device=c.kc.device) != pos
    assert torch.equal(c.kc[rows], c.want_kc[rows]) and torch.equal(c.vc[rows], c.want_vc[rows])
    assert all(torch.equal(a, b) for a, b in zip((c.q, c.k, c.v), c.inputs))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant,pos,window", ATTENTION_CASES)
def test_rope_attention_matches_the_eager_attention(dtype, variant, pos, window):
    from moeferry.engine.kernels.decode import rope_attention
    from moeferry.engine.runtime.model import attention_options
    c = attention_case(variant, pos, window, DEVICE, dtype)
    out = torch.empty(c.want.shape[0], device=DEVICE, dtype=dtype)
    rope_attention(c.q, c.k, c.v, c.cos, c.sin, torch.tensor([pos], device=DEVICE), c.kc, c.vc, window, out,
                   **attention_options(c.layer, c.eps))
    check_attention(c, out, lambda got, want: close(got, want, dtype))


@pytest.mark.parametrize("experts,top_k,hidden", [(8, 2, 4096), (6, 3, 4096), (5, 1, 4096),
                                                  (128, 8, 2048), (32, 4, 2880), (64, 8, 2048)])
def test_route_topk_matches_the_model_router(experts, top_k, hidden):
    """Mixtral's shapes, odd ones, and the many experts of Qwen3 (128), gpt-oss (32, a hidden
    size no power of two) and OLMoE (64), read by the two-kernel route."""
    from types import SimpleNamespace

    from moeferry.engine.kernels.decode import route_topk
    from moeferry.engine.runtime.model import OffloadedMixtral
    g = torch.Generator().manual_seed(experts)
    h = torch.randn(1, hidden, generator=g).to(DEVICE)
    router = (torch.randn(experts, hidden, generator=g) * 0.02).to(DEVICE)
    model = SimpleNamespace(cfg=SimpleNamespace(top_k=top_k, expert_units=1))
    want_w, want_ids = OffloadedMixtral.route(model, {"router": router}, h)
    w = torch.empty(top_k, device=DEVICE)
    ids = torch.empty(top_k, dtype=torch.long, device=DEVICE)
    route_topk(h, router, top_k, w, ids)
    assert ids.tolist() == want_ids[0].tolist()
    close(w, want_w[0], torch.float32)
    # a forced choice (the benchmark's routing) goes to the outputs in the same launch; the picks to w, ids
    fw, fi = torch.rand(top_k, device=DEVICE), torch.randperm(experts, device=DEVICE)[:top_k]
    ow, oi = torch.zeros(top_k, device=DEVICE), torch.zeros(top_k, dtype=torch.long, device=DEVICE)
    w.zero_()
    route_topk(h, router, top_k, w, ids, forced=(fw, fi, ow, oi))
    assert torch.equal(ow, fw) and torch.equal(oi, fi)
    assert ids.tolist() == want_ids[0].tolist()
    close(w, want_w[0], torch.float32)


@pytest.mark.parametrize("routing", ["softmax_topk", "topk_softmax"])
def test_route_topk_matches_the_other_families_routers(routing):
    """norm_topk_prob false (qwen3_moe, olmoe: no renormalisation) and gpt_oss (a router bias,
    softmax over the top-k logits: the renormalised top-k of the softmax)."""
    from types import SimpleNamespace

    from moeferry.engine.kernels.decode import route_topk
    from moeferry.engine.runtime.model import OffloadedMixtral
    g = torch.Generator().manual_seed(7)
    h = torch.randn(1, 512, generator=g).to(DEVICE)
    router = (torch.randn(12, 512, generator=g) * 0.05).to(DEVICE)
    bias = torch.randn(12, generator=g).to(DEVICE) if routing == "topk_softmax" else None
    layer = {"router": router, "routing": routing, **({"router_bias": bias} if bias is not None else {})}
    want_w, want_ids = OffloadedMixtral.route(SimpleNamespace(cfg=SimpleNamespace(top_k=4, expert_units=1)), layer, h)
    w = torch.empty(4, device=DEVICE)
    ids = torch.empty(4, dtype=torch.long, device=DEVICE)
    route_topk(h, router, 4, w, ids, bias, renormalize=routing != "softmax_topk")
    assert ids.tolist() == want_ids[0].tolist()
    close(w, want_w[0], torch.float32)
