"""Hostile and damaged stores and checkpoints (issue 12, cases 1, 2, 3, 6 and 8).

Every hostile store here has a manifest an attacker made consistent (sizes and sha256 of
what is in the folder), so only the checks under test can refuse it: no code runs, nothing
outside the store is read, no size read from a file is allocated before it is checked.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import subprocess
import sys
import threading
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from types import SimpleNamespace

import pytest

from moeferry.engine.errors import UserError
from moeferry.engine.storage import store
from moeferry.engine.storage.convert import convert_checkpoint
from tests.conftest import ROOT, make_tokenizer

MARKER_CODE = "import pathlib\npathlib.Path({marker!r}).write_text('ran')\n"


def copy_store(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def rehash(folder: Path, files: dict | None = None) -> dict:
    """Rewrite the manifest so that it lists what is in the folder (or `files`) with true hashes."""
    m = json.loads((folder / "manifest.json").read_text())
    if files is None:
        files = {p.name: {"size": p.stat().st_size, "sha256": store.sha256_file(p)}
                 for p in sorted(folder.iterdir()) if p.name != "manifest.json" and p.is_file()}
    m["files"] = files
    (folder / "manifest.json").write_text(json.dumps(m))
    return m


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def one_sentence(r, code: int, *needles: str) -> str:
    msg = r.stderr.strip()
    assert r.returncode == code, (r.returncode, msg)
    assert "Traceback" not in msg and "unexpected error" not in msg, msg
    lines = [l for l in msg.splitlines() if not l.startswith("BAD ")]
    assert len(lines) == 1 and lines[0].startswith("moeferry: "), msg
    for n in needles:
        assert n in msg, (n, msg)
    return msg


def cli(*args: str) -> SimpleNamespace:
    """`moeferry ARGS` in this process (as moeferry.engine.cli.main runs it): exit code, stdout, stderr."""
    from moeferry.engine.cli import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(args))
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def generate(path: Path, *extra: str) -> SimpleNamespace:
    return cli("generate", str(path), "--prompt", "hi", "--max-new-tokens", "2", "--device", "cpu", *extra)


# ---------------------------------------------------------------------------------------------
# 1. No code from a store or a checkpoint


@pytest.mark.parametrize("where", ["config.json", "tokenizer_config.json"])
def test_a_store_with_auto_map_is_refused_and_runs_nothing(tiny_store, tmp_path, where):
    st = copy_store(tiny_store, tmp_path / "s")
    marker = tmp_path / "ran.txt"
    (st / "evil.py").write_text(MARKER_CODE.format(marker=str(marker)))
    edit_json(st / where, auto_map={"AutoTokenizer": ["evil.EvilTokenizer", None],
                                    "AutoConfig": "evil.EvilConfig"})
    (st / "evil.py").unlink()  # the auto_map alone is refused (a .py file is tested below)
    rehash(st)
    r = subprocess.run([sys.executable, "-m", "moeferry.engine.cli", "generate", str(st), "--prompt", "hi",
                        "--device", "cpu"], input="y\n", capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
    one_sentence(r, 2, "auto_map", where, "never runs code")
    assert "[y/N]" not in r.stdout + r.stderr and not marker.exists()
    one_sentence(cli("verify", str(st)), 1, "auto_map")


def test_a_store_or_checkpoint_with_a_python_file_is_refused(tiny_store, tiny_checkpoint, tmp_path):
    st = copy_store(tiny_store, tmp_path / "s")
    (st / "modeling_evil.py").write_text("raise SystemExit('ran')\n")
    rehash(st)
    one_sentence(generate(st), 2, "modeling_evil.py")
    one_sentence(cli("verify", str(st)), 1, "modeling_evil.py")
    ck = tmp_path / "ck"
    shutil.copytree(tiny_checkpoint[0], ck)
    (ck / "sub").mkdir()
    (ck / "sub" / "tokenization_evil.py").write_text("raise SystemExit('ran')\n")
    one_sentence(cli("convert", str(ck), str(tmp_path / "out"), "--expert-bits", "16",
                         "--attn-bits", "16"), 2, "tokenization_evil.py")
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_with_auto_map_is_not_converted(tiny_checkpoint, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(tiny_checkpoint[0], ck)
    edit_json(ck / "tokenizer_config.json", auto_map={"AutoTokenizer": ["org/repo--tok.Tok", None]})
    with pytest.raises(UserError, match="auto_map in tokenizer_config.json"):
        convert_checkpoint(ck, tmp_path / "out", 16, 16, "cpu")
    assert list(tmp_path.iterdir()) == [ck]


def test_an_unsupported_model_type_is_refused_at_load_and_verify(tiny_store, tmp_path):
    st = copy_store(tiny_store, tmp_path / "s")
    edit_json(st / "config.json", model_type="custom_moe")
    rehash(st)
    one_sentence(generate(st), 2, "'custom_moe'", "cannot run")
    one_sentence(cli("verify", str(st)), 1, "'custom_moe'")


def test_verify_refuses_a_manifest_whose_expert_stride_does_not_fit_the_config(tiny_store, tmp_path):
    st = copy_store(tiny_store, tmp_path / "s")
    m = json.loads((st / "manifest.json").read_text())
    m["experts"]["stride"] += 64
    (st / "manifest.json").write_text(json.dumps(m))
    one_sentence(cli("verify", str(st)), 1, "does not fit", "convert the model again")


def test_the_tokenizer_never_runs_remote_code_even_past_the_checks(tiny_store, tmp_path, monkeypatch):
    """Defence in depth: with the folder checks switched off, transformers is still told not to
    trust the store's code, so it refuses instead of asking "run the custom code? [y/N]"."""
    from moeferry.engine.runtime import generate as gen

    st = copy_store(tiny_store, tmp_path / "s")
    marker = tmp_path / "ran.txt"
    (st / "evil_tok.py").write_text(MARKER_CODE.format(marker=str(marker)) +
                                    "from transformers import PreTrainedTokenizerFast as EvilTok\n")
    edit_json(st / "tokenizer_config.json", auto_map={"AutoTokenizer": [None, "evil_tok.EvilTok"]},
              tokenizer_class="EvilTok")
    rehash(st)
    monkeypatch.setattr(store, "check_no_code", lambda *a, **k: None)
    monkeypatch.setattr("builtins.input", lambda *a: pytest.fail("asked whether to run code"))
    try:
        gen.load_engine(st, device="cpu")
    except UserError as e:
        assert "tokenizer" in str(e)
    assert not marker.exists()


