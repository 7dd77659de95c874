"""Store format: verification finds any flipped byte; bad stores and checkpoints give one sentence."""

import json
import shutil

import pytest

from moeferry.engine.storage.convert import convert_checkpoint
from moeferry.engine.storage.store import verify_store
from tests.conftest import make_checkpoint, run_cli


@pytest.fixture(scope="module")
def q_store(tmp_path_factory, tiny_checkpoint):
    dest = tmp_path_factory.mktemp("q") / "store"
    convert_checkpoint(tiny_checkpoint[0], dest, 2, 4, "cpu")
    return dest


def test_a_flipped_byte_in_any_store_file_is_found(q_store, tmp_path):
    files = json.loads((q_store / "manifest.json").read_text())["files"]
    assert {"config.json", "dense.safetensors", "experts.safetensors", "tokenizer.json"} <= set(files)
    assert verify_store(q_store) == []
    for name, _meta in files.items():
        copy = tmp_path / name.replace(".", "_")
        shutil.copytree(q_store, copy)
        data = bytearray((copy / name).read_bytes())
        data[len(data) // 2] ^= 0x01
        (copy / name).write_bytes(bytes(data))
        bad = verify_store(copy)
        assert len(bad) == 1 and bad[0].startswith(name), (name, bad)


def test_verify_cli_exit_codes_name_the_bad_file(q_store, tmp_path):
    ok = run_cli("verify", str(q_store))
    assert ok.returncode == 0, ok.stderr
    copy = tmp_path / "s"
    shutil.copytree(q_store, copy)
    (copy / "dense.safetensors").write_bytes((copy / "dense.safetensors").read_bytes()[:-1] + b"\x99")
    (copy / "config.json").unlink()
    bad = run_cli("verify", str(copy))
    assert bad.returncode == 1
    assert "dense.safetensors" in bad.stderr and "config.json" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_unknown_store_version_is_refused(q_store, tmp_path):
    copy = tmp_path / "s"
    shutil.copytree(q_store, copy)
    m = json.loads((copy / "manifest.json").read_text())
    m["version"] = 99
    (copy / "manifest.json").write_text(json.dumps(m))
    r = run_cli("generate", str(copy), "--prompt", "hi", "--device", "cpu")
    assert r.returncode == 2 and "version 99" in r.stderr and "Traceback" not in r.stderr


def test_interrupted_conversion_leaves_no_complete_looking_folder(tiny_checkpoint, tmp_path, monkeypatch):
    import moeferry.engine.storage.convert as conv

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(conv, "write_experts", boom)
    with pytest.raises(KeyboardInterrupt):
        conv.convert_checkpoint(tiny_checkpoint[0], tmp_path / "dest", 16, 16, "cpu")
    assert not (tmp_path / "dest").exists()
    assert list(tmp_path.iterdir()) == []


def test_a_conversion_that_does_not_verify_is_not_installed(tiny_checkpoint, tmp_path, monkeypatch):
    """The app skips its own check after a conversion: the conversion's check must hold."""
    import moeferry.engine.storage.store as store
    from moeferry.engine.errors import UserError

    monkeypatch.setattr(store, "verify_store", lambda path, progress=None: ["experts.safetensors: wrong sha256"])
    with pytest.raises(UserError, match="failed verification"):
        convert_checkpoint(tiny_checkpoint[0], tmp_path / "dest", 2, 4, "cpu")
    assert list(tmp_path.iterdir()) == [], "neither the store nor its temporary folder stays"


@pytest.mark.parametrize("case", ["not_mixtral", "missing_shard", "no_folder", "dest_exists", "no_tokenizer",
                                  "damaged_index"])
def test_bad_checkpoints_get_one_sentence_and_exit_2(tmp_path, case):
    src = tmp_path / "ck"
    make_checkpoint(src, shard="60KB")
    dest = tmp_path / "out"
    if case == "not_mixtral":
        cfg = json.loads((src / "config.json").read_text())
        cfg["model_type"], cfg["architectures"] = "llama", ["LlamaForCausalLM"]
        (src / "config.json").write_text(json.dumps(cfg))
    elif case == "missing_shard":
        sorted(src.glob("model-*.safetensors"))[1].unlink()
    elif case == "no_folder":
        src = tmp_path / "nowhere"
    elif case == "dest_exists":
        dest.mkdir()
        (dest / "precious.txt").write_text("keep me")
    elif case == "no_tokenizer":
        (src / "tokenizer.json").unlink()
    elif case == "damaged_index":  # valid JSON, but no mapping of tensor names to files
        (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["model-1.safetensors"]}))
    r = run_cli("convert", str(src), str(dest), "--expert-bits", "16", "--attn-bits", "16")
    assert r.returncode == 2, r.stderr
    msg = r.stderr.strip()
    assert msg.startswith("moeferry: ") and "Traceback" not in msg and msg.count("\n") == 0, msg
    expected = {"not_mixtral": "'llama' model, which MoE Ferry cannot run", "missing_shard": "missing 1 of", "no_folder": "not a folder",
                "dest_exists": "already exists", "no_tokenizer": "no tokenizer",
                "damaged_index": "missing or damaged"}[case]
    assert expected in msg
    if case == "dest_exists":
        assert (dest / "precious.txt").read_text() == "keep me"


