"""benchmarks/convert_bench.py: the conversion benchmark, on the CPU with tiny shapes."""

from __future__ import annotations

import json
import shutil

import pytest

from benchmarks import convert_bench as CB
from moeferry.engine.errors import UserError
from moeferry.engine.storage.store import verify_store
from tests.conftest import run_cli

pytestmark = pytest.mark.slow  # each conversion runs in a fresh process (torch + hqq imports)

TINY = dict(device="cpu", hidden=64, ffn=128, vocab=96)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("convert-bench")
    return workdir, CB.bench_convert(2, workdir, shard_bytes=200_000, keep_store=True, **TINY)


def test_report_fields(tiny_run):
    _, r = tiny_run
    assert (r["layers"], r["experts"], r["expert_bits"], r["attn_bits"], r["device"]) == (2, 8, 2, 4, "cpu")
    assert r["expert_matrices"] == 2 * 8 * 3
    assert r["s_per_expert_matrix"] == pytest.approx(r["experts_s"] / 48)
    assert r["convert_s"] > 0 and r["experts_s"] > 0 and r["attention_s"] > 0
    # every phase is found in the conversion's progress messages (a renamed message would
    # leave its phase at 0) and the rest (manifest, verify, install) takes time too
    assert min(r["fixed_s"], r["attention_s"], r["experts_s"], r["finish_s"]) > 0
    assert r["per_layer_s"] == pytest.approx((r["convert_s"] - r["fixed_s"]) / 2)
    assert r["extrapolated_32_layers_s"] == pytest.approx(r["fixed_s"] + 32 * r["per_layer_s"])
    assert r["extrapolation"].startswith("t(32) = t_fixed + 32 * (t_total - t_fixed) / 2")
    assert r["rss_baseline_bytes"] > 0 and r["peak_rss_growth_bytes"] >= 0
    assert r["peak_vram_bytes"] is None  # CPU run
    assert r["checkpoint_shards"] > 1 and not r["checkpoint_reused"]
    assert r["store_bytes"] > 0
    json.dumps(r)
    text = CB.summary(r)
    assert "per expert" in text and "t(32)" in text and "verified" in text


def test_checkpoint_is_in_hugging_face_layout(tiny_run):
    workdir, r = tiny_run
    src = workdir / "mixtral-random-2L-64x128x8"
    cfg = json.loads((src / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and cfg["model_type"] == "mixtral"
    index = json.loads((src / "model.safetensors.index.json").read_text())
    keys = index["weight_map"]
    assert "model.layers.1.block_sparse_moe.experts.7.w2.weight" in keys and "lm_head.weight" in keys
    shards = sorted(set(keys.values()))
    assert len(shards) == r["checkpoint_shards"]
    from safetensors import safe_open
    for name in shards:
        with safe_open(str(src / name), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        assert all(t.dtype.is_floating_point and t.dtype.itemsize == 2 for t in tensors.values())
        assert sum(t.numel() * 2 for t in tensors.values()) <= 200_000 or len(tensors) == 1
    # tokenizers, not transformers: importing huggingface_hub here while conftest sets
    # HF_HUB_OFFLINE would freeze it offline for tests/engine/setup/test_download.py
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    assert tok.get_vocab_size() == 96 and tok.token_to_id("</s>") == 2
    assert tok.encode("ab").ids == [tok.token_to_id("a"), tok.token_to_id("b")]
    config = json.loads((src / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "</s>" and "add_generation_prompt" in config["chat_template"]


def test_converted_store_verifies_and_generates(tiny_run):
    _, r = tiny_run
    assert r["store_verified"] and verify_store(r["store"]) == []
    out = run_cli("generate", r["store"], "--prompt", "ab", "--chat", "--max-new-tokens", "3",
                  "--device", "cpu", "--json")
    assert out.returncode == 0, out.stderr
    assert 1 <= len(json.loads(out.stdout)["token_ids"]) <= 3


def test_second_run_reuses_the_checkpoint_and_removes_its_store(tiny_run):
    workdir, _ = tiny_run
    r = CB.bench_convert(2, workdir, expert_bits=4, shard_bytes=200_000, **TINY)
    assert r["checkpoint_reused"] and r["generate_s"] == 0.0 and r["store_verified"]
    assert r["store"] is None and not (workdir / "store-2L-e4-a4").exists()


def test_full_size_shapes_and_bounded_shards():
    cfg = CB.hf_config(32, 4096, 14336, 8, 32000)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (32, 8, 128)
    shapes = CB.tensor_shapes(cfg)
    assert sum(CB._numel(s) for _, s in shapes) == 46_702_792_704  # Mixtral-8x7B: 46.7B parameters
    four = CB.tensor_shapes(CB.hf_config(4, 4096, 14336, 8, 32000))
    shards = CB.plan_shards(four, CB.SHARD_BYTES)
    sizes = [sum(2 * CB._numel(s) for _, s in shard) for shard in shards]
    assert max(sizes) <= CB.SHARD_BYTES and sum(sizes) == 2 * sum(CB._numel(s) for _, s in four)
    assert [n for shard in shards for n, _ in shard] == [n for n, _ in four]


def test_refuses_when_the_disk_is_too_small(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9, 1000))
    with pytest.raises(UserError, match="GB free"):
        CB.bench_convert(2, tmp_path, **TINY)
    assert not any(tmp_path.iterdir())


def test_cli(tmp_path, capsys):
    argv = ["--layers", "1", "--hidden", "64", "--ffn", "128", "--vocab", "96",
            "--device", "cpu", "--workdir", str(tmp_path), "--json"]
    assert CB.main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["layers"] == 1 and r["store_verified"] and r["expert_matrices"] == 24
    assert CB.main(["--layers", "0", "--device", "cpu"]) == 2
    assert "--layers must be 1 or more" in capsys.readouterr().err