def test_every_transformers_load_says_trust_remote_code_false():
    """Every from_pretrained in the shipped code and the training tools passes the flag itself."""
    missing = []
    for folder in ("engine", "app", "training"):
        for path in (ROOT / folder).rglob("*.py"):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if "from_pretrained(" in line and not line.lstrip().startswith(("#", '"', "AutoTokenizer.from")):
                    if "trust_remote_code=False" not in line:
                        missing.append(f"{path.relative_to(ROOT)}:{n}")
    assert not missing, missing


# ---------------------------------------------------------------------------------------------
# 2. The manifest names only files of the store, lists what is loaded, and is complete


@pytest.mark.parametrize("name", ["../../../../etc/passwd", "/etc/hostname", "D:evil", "aux",
                                  "config.json:stream", "sub/../../x", ""])
def test_verify_and_open_refuse_names_outside_the_store(tiny_store, tmp_path, monkeypatch, name):
    st = copy_store(tiny_store, tmp_path / "s")
    m = rehash(st)
    files = dict(m["files"])
    files[name] = {"size": 1, "sha256": "0" * 64}
    rehash(st, files)
    hashed = []
    real = store.sha256_file
    monkeypatch.setattr(store, "sha256_file", lambda p, *a: hashed.append(Path(p)) or real(p, *a))
    for call in (store.verify_store, store.open_store):
        with pytest.raises(UserError) as e:
            call(st)
        assert e.value.exit_code == 1 and "plain files of its folder" in str(e.value)
    assert hashed == [], "nothing was read before the names were checked"
    one_sentence(cli("verify", str(st)), 1, "cannot be trusted")


def test_a_link_pointing_out_of_the_store_is_refused(tiny_store, tmp_path):
    st = copy_store(tiny_store, tmp_path / "s")
    outside = tmp_path / "outside.json"
    shutil.move(st / "tokenizer_config.json", outside)
    (st / "tokenizer_config.json").symlink_to(outside)
    rehash(st)  # sizes and hashes as the attacker's link shows them
    bad = store.verify_store(st)
    assert bad == ["tokenizer_config.json: a link to a file outside the store"]
    with pytest.raises(UserError, match="a link to a file outside the store"):
        store.open_store(st)


