"""The embedded demo model: it ships, loads, verifies and generates deterministic greedy text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moeferry.engine.setup.demo import cli_demo, demo_store_path, greedy_reply

ROOT = Path(__file__).resolve().parents[3]
DEMO = demo_store_path()
PROMPT = "What is a list in Python?"


def test_demo_store_is_shipped_in_resources():
    assert DEMO == ROOT / "resources" / "demo"
    assert (DEMO / "manifest.json").is_file()


def test_demo_store_verifies_and_fits_the_size_limit():
    from moeferry.engine.storage.store import verify_store
    assert verify_store("demo") == []
    size = sum(p.stat().st_size for p in DEMO.iterdir() if p.is_file())
    assert size <= 25 * 10**6


def test_demo_is_a_small_mixtral():
    cfg = json.loads((DEMO / "config.json").read_text())
    assert cfg["model_type"] == "mixtral"
    assert cfg["num_local_experts"] == 8 and cfg["num_experts_per_tok"] == 2
    h, f, v, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * cfg.get("head_dim", h // cfg["num_attention_heads"])
    per_layer = 2 * h * h + 2 * h * kv + 8 * 3 * h * f + 8 * h + 2 * h
    assert n * per_layer + 2 * v * h + h <= 30_000_000


def test_demo_tokenizer_loads_offline_with_its_chat_template():
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(DEMO))
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<s><|user|>\nHi</s>\n<|assistant|>\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.eos_token_id in ids
    assert tok.decode(tok("def f(x):\n    return x")["input_ids"], skip_special_tokens=True) \
        == "def f(x):\n    return x"


@pytest.mark.slow
def test_demo_greedy_text_is_deterministic_and_matches_transformers():
    from transformers import AutoTokenizer

    from moeferry.engine.storage.store import load_dequantized_hf_model

    text, ids, _ = greedy_reply(PROMPT, max_new_tokens=12)
    text2, ids2, _ = greedy_reply(PROMPT, max_new_tokens=12)
    assert ids and (text, ids) == (text2, ids2)
    tok = AutoTokenizer.from_pretrained(str(DEMO))
    prompt = tok.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                     add_generation_prompt=True)
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    model = load_dequantized_hf_model("demo")
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=len(ids), do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    assert out[0, len(prompt_ids):].tolist() == ids


def test_demo_command_prints_its_path(capsys):
    assert cli_demo(["--path"]) == 0
    assert capsys.readouterr().out.strip() == str(DEMO)


@pytest.mark.slow
def test_demo_selftest_passes(capsys):
    assert cli_demo(["--selftest"]) == 0
    out = capsys.readouterr().out
    assert "Demo self-test passed" in out


@pytest.mark.slow
def test_demo_locality_command_on_a_short_text(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("Lists are mutable sequences, typically used to store collections of items.\n\n"
                    "The `json` module encodes and decodes JSON.\n")
    assert cli_demo(["locality", "--text", str(text), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["num_experts"] == 8 and r["top_k"] == 2 and r["tokens"] > 16
    assert set(r["prefetch_recall"]) == {"1", "2", "3"}