@pytest.mark.parametrize("args,expected", [
    (["--cache-experts", "0"], "between 1 and 4"),
    (["--cache-experts", "5"], "between 1 and 4"),
    (["--vram-budget", "10KB"], "cannot hold this model"),
    (["--vram-budget", "lots"], "Cannot read the size"),
    (["--device", "cuda"], "no CUDA GPU"),
])
def test_bad_generate_options_get_one_sentence_and_exit_2(tiny_store, args, expected):
    import torch
    if args[0] == "--device" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    r = run_cli("generate", str(tiny_store), "--prompt", "hi", *args)
    assert r.returncode == 2, r.stderr
    assert expected in r.stderr and "Traceback" not in r.stderr


def test_conversion_memory_stays_far_below_the_checkpoint(tmp_path):
    """Peak RSS grows by much less than the checkpoint's size: tensors are read one at a time."""
    src = tmp_path / "big"
    make_checkpoint(src, shard="40MB", hidden_size=512, intermediate_size=2048, num_local_experts=8,
                    num_hidden_layers=4, vocab_size=96)
    ckpt_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    assert ckpt_bytes > 390e6 and len(list(src.glob("model-*.safetensors"))) > 5
    code = (
        "import resource, sys\n"
        "from moeferry.engine.storage.convert import convert_checkpoint\n"
        "import moeferry.engine.runtime.generate\n"  # import everything first: measure conversion, not imports
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "convert_checkpoint(sys.argv[1], sys.argv[2], 16, 16, 'cpu')\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)\n"
    )
    import subprocess
    import sys

    from tests.conftest import ROOT
    r = subprocess.run([sys.executable, "-c", code, str(src), str(tmp_path / "st")], capture_output=True,
                       text=True, cwd=str(ROOT), timeout=600)
    assert r.returncode == 0, r.stderr
    growth = int(r.stdout.strip().splitlines()[-1])
    one_expert = 3 * 512 * 2048 * 4
    assert growth < 0.15 * ckpt_bytes, (growth, ckpt_bytes)
    assert growth < 12 * one_expert


def count_reads(monkeypatch):
    """Counters of config.json parses and file hashes by engine/storage/store.py."""
    from collections import Counter

    from moeferry.engine.storage import store

    parsed, hashed = Counter(), Counter()
    read_json, sha256_file = store.read_json, store.sha256_file

    def counting_read(path):
        parsed[path.name] += 1
        return read_json(path)

    def counting_hash(path, *args, **kwargs):
        hashed[path.name] += 1
        return sha256_file(path, *args, **kwargs)

    monkeypatch.setattr(store, "read_json", counting_read)
    monkeypatch.setattr(store, "sha256_file", counting_hash)
    return parsed, hashed


def test_a_verify_hashes_each_file_once_and_a_load_parses_the_config_once(monkeypatch):
    from moeferry.engine.paths import demo_store_path
    from moeferry.engine.runtime.generate import load_engine
    from moeferry.engine.storage.store import open_store

    path = demo_store_path()
    parsed, hashed = count_reads(monkeypatch)
    assert verify_store(path) == []
    files = json.loads((path / "manifest.json").read_text())["files"]
    assert hashed == {name: 1 for name in files} and parsed["config.json"] == 1
    for opened in (lambda: open_store(path), lambda: load_engine(path, device="cpu").close()):
        parsed.clear(), hashed.clear()
        opened()
        assert parsed["config.json"] == 1 and not hashed


def test_convert_takes_an_expert_group_size_or_refuses_it_in_one_sentence(tiny_checkpoint, tmp_path):
    """--expert-group-size 32 at 2 bits: the manifest records it, the experts file shrinks against
    the default groups of 16, and the store generates; a size that does not divide the rows, or
    one for 16-bit experts, gets one sentence and writes nothing."""
    from moeferry.engine.storage.manifest import read_manifest

    dest = tmp_path / "g32"
    r = run_cli("convert", str(tiny_checkpoint[0]), str(dest), "--expert-bits", "2", "--attn-bits", "4",
                "--device", "cpu", "--expert-group-size", "32")
    assert r.returncode == 0, r.stderr
    eq = read_manifest(dest)[1]["quantization"]["experts"]
    assert eq["bits"] == 2 and eq["group_size"] == 32
    g16 = tmp_path / "g16"
    convert_checkpoint(tiny_checkpoint[0], g16, 2, 4, "cpu")
    assert (dest / "experts.safetensors").stat().st_size < (g16 / "experts.safetensors").stat().st_size
    out = run_cli("generate", str(dest), "--prompt", "hi", "--max-new-tokens", "3", "--temperature", "0", "--json")
    assert out.returncode == 0, out.stderr
    for bits, size, expected in (("2", "48", "power of two"), ("2", "256", "divides every expert"),
                                 ("16", "32", "16-bit experts have no groups")):
        bad = tmp_path / f"bad{bits}-{size}"
        r = run_cli("convert", str(tiny_checkpoint[0]), str(bad), "--expert-bits", bits, "--attn-bits", "16",
                    "--device", "cpu", "--expert-group-size", size)
        assert r.returncode == 2 and expected in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
        assert not bad.exists()