def test_an_empty_or_incomplete_manifest_is_refused(tiny_store, tmp_path):
    st = copy_store(tiny_store, tmp_path / "s")
    m = rehash(st)
    rehash(st, {})
    one_sentence(cli("verify", str(st)), 1, "lists no files")
    files = {k: v for k, v in m["files"].items() if k != "experts.safetensors"}
    data = bytearray((st / "experts.safetensors").read_bytes())
    data[-1] ^= 0xFF  # tampered, and its entry removed so that nothing would check it
    (st / "experts.safetensors").write_bytes(bytes(data))
    rehash(st, files)
    one_sentence(cli("verify", str(st)), 1, "does not list experts.safetensors")
    one_sentence(generate(st), 1, "does not list experts.safetensors")


def test_a_file_the_loader_reads_must_be_listed(tiny_store, tmp_path):
    st = copy_store(tiny_store, tmp_path / "s")
    m = rehash(st)
    assert not (st / "chat_template.json").exists()
    (st / "chat_template.json").write_text('{"chat_template": "injected"}')  # not in the manifest
    bad = store.verify_store(st)
    assert bad == ["chat_template.json: read by the loader but not listed in the manifest"]
    one_sentence(cli("verify", str(st)), 1, "chat_template.json")
    with pytest.raises(UserError, match="chat_template.json"):
        store.open_store(st)
    (st / "chat_template.json").unlink()
    rehash(st, {k: v for k, v in m["files"].items() if k != "tokenizer_config.json"})
    assert store.verify_store(st) == ["tokenizer_config.json: read by the loader but not listed in the manifest"]


def test_a_manifest_that_is_not_json_fails_verify_with_exit_1(tiny_store, tmp_path):
    st = copy_store(tiny_store, tmp_path / "s")
    (st / "manifest.json").write_text('{"format": "moeferry-store", "files": {')
    one_sentence(cli("verify", str(st)), 1, "not valid JSON")


# ---------------------------------------------------------------------------------------------
# 3. Sizes read from files are checked before anything is allocated


