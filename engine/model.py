"""Mixtral forward with offloaded experts, batch 1, read top to bottom.

model -> layer -> attention / mixture of experts -> norm -> RoPE helpers.
Attention, norms, routers and embeddings live on the compute device; experts come from the
ExpertCache (engine/expert_cache.py), which copies them in from host memory when they miss.
The maths follows transformers' MixtralForCausalLM exactly (router: softmax in float32,
top-k, renormalised; experts summed in ascending index order), which the tests check.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.expert_cache import SERIALS
from engine.kernels import qlinear


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    sliding_window: int | None
    tie_word_embeddings: bool

    @classmethod
    def from_hf(cls, c: dict) -> "ModelConfig":
        rope = c.get("rope_parameters") or {}
        heads = c["num_attention_heads"]
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"], num_layers=c["num_hidden_layers"],
            num_heads=heads, num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            num_experts=c["num_local_experts"], top_k=c["num_experts_per_tok"],
            rms_norm_eps=c.get("rms_norm_eps", 1e-5),
            rope_theta=rope.get("rope_theta", c.get("rope_theta", 1e6)),
            max_position_embeddings=c.get("max_position_embeddings", 32768),
            sliding_window=c.get("sliding_window"),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        )


class KVCache:
    """Keys and values for positions [0, capacity), written in place."""

    def __init__(self, cfg: ModelConfig, capacity: int, device, dtype):
        shape = (cfg.num_layers, capacity, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.capacity = capacity
        self.serial = next(SERIALS)

    @staticmethod
    def nbytes(cfg: ModelConfig, capacity: int, dtype) -> int:
        return 2 * cfg.num_layers * capacity * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


class OffloadedMixtral:
    def __init__(self, cfg: ModelConfig, dense: dict, cache, device, dtype, kernels: str = "auto"):
        self.cfg, self.cache, self.device, self.dtype, self.kernels = cfg, cache, device, dtype, kernels
        self.prefetch_depth = 0
        self.kv: KVCache | None = None
        self.trace: list | None = None  # set to a list to record routing per decoded token
        self.graphs = None  # engine/decode_graphs.py: CUDA-graph decode, set by use_cuda_graphs()
        self.hybrid = None  # engine/cpu_experts.CpuExperts: misses computed on the CPU, or None
        self.embed = dense["model.embed_tokens.weight"]
        self.norm = dense["model.norm.weight"]
        self.lm_head = dense.get("lm_head.weight", self.embed)
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            self.layers.append({
                "attn_norm": dense[p + "input_layernorm.weight"],
                "moe_norm": dense[p + "post_attention_layernorm.weight"],
                "router": dense[p + "block_sparse_moe.gate.weight"],
                **{n: dense[p + f"self_attn.{n}.weight"] for n in ("q_proj", "k_proj", "v_proj", "o_proj")},
            })
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64)
                                         .to(device=device, dtype=torch.float32) / cfg.head_dim))
        self.inv_freq = inv

    def use_cuda_graphs(self, on: bool = True) -> None:
        from engine.decode_graphs import GraphedDecode
        self.graphs = GraphedDecode(self) if on and self.device.type == "cuda" else None

    def setup_kv(self, capacity: int) -> None:
        """Allocate the KV cache; a no-op when the current one is big enough.

        Grows in steps of 256 positions and keeps what it holds (reused prompt prefixes).
        """
        if self.kv is not None and self.kv.capacity >= capacity:
            return
        old, self.kv = self.kv, None
        self.kv = KVCache(self.cfg, -(-capacity // 256) * 256, self.device, self.dtype)
        if old is not None:
            self.kv.k[:, :old.capacity] = old.k
            self.kv.v[:, :old.capacity] = old.v

    # -- the whole model ------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start: int, last_only: bool = True) -> torch.Tensor:
        """tokens [T] at positions start..start+T-1 -> logits [T or 1, vocab] (float32)."""
        T = tokens.shape[0]
        if T == 1 and self.graphs is not None:
            return self.graphs.step(tokens, start)
        pos = torch.arange(start, start + T, device=self.device)
        cos, sin = rope_cos_sin(self.inv_freq, pos, self.dtype)
        x = F.embedding(tokens, self.embed)  # [T, H]
        step = [] if self.trace is not None and T == 1 else None
        for i, layer in enumerate(self.layers):
            x = x + self.attention(i, layer, rms_norm(x, layer["attn_norm"], self.cfg.rms_norm_eps),
                                   cos, sin, start)
            x = x + self.moe(i, layer, x, step)
        if step is not None:
            self.trace.append(step)
        if last_only:
            x = x[-1:]
        x = rms_norm(x, self.norm, self.cfg.rms_norm_eps)
        return F.linear(x, self.lm_head).float()

    # -- attention ------------------------------------------------------------------------------

    def attention(self, i: int, layer: dict, h: torch.Tensor, cos, sin, start: int,
                  pos: torch.Tensor | None = None, span: int = 0) -> torch.Tensor:
        """h [T, H] (normed) at positions start.. -> attention output [T, H].

        With `pos` (a device tensor [1], used by CUDA graphs) the one token's position is read on
        the device and attention spans the first `span` cached positions under a mask.
        """
        cfg, T = self.cfg, h.shape[0]
        q = self.linear(h, layer["q_proj"]).view(T, cfg.num_heads, cfg.head_dim)
        k = self.linear(h, layer["k_proj"]).view(T, cfg.num_kv_heads, cfg.head_dim)
        v = self.linear(h, layer["v_proj"]).view(T, cfg.num_kv_heads, cfg.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if pos is None:
            end = start + T
            self.kv.k[i, start:end] = k
            self.kv.v[i, start:end] = v
            qpos = torch.arange(start, end, device=h.device)[:, None]
            need_mask = T > 1 or (cfg.sliding_window and end > cfg.sliding_window)
        else:
            end, qpos, need_mask = span, pos[:, None], True
            self.kv.k[i].index_copy_(0, pos, k)
            self.kv.v[i].index_copy_(0, pos, v)
        keys, values = self.kv.k[i, :end], self.kv.v[i, :end]  # [S, kvH, D]
        mask = None
        if need_mask:
            kpos = torch.arange(end, device=h.device)[None, :]
            mask = kpos <= qpos
            if cfg.sliding_window:
                mask = mask & (qpos - kpos < cfg.sliding_window)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),  # [heads, S, D]
            attn_mask=mask, enable_gqa=cfg.num_heads != cfg.num_kv_heads)
        out = out.transpose(0, 1).reshape(T, cfg.num_heads * cfg.head_dim)
        return self.linear(out, layer["o_proj"])

    # -- mixture of experts ---------------------------------------------------------------------

    def route(self, layer: dict, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, H] (normed) -> (weights float32 [T, k], expert ids [T, k]), as transformers."""
        probs = torch.softmax(F.linear(h, layer["router"]).float(), dim=-1)
        weights, ids = torch.topk(probs, self.cfg.top_k, dim=-1)
        return weights / weights.sum(dim=-1, keepdim=True), ids

    def moe(self, i: int, layer: dict, x: torch.Tensor, step: list | None) -> torch.Tensor:
        h = rms_norm(x, layer["moe_norm"], self.cfg.rms_norm_eps)
        weights, ids = self.route(layer, h)
        guesses = self.guess_next_experts(i, x)
        out = torch.zeros_like(h)

        def add_expert(w: dict, slot: int, e: int, k: int | None) -> None:
            if k is not None:  # decode: e's place in the top-k is known on the host, no sync
                out.add_((self.expert(w, h) * weights[:, k:k + 1]).to(out.dtype))
            else:
                rows, pos = (ids == e).nonzero(as_tuple=True)  # tokens routed to e, and where
                y = self.expert(w, h[rows])
                out.index_add_(0, rows, (y * weights[rows, pos, None]).to(out.dtype))

        self.dispatch(i, ids, guesses, step, add_expert, io=(h, weights, out))
        return out

    def dispatch(self, i: int, ids: torch.Tensor, guesses: torch.Tensor | None, step: list | None,
                 add_expert=None, add_all=None, io: tuple | None = None) -> None:
        """Fetch the routed experts through the cache and run them; then prefetch the guesses.

        ids [T, k] device; guesses [D, k] device (layers i+1..i+D) or None. The one host sync
        per layer happens here: routing decides what to copy (the guesses ride along).
        Either add_expert(w, slot, e, k) runs one expert at a time, or add_all(positions) runs
        the experts at those top-k positions at once once they are in place (the device reads
        their slots from cache.table). With self.hybrid, io = (h, weights, out) of the layer:
        the experts it picks run on the CPU meanwhile and are added to out before returning.
        """
        ids_host = ids.tolist()
        guesses_host = guesses.tolist() if guesses is not None else []
        needed = sorted({e for row in ids_host for e in row})
        if step is not None:
            step.append((tuple(ids_host[0]), self.cache.resident(i)))
        on_cpu, both, finish = {}, [], None
        if self.hybrid is not None and io is not None:
            on_cpu, both = self.hybrid.choose(i, needed, ids_host, self.cache)
            if on_cpu:  # queued first: the CPU works while the host queues copies and kernels
                finish = self.hybrid.start(i, on_cpu, *io)
        slots = []
        for e in (e for e in needed if e not in on_cpu):  # copies and compute queued, waiting for neither
            w, slot = self.cache.acquire(i, e, keep=needed)
            if add_all is None:
                add_expert(w, slot, e, ids_host[0].index(e) if len(ids_host) == 1 else None)
                self.cache.release(i, slot)
            else:
                slots.append(slot)
        if add_all is not None:
            self.cache.sync_table(i)
            add_all([k for k, e in enumerate(ids_host[0]) if e not in on_cpu])
            for slot in slots:
                self.cache.release(i, slot)
        for d, guess in enumerate(guesses_host, start=1):  # queued behind the demand copies
            self.cache.prefetch(i + d, guess)
        for e in both:  # the link's idle time while the CPU works (engine/placement.py)
            self.cache.admit(i, e)
        if finish is not None:
            finish()

    def expert(self, w: dict, h: torch.Tensor) -> torch.Tensor:
        return self.linear(F.silu(self.linear(h, w["w1"])) * self.linear(h, w["w3"]), w["w2"])

    def guess_next_experts(self, i: int, x: torch.Tensor) -> torch.Tensor | None:
        """Layers i+1..i+D's routers applied to the current residual stream (last token):
        expert ids [D, k], or None when there is nothing to guess.

        The residual stream changes slowly, so these guess which experts to copy early.
        Only timing depends on them: a wrong guess costs a copy, never a different output.
        """
        out = []
        for j in range(i + 1, min(i + 1 + self.prefetch_depth, self.cfg.num_layers)):
            layer = self.layers[j]
            _, ids = self.route(layer, rms_norm(x[-1:], layer["moe_norm"], self.cfg.rms_norm_eps))
            out.append(ids)
        return torch.cat(out) if out else None

    def linear(self, x: torch.Tensor, w) -> torch.Tensor:
        return qlinear(x, w, self.kernels)


# -- norm and RoPE helpers ----------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_cos_sin(inv_freq: torch.Tensor, pos: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = pos.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]  # [T, 1, D]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
