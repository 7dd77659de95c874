"""Shared test helpers: tiny random Mixtral checkpoints written the way transformers writes them."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# for the processes tests start: the repository, then the inherited path (a worktree that puts its
# own moeferry there runs its code, not the install's)
PYTHONPATH = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture
def hub_online(tmp_path, monkeypatch):
    """Undo this file's HF_HUB_OFFLINE for one test (huggingface_hub reads it once, at import)
    and give it an empty Hugging Face home and cache under tmp_path."""
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_ENDPOINT", "HF_HUB_OFFLINE",
                "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf_cache"))
    return tmp_path


def make_tokenizer(vocab_size: int, folder: Path) -> None:
    """A character-level tokenizer with exactly vocab_size entries (ids 0..2 are special)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(vocab_size - 3):
        vocab[chr(0x21 + i) if i < 94 else chr(0x100 + i)] = i + 3
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(folder)


def make_checkpoint(folder: Path, seed: int = 0, shard: str | None = None, dtype=torch.float32, **overrides):
    """Save a random MixtralForCausalLM + tokenizer into folder; return the model (eval, float32)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
               num_experts_per_tok=2, max_position_embeddings=512, rms_norm_eps=1e-5,
               tie_word_embeddings=False)
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = MixtralForCausalLM(MixtralConfig(**cfg)).to(dtype).eval()
    return save_checkpoint(model, folder, shard)


def save_checkpoint(model, folder: Path, shard: str | None = None):
    """save_pretrained (sharded when shard is a size) plus a tokenizer for its vocabulary; returns model."""
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(folder, **kwargs)
    make_tokenizer(model.config.vocab_size, folder)
    return model


def reference_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    return out[0, len(ids):].tolist()


def run_cli(*args: str, timeout: int = 300):
    """Run `python -m moeferry.engine.cli ARGS` in a fresh process; return CompletedProcess."""
    import subprocess
    env = dict(os.environ, PYTHONPATH=PYTHONPATH)
    return subprocess.run([sys.executable, "-m", "moeferry.engine.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=str(ROOT))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """(folder, model) of one sharded tiny checkpoint, shared by tests that only read it."""
    folder = tmp_path_factory.mktemp("ckpt")
    return folder, make_checkpoint(folder, shard="60KB")


@pytest.fixture(scope="session")
def tiny_store(tiny_checkpoint, tmp_path_factory):
    from moeferry.engine.storage.convert import convert_checkpoint
    dest = tmp_path_factory.mktemp("stores") / "st16"
    convert_checkpoint(tiny_checkpoint[0], dest, 16, 16, "cpu")
    return dest