def claim_huge_tensor(path: Path, nbytes: int = 3 << 30) -> None:
    """Rewrite a safetensors header so that its first tensor claims `nbytes` (the file stays small)."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    start = header[name]["data_offsets"][0]
    header[name] = {"dtype": "U8", "shape": [nbytes], "data_offsets": [start, start + nbytes]}
    text = json.dumps(header).encode()
    text += b" " * (n - len(text)) if len(text) <= n else b""
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


def peak_rss_of(code: str) -> tuple[int, str]:
    """Run `code` in a fresh Python; (its peak RSS in bytes, its stderr).

    The peak is the process's own memory's high-water mark (VmHWM): Linux keeps ru_maxrss
    across fork and exec, so that would report the test runner's size as the child's."""
    full = ("import resource, sys\n"
            "import moeferry.engine.storage.convert, moeferry.engine.runtime.generate, transformers\n"
            f"{code}\n"
            "hwm = [line for line in open('/proc/self/status') if line.startswith('VmHWM:')]\n"
            "peak = int(hwm[0].split()[1]) if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            "print(peak * 1024, file=sys.stdout)\n")
    r = subprocess.run([sys.executable, "-c", full], capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
    assert r.returncode == 0, r.stderr
    return int(r.stdout.split()[-1]), r.stderr


def test_a_checkpoint_header_claiming_3_gib_is_refused_without_allocating(tiny_checkpoint, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(tiny_checkpoint[0], ck)
    shard = sorted(ck.glob("model-*.safetensors"))[0]
    claim_huge_tensor(shard)
    assert shard.stat().st_size < 1 << 20
    code = ("from moeferry.engine.storage.convert import convert_checkpoint\nfrom moeferry.engine.errors import UserError\n"
            "try:\n"
            f"    convert_checkpoint({str(ck)!r}, {str(tmp_path / 'out')!r}, 16, 16, 'cpu')\n"
            "except UserError as e:\n    print(e, file=sys.stderr)\n")
    peak, err = peak_rss_of(code)
    assert peak < 1.5e9, f"peak RSS {peak / 1e9:.2f} GB"
    assert shard.name in err and "outside the file" in err
    one_sentence(cli("convert", str(ck), str(tmp_path / "out2"), "--expert-bits", "16",
                         "--attn-bits", "16"), 2, "truncated or damaged")


def test_a_store_whose_dense_file_claims_3_gib_is_refused_without_allocating(tiny_store, tmp_path):
    st = copy_store(tiny_store, tmp_path / "s")
    claim_huge_tensor(st / "dense.safetensors")
    rehash(st)
    code = ("from moeferry.engine.runtime.generate import load_engine\nfrom moeferry.engine.errors import UserError\n"
            "try:\n"
            f"    load_engine({str(st)!r}, device='cpu')\n"
            "except UserError as e:\n    print(e, file=sys.stderr)\n")
    peak, err = peak_rss_of(code)
    assert peak < 1.5e9, f"peak RSS {peak / 1e9:.2f} GB"
    assert "dense.safetensors" in err and "outside the file" in err
    one_sentence(generate(st), 2, "dense.safetensors")


@pytest.mark.parametrize("changes,needle", [
    ({"num_hidden_layers": 10**6, "num_local_experts": 1000}, "num_layers is 1000000"),
    ({"num_hidden_layers": 1024, "num_local_experts": 4096}, "does not belong to these weights"),
    ({"num_hidden_layers": 2.5}, "num_layers"),
    ({"num_hidden_layers": "2"}, "num_layers"),
    ({"num_local_experts": -4}, "num_experts"),
    ({"num_experts_per_tok": 9}, "experts per token"),
    ({"rms_norm_eps": None}, "rms_norm_eps"),
    ({"vocab_size": None}, "vocab_size"),
    ({"num_attention_heads": 0}, "count of zero"),
    ({"hidden_size": "4096"}, "value of the wrong kind"),
])
def test_config_counts_are_checked_before_anything_is_built(tiny_checkpoint, tmp_path, changes, needle):
    ck = tmp_path / "ck"
    shutil.copytree(tiny_checkpoint[0], ck)
    edit_json(ck / "config.json", **changes)
    code = ("from moeferry.engine.storage.convert import convert_checkpoint\nfrom moeferry.engine.errors import UserError\n"
            "try:\n"
            f"    convert_checkpoint({str(ck)!r}, {str(tmp_path / 'out')!r}, 16, 16, 'cpu')\n"
            "except UserError as e:\n    print(e, file=sys.stderr)\n")
    peak, err = peak_rss_of(code)
    assert peak < 1.5e9 and needle in err, (peak, err)
    assert not (tmp_path / "out").exists()


def test_a_store_config_inflated_after_conversion_is_refused(tiny_store, tmp_path):
    st = copy_store(tiny_store, tmp_path / "s")
    edit_json(st / "config.json", num_hidden_layers=1000, num_local_experts=4000)
    rehash(st)
    one_sentence(generate(st), 2, "does not belong to these weights")
    st2 = copy_store(tiny_store, tmp_path / "s2")
    edit_json(st2 / "config.json", intermediate_size=64)  # the manifest's layout no longer fits
    rehash(st2)
    one_sentence(generate(st2), 1, "expert layout")


def test_a_truncated_checkpoint_shard_gives_a_sentence(tiny_checkpoint, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(tiny_checkpoint[0], ck)
    shard = sorted(ck.glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-100])
    one_sentence(cli("convert", str(ck), str(tmp_path / "out"), "--expert-bits", "16",
                         "--attn-bits", "16"), 2, shard.name, "truncated")


@pytest.mark.parametrize("shard,needle", [("/etc/hostname", "absolute"), ("../ck/{}", "..")])
def test_an_index_naming_shards_outside_the_checkpoint_is_refused(tiny_checkpoint, tmp_path, shard, needle):
    """model.safetensors.index.json's file names were opened as they were, so an index could make
    convert read any file (found by hostile files: /etc/passwd was read as a shard)."""
    ck = tmp_path / "ck"
    shutil.copytree(tiny_checkpoint[0], ck)
    index = json.loads((ck / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = shard.format(index["weight_map"]["lm_head.weight"])  # ..: the same file
    (ck / "model.safetensors.index.json").write_text(json.dumps(index))
    one_sentence(cli("convert", str(ck), str(tmp_path / "out"), "--expert-bits", "16", "--attn-bits", "16"),
                 2, "index.json", needle)


def test_an_index_whose_weight_map_is_a_list_is_one_sentence(tiny_checkpoint, tmp_path):
    """Found by hostile files: an unexpected AttributeError from telling the paper's format apart."""
    ck = tmp_path / "ck"
    shutil.copytree(tiny_checkpoint[0], ck)
    (ck / "model.safetensors.index.json").write_text('{"weight_map": [1, 2]}')
    one_sentence(cli("convert", str(ck), str(tmp_path / "out"), "--expert-bits", "16", "--attn-bits", "16"),
                 2, "index.json", "damaged")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
