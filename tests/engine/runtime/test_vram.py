"""engine/runtime/vram.py: the planner and the engine size the expert cache with the same bytes."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from moeferry.engine.measure.bench_shapes import MODEL_SHAPES, shape_config
from moeferry.engine.paths import demo_store_path
from moeferry.engine.runtime import generate, vram
from moeferry.engine.setup import plan
from moeferry.engine.storage import store
from moeferry.engine.units import GiB, MiB

CATALOG = Path(__file__).resolve().parents[3] / "resources" / "catalog.json"
CUDA = torch.device("cuda")  # only its type is read: nothing is allocated
BUDGETS = [b * GiB // 4 for b in range(1, 400)] + [0, 1, 123_456_789]


def expert_quantization(model: str, bits: int) -> dict:
    if model == "gpt-oss-20b":
        return {"bits": 4, "method": "mxfp4", "group_size": 32, "bias_dtype": "BF16"}
    return {"bits": bits, "group_size": {2: 16, 3: 64, 4: 64}[bits], "meta_group": 128, "method": "hqq"}


@pytest.mark.parametrize("model", sorted(MODEL_SHAPES))
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("context", [128, 4096, 10**6])
def test_the_plan_and_the_engine_fit_the_same_cache_for_every_family(model, bits, context):
    hf = MODEL_SHAPES[model]
    cfg = shape_config(model)
    _, stride = store.expert_layout(cfg, expert_quantization(model, bits))
    sizes = replace(plan.ModelSizes.from_config(hf, bits, 4), expert_bytes=stride)  # a store's stride
    planned = sizes.device_bytes(context)
    engine_context = min(context, cfg.max_position_embeddings)  # load_engine's
    engine = generate.device_bytes(cfg, sizes.gpu_dense_bytes, stride, engine_context, torch.bfloat16, CUDA)
    assert planned == engine
    for budget in BUDGETS:
        assert planned.slots(budget) == engine.slots(budget)


def test_the_plan_and_the_engine_agree_on_the_demo_store_byte_for_byte(monkeypatch):
    path = demo_store_path()
    st = store.open_store(path)
    # the engine's own count of its dense bytes on a GPU (move_dense on a device that is not the CPU)
    _, dense_b = generate.move_dense(store.read_dense(st), torch.device("meta"), torch.bfloat16)
    sizes = plan.ModelSizes.from_store(path)
    hw = {"gpu_name": "Fake", "torch_cuda_available": True, "h2d_bytes_per_s": 20e9,
          "ram_total_bytes": 64 * GiB}
    for context in (64, 1024, 4096):
        engine = generate.device_bytes(st.config, dense_b, st.expert_bytes,
                                       min(context, st.config.max_position_embeddings), torch.bfloat16, CUDA)
        assert sizes.device_bytes(context) == engine
        for budget in range(engine.fixed - MiB, engine.needed(9) + MiB, 37 * 1024):
            p = plan.make_plan(hw, sizes, budget, context_tokens=context)
            k = engine.slots(budget)
            assert (p.device, p.cache_experts_per_layer) == (("cuda", k) if k >= 1 else ("cpu", 0))
            if k:  # what the wizard then offers, the engine accepts, and one more it refuses
                generate.check_budget(budget, engine, p.cache_experts_per_layer)
                if k < st.config.num_experts:
                    with pytest.raises(generate.UserError):
                        generate.check_budget(budget, engine, k + 1)


def test_an_untied_embedding_takes_no_gpu_bytes_and_a_tied_one_does():
    """On a GPU the engine keeps an embedding that is not the LM head's in host RAM (a token
    reads one row of it): move_dense neither moves nor counts it, and the planner leaves it out
    of the GPU's bytes. A tied one (no lm_head.weight: the head reads all of it) stays on the GPU."""
    st = store.open_store(demo_store_path())
    dense = store.read_dense(st)
    embed, head = (dense[n].numel() * 2 for n in ("model.embed_tokens.weight", "lm_head.weight"))  # bfloat16
    sizes = plan.ModelSizes.from_store(st.path)
    tied = {n: w for n, w in dense.items() if n != "lm_head.weight"}
    moved, untied_b = generate.move_dense(dense, torch.device("meta"), torch.bfloat16)
    _, tied_b = generate.move_dense(tied, torch.device("meta"), torch.bfloat16)
    assert moved["model.embed_tokens.weight"].device.type == "cpu" and moved["lm_head.weight"].is_meta
    assert untied_b == sizes.gpu_dense_bytes == sizes.dense_bytes - embed
    assert tied_b == untied_b - head + embed
    assert not generate.embedding_on_host(dense, torch.device("cpu"))  # the CPU engine's dense weights are all in RAM
    for model in sorted(MODEL_SHAPES):
        untied = plan.ModelSizes.from_config(MODEL_SHAPES[model], 4, 16)
        tied = plan.ModelSizes.from_config(dict(MODEL_SHAPES[model], tie_word_embeddings=True), 4, 16)
        assert untied.gpu_dense_bytes == untied.dense_bytes - untied.embed_bytes
        assert tied.gpu_dense_bytes == tied.dense_bytes == untied.dense_bytes - untied.embed_bytes  # no head
        assert untied.device_bytes(4096).dense == untied.gpu_dense_bytes