def test_a_named_pipe_among_the_shards_is_not_opened(tiny_checkpoint, tmp_path):
    """Opening a FIFO blocks until someone writes to it: convert hung for ever (found by hostile files)."""
    ck = tmp_path / "ck"
    ck.mkdir()
    for f in tiny_checkpoint[0].iterdir():
        if f.name != "model.safetensors.index.json":
            shutil.copy(f, ck / f.name)
    os.mkfifo(ck / "zz-extra.safetensors")
    from moeferry.engine.storage.convert import index_tensors
    refs = []
    reader = threading.Thread(target=lambda: refs.append(index_tensors(ck)), daemon=True)
    reader.start()
    reader.join(30)
    if reader.is_alive():  # blocked opening the pipe: let it go (it reads nothing), then fail
        os.close(os.open(ck / "zz-extra.safetensors", os.O_WRONLY | os.O_NONBLOCK))
        reader.join(30)
    assert refs and "lm_head.weight" in refs[0]


# ---------------------------------------------------------------------------------------------
# 6 and 8. convert: free space, leftovers, fsync, unwritable DEST, tokenizer, generate's input


def test_convert_refuses_up_front_when_the_store_does_not_fit(tiny_checkpoint, tmp_path, monkeypatch):
    import moeferry.engine.storage.convert as conv

    real = shutil.disk_usage
    monkeypatch.setattr(conv.shutil, "disk_usage", lambda p: real(p)._replace(free=200_000))
    started = []
    monkeypatch.setattr(conv, "write_dense", lambda *a: started.append(1))
    with pytest.raises(UserError) as e:
        conv.convert_checkpoint(tiny_checkpoint[0], tmp_path / "out", 16, 16, "cpu")
    msg = str(e.value)
    assert "Not enough free disk space" in msg and "0.00 GB is free" in msg and "needs 0.0" in msg
    assert e.value.exit_code == 1 and not started and list(tmp_path.iterdir()) == []


def test_the_needed_space_is_the_stores_size(tiny_checkpoint, tmp_path, monkeypatch):
    import moeferry.engine.storage.convert as conv

    needed = []
    real = conv.check_free_space
    monkeypatch.setattr(conv, "check_free_space", lambda dest, n: needed.append(n) or real(dest, n))
    dest = conv.convert_checkpoint(tiny_checkpoint[0], tmp_path / "out", 2, 4, "cpu")
    tensors = sum((dest / f).stat().st_size for f in ("dense.safetensors", "experts.safetensors"))
    assert 0.9 * tensors <= needed[0] <= tensors  # the tensors' bytes, headers and padding aside


def test_leftovers_of_a_killed_run_are_removed_before_space_is_measured(tiny_checkpoint, tmp_path, monkeypatch):
    import moeferry.engine.storage.convert as conv

    leftover = store.temp_sibling(tmp_path / "out")
    leftover.mkdir()
    (leftover / "experts.safetensors").write_bytes(b"\0" * 1_000_000)
    real = shutil.disk_usage
    monkeypatch.setattr(conv.shutil, "disk_usage",
                        lambda p: real(p)._replace(free=0 if leftover.exists() else real(p).free))
    conv.convert_checkpoint(tiny_checkpoint[0], tmp_path / "out", 16, 16, "cpu")
    assert not leftover.exists() and store.verify_store(tmp_path / "out") == []


def test_every_file_and_the_folder_are_fsynced_before_the_rename(tiny_checkpoint, tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
                        or real_fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: events.append(("replace", str(a), str(b)))
                        or real_replace(a, b))
    dest = convert_checkpoint(tiny_checkpoint[0], tmp_path / "out", 16, 16, "cpu")
    tmp = str(store.temp_sibling(dest))
    rename = events.index(("replace", tmp, str(dest)))
    synced = {e[1] for e in events[:rename] if e[0] == "fsync"}
    assert {f"{tmp}/{p.name}" for p in dest.iterdir()} | {tmp} <= synced
    assert ("fsync", str(tmp_path)) in events[rename:], "the parent folder, after the rename"


def test_an_unwritable_dest_and_a_full_disk_give_a_sentence(tiny_checkpoint, tmp_path, monkeypatch):
    import moeferry.engine.storage.convert as conv
    from moeferry.engine.storage import safetensors_io

    real_mkdir = Path.mkdir

    def refuse(self, *a, **k):
        if self.name.endswith(".partial"):
            raise PermissionError(13, "Permission denied", str(self))
        return real_mkdir(self, *a, **k)

    monkeypatch.setattr(Path, "mkdir", refuse)
    with pytest.raises(UserError, match="Permission denied.*a folder you can write to") as e:
        conv.convert_checkpoint(tiny_checkpoint[0], tmp_path / "out", 16, 16, "cpu")
    assert e.value.exit_code == 2
    monkeypatch.setattr(Path, "mkdir", real_mkdir)

    def full(self, b):
        raise OSError(28, "No space left on device", str(self.path))

    monkeypatch.setattr(safetensors_io.StreamingWriter, "_write", full)
    with pytest.raises(UserError, match="No space left on device.*free some disk space") as e:
        conv.convert_checkpoint(tiny_checkpoint[0], tmp_path / "out", 16, 16, "cpu")
    assert e.value.exit_code == 1 and list(tmp_path.iterdir()) == []


def test_a_tokenizer_smaller_than_the_vocabulary_is_refused(tiny_checkpoint, tmp_path):
    small = tmp_path / "tok"
    make_tokenizer(64, small)  # the model has 96 tokens
    r = cli("convert", str(tiny_checkpoint[0]), str(tmp_path / "out"), "--expert-bits", "16",
                "--attn-bits", "16", "--tokenizer", str(small))
    one_sentence(r, 2, "knows 64 tokens", "has 96")
    assert not (tmp_path / "out").exists()
    same = tmp_path / "tok96"
    make_tokenizer(96, same)
    assert convert_checkpoint(tiny_checkpoint[0], tmp_path / "ok", 16, 16, "cpu", tokenizer=same).is_dir()


def test_a_tokenizer_short_of_the_vocabulary_by_its_padding_is_taken(tmp_path):
    """Models pad their vocabulary (Qwen3: 151,936 rows, 151,669 tokens); up to 1 % is padding."""
    from moeferry.engine.storage import convert as conv
    make_tokenizer(990, tmp_path / "tok")
    conv.check_tokenizer(tmp_path / "tok", SimpleNamespace(vocab_size=1000))
    with pytest.raises(UserError, match="knows 990 tokens but the model has 1024"):
        conv.check_tokenizer(tmp_path / "tok", SimpleNamespace(vocab_size=1024))


@pytest.mark.parametrize("args,needle", [
    (["--temperature", "nan"], "--temperature"), (["--temperature", "1e-45"], "--temperature"),
    (["--temperature", "inf"], "--temperature"), (["--top-p", "nan"], "--top-p"),
])
def test_generate_refuses_nan_and_vanishing_temperatures(tiny_store, args, needle):
    one_sentence(generate(tiny_store, *args), 2, needle)


def test_a_prompt_that_is_not_utf8_gives_a_sentence(tiny_store):
    r = subprocess.run([os.fsencode(sys.executable), b"-m", b"moeferry.engine.cli", b"generate",
                        os.fsencode(str(tiny_store)), b"--prompt", b"caf\xe9 \xff", b"--device", b"cpu"],
                       capture_output=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
    r.stderr = r.stderr.decode("utf-8", "replace")
    one_sentence(r, 2, "not valid UTF-8")


def test_a_small_temperature_still_works(tiny_store):
    r = generate(tiny_store, "--temperature", "0.001", "--seed", "1", "--json")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["token_ids"]) >= 1