def test_a_large_head_of_a_model_with_quantized_attention_takes_a_byte_a_weight_on_the_gpu():
    """The engine rounds such a head to int8 on a GPU (generate.int8_head_on_gpu); the planner
    counts it so (all four full-size heads are 196-1105 MiB). A 16-bit store and a small head
    keep theirs, the tied one has none of its own."""
    for model in sorted(MODEL_SHAPES):
        sizes = plan.ModelSizes.from_config(MODEL_SHAPES[model], 4, 4)
        head = MODEL_SHAPES[model]["vocab_size"] * MODEL_SHAPES[model]["hidden_size"]
        assert sizes.int8_head_saving == head
        assert sizes.gpu_dense_bytes == sizes.dense_bytes - sizes.embed_bytes - head
        assert plan.ModelSizes.from_config(MODEL_SHAPES[model], 4, 16).int8_head_saving == 0
        tied = plan.ModelSizes.from_config(dict(MODEL_SHAPES[model], tie_word_embeddings=True), 4, 4)
        assert tied.int8_head_saving == 0
    assert not vram.int8_head(vram.INT8_HEAD_MIN_BYTES // 2 - 1, 4)
    assert vram.int8_head(vram.INT8_HEAD_MIN_BYTES // 2, 4) and vram.int8_head(vram.INT8_HEAD_MIN_BYTES // 2, 8)


def test_a_12_gib_budget_caches_every_gpt_oss_expert_with_its_embedding_in_ram():
    """gpt-oss-20b's embedding (201088 x 2880, 1.16 GB) in host RAM leaves a 12 GiB budget room
    for all 32 experts per layer (the whole token one CUDA graph); on the GPU it took 3 of them.
    The RAM the plan asks for holds it instead."""
    entry = next(e for e in json.loads(CATALOG.read_text())["models"] if e["id"] == "gpt-oss-20b-mxfp4")
    sizes = plan.ModelSizes.from_catalog(entry)
    assert sizes.host_dense_bytes == 201088 * 2880 * 2
    hw = {"gpu_name": "Fake", "torch_cuda_available": True, "h2d_bytes_per_s": 20e9, "ram_total_bytes": 64 * GiB}
    p = plan.make_plan(hw, sizes, 12 * GiB)
    on_gpu = replace(sizes, head_params=0)  # as tied: the embedding counted on the GPU
    assert p.cache_experts_per_layer == 32 and on_gpu.device_bytes(4096).slots(12 * GiB) == 29
    assert p.host_ram_needed_bytes == sizes.all_expert_bytes + sizes.host_dense_bytes + plan.HOST_RESERVE_BYTES


def test_without_a_budget_both_leave_the_same_slack():
    free = 20 * GiB
    hw = {"gpu_name": "Fake", "torch_cuda_available": True, "vram_free_bytes": free}
    assert plan.default_vram_budget(hw) == vram.auto_budget(free) == free - vram.AUTO_BUDGET_SLACK_BYTES


def test_kv_cache_bytes_are_what_the_engine_allocates():
    from moeferry.engine.runtime.model import KVCache

    for model in MODEL_SHAPES:
        cfg = shape_config(model, 2)
        kv = KVCache(cfg, 16, "cpu", torch.bfloat16)
        assert vram.kv_cache_bytes(cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim) == \
            kv.k.nbytes + kv.v.nbytes == KVCache.nbytes(cfg, 16, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_engine_on_a_gpu_takes_the_cache_the_plan_offers():
    path = demo_store_path()
    sizes = plan.ModelSizes.from_store(path)
    hw = {"gpu_name": "GPU", "torch_cuda_available": True, "h2d_bytes_per_s": 20e9, "ram_total_bytes": 64 * GiB}
    one = sizes.device_bytes(4096).needed(1)
    for budget in (one, one + sizes.device_bytes(4096).per_slot * 3 + 1):
        p = plan.make_plan(hw, sizes, budget)
        engine = generate.load_engine(path, device="cuda", vram_budget=budget, cuda_graphs=False)
        try:
            assert engine.model.cache.K == p.cache_experts_per_layer
            assert generate.engine_device_bytes(engine) == sizes.device_bytes(4096)
        finally:
            engine.close()
    with pytest.raises(generate.UserError):
        generate.load_engine(path, device="cuda", vram_budget=one - 1)


def test_what_the_budget_leaves_after_k_a_layer_gives_as_many_layers_one_expert_more():
    expert, layers = 55 * MiB, 32
    sizing = vram.DeviceBytes(dense=GiB, kv_cache=0, workspace=0, per_slot=layers * expert, num_experts=8,
                              moe_layers=layers)
    budget = sizing.needed(6) + 11 * expert + expert // 2  # six a layer, and eleven and a half experts left
    assert sizing.slots(budget) == 6 and sizing.extra_slot_layers(budget, 6) == 11
    assert sizing.extra_slot_layers(sizing.needed(6), 6) == 0
    assert sizing.extra_slot_layers(sizing.needed(7) - 1, 6) == layers - 1  # a byte short of seven everywhere
    assert sizing.extra_slot_layers(sizing.needed(8) + 10 * expert, 8) == 0  # every expert has a slot already
    assert sizing.extra_slot_layers(budget, 0) == 0


def test_the_engine_rounds_the_head_to_int8_where_the_planner_counts_it(monkeypatch):
    """generate.int8_head_on_gpu (the engine's rule) and plan.ModelSizes (the wizard's sizes)
    agree, and move_dense counts the int8 head's bytes: the demo's 8192 x 256 head with the
    threshold lowered to it, on the meta device (no GPU needed to size it)."""
    from moeferry.engine.kernels import hqq_gpu, int8_gpu
    monkeypatch.setattr(hqq_gpu, "fused_available", lambda device=None: True)
    st = store.open_store(demo_store_path())
    dense = store.read_dense(st)
    rows, cols = dense["lm_head.weight"].shape
    cuda = torch.device("cuda")
    assert not generate.int8_head_on_gpu(dense, cuda)  # 4 MiB: below vram.INT8_HEAD_MIN_BYTES
    assert plan.ModelSizes.from_store(st.path).int8_head_saving == 0
    monkeypatch.setattr(vram, "INT8_HEAD_MIN_BYTES", rows * cols * 2)
    assert generate.int8_head_on_gpu(dense, cuda)
    assert not generate.int8_head_on_gpu(dense, cuda, "reference")
    assert not generate.int8_head_on_gpu(dense, torch.device("cpu"))
    assert not generate.int8_head_on_gpu({n: w for n, w in dense.items() if n != "lm_head.weight"}, cuda)
    sixteen_bit = {n: (store.as_float(w, torch.bfloat16) if hasattr(w, "planes") else w) for n, w in dense.items()}
    assert not generate.int8_head_on_gpu(sixteen_bit, cuda)
    sizes = plan.ModelSizes.from_store(st.path)
    moved, rounded_b = generate.move_dense(dense, torch.device("meta"), torch.bfloat16, int8_head=True)
    _, float_b = generate.move_dense(dense, torch.device("meta"), torch.bfloat16)
    head = moved["lm_head.weight"]
    assert isinstance(head, int8_gpu.Int8Rows) and head.q.dtype == torch.int8 and head.q.shape == (rows, cols)
    assert float_b - rounded_b == rows * cols * 2 - (rows * cols + 4 * rows)
    assert sizes.int8_head_saving == rows * cols
    assert 0 <= rounded_b - sizes.gpu_dense_bytes <= 4 * rows  # the planner leaves out the row scales


def test_the_allocator_grows_its_segments_on_linux_unless_the_user_chose():
    env = {}
    vram.use_expandable_segments(env, "linux")
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    mine = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}
    vram.use_expandable_segments(mine, "linux")
    assert mine == {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}
    windows = {}
    vram.use_expandable_segments(windows, "win32")  # torch warns there and ignores it
    assert windows == {}