def rewrite_header(path: Path, edit) -> None:
    """Apply edit(header) to a safetensors file's header, keeping its data where it was."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()
    assert len(text) <= n
    path.write_bytes(raw[:8] + text + b" " * (n - len(text)) + raw[8 + n:])


@pytest.mark.parametrize("edit", ["dtype", "offset", "overlap"])
def test_an_experts_file_that_is_not_one_byte_tensor_at_its_start_is_refused(tiny_store, tmp_path, edit):
    st = copy_store(tiny_store, tmp_path / "s")

    def change(h):
        e = h["experts"]
        start, end = e["data_offsets"]
        if edit == "dtype":  # the same bytes read as float16 pairs
            e.update(dtype="F16", shape=[e["shape"][0], e["shape"][1], e["shape"][2] // 2])
        elif edit == "offset":  # a window shifted into the padding
            h["experts"] = dict(e, shape=[e["shape"][0], e["shape"][1], e["shape"][2] - 1],
                                data_offsets=[start + e["shape"][0] * e["shape"][1], end])
        else:  # a second tensor over the same bytes
            h["shadow"] = dict(e)

    rewrite_header(st / "experts.safetensors", change)
    rehash(st)
    s = store.open_store(st)
    with pytest.raises(UserError) as e:
        store.experts_array(s)
    assert "experts.safetensors" in str(e.value) and "Traceback" not in str(e.value)


@pytest.mark.parametrize("changes", [
    {"rope_parameters": [1]}, {"rope_parameters": {"rope_theta": "big", "rope_type": "default"}},
    {"rope_parameters": None, "rope_scaling": "linear"}, {"rope_parameters": None, "rope_scaling": [2.0]},
    {"rms_norm_eps": -1}, {"sliding_window": True}, {"num_key_value_heads": 3}, {"head_dim": 10**9},
    {"max_position_embeddings": 0}])
def test_a_store_config_with_unusable_values_is_one_sentence(tiny_store, tmp_path, changes):
    st = copy_store(tiny_store, tmp_path / "s")
    edit_json(st / "config.json", **changes)
    rehash(st)
    with pytest.raises(UserError) as e:
        store.open_store(st)
    assert "config.json" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("text,needle", [
    ('{"repetition_penalty": "x"}', "repetition_penalty x"),
    ('{"repetition_penalty": -1.5}', "repetition_penalty -1.5"),
    ('{"no_repeat_ngram_size": 2.5}', "no_repeat_ngram_size 2.5"),
    ("[1, 2]", "not a JSON object"),
])
def test_a_damaged_generation_config_is_one_sentence(tiny_store, tmp_path, text, needle):
    """Its values were read without a check (found by hostile files: "x" ended in an unexpected
    ValueError, a negative penalty went unchecked into the sampler)."""
    st = copy_store(tiny_store, tmp_path / "s")
    (st / "generation_config.json").write_text(text)
    rehash(st)
    one_sentence(generate(st), 2, "generation_config.json", needle)


@pytest.mark.parametrize("template", ["{{ ''.__class__.__mro__[1].__subclasses__() }}", "{% for m in messages %}"])
def test_a_chat_template_that_fails_is_one_sentence(tiny_store, tmp_path, template):
    """The sandbox's refusal of an escape and a syntax error reached the user as an unexpected
    error (found by hostile files)."""
    st = copy_store(tiny_store, tmp_path / "s")
    (st / "chat_template.jinja").write_text(template)
    rehash(st)
    one_sentence(generate(st, "--chat"), 2, "chat template", "without --chat")


def test_a_json_file_too_large_for_a_config_is_not_read(tiny_checkpoint, tmp_path, monkeypatch):
    """A 300 MB config.json was read whole (825 MB of memory); past MAX_JSON_BYTES it is not
    read at all, and the checkpoint gets one sentence."""
    from moeferry.engine.storage import manifest
    ck = tmp_path / "ck"
    shutil.copytree(tiny_checkpoint[0], ck)
    config = ck / "config.json"
    monkeypatch.setattr(manifest, "MAX_JSON_BYTES", config.stat().st_size - 1)
    monkeypatch.setattr(Path, "read_text", lambda *a, **k: pytest.fail("read a file past the limit"))
    assert manifest.read_json(config) is None
    with pytest.raises(UserError, match="config.json"):
        convert_checkpoint(ck, tmp_path / "out", 16, 16, "cpu")


def test_a_checkpoint_whose_tokenizer_does_not_load_is_refused_before_converting(tiny_checkpoint, tmp_path):
    """It converted, and only the first generate refused it (pointing at `verify`, which passed)."""
    ck = tmp_path / "ck"
    shutil.copytree(tiny_checkpoint[0], ck)
    (ck / "tokenizer.json").write_text('{"model": "this is not a tokenizer"}')
    r = cli("convert", str(ck), str(tmp_path / "out"), "--expert-bits", "16", "--attn-bits", "16")
    one_sentence(r, 2, "Cannot load the tokenizer", str(ck))
    assert not (tmp_path / "out").exists()
