"""The store's manifest.json: its format and the one reader of it. Imports no torch (the app
describes stores with it).

read_manifest is the loader's: a store whose manifest is missing, damaged, of another format
or version, or whose file list names anything but plain files of its folder (or lacks the
required files) is refused with one sentence. describe() is the app's: what a chosen folder's
manifest says, sections of the wrong type reading as absent, before any check runs (the
loader refuses such a store when it is opened).
"""

from __future__ import annotations

import json
from pathlib import Path

from moeferry.engine.errors import UserError
from moeferry.engine.setup.hf_cache import path_problem

FORMAT = "moeferry-store"
VERSION = 1
REQUIRED_FILES = ("config.json", "dense.safetensors", "experts.safetensors")
TOKENIZER_MODELS = ("tokenizer.json", "tokenizer.model")  # a store holds at least one


def resolve_store_path(arg: str | Path) -> Path:
    if str(arg) == "demo":
        from moeferry.engine.paths import demo_store_path
        return demo_store_path()
    return Path(arg).expanduser()


def read_manifest(arg: str | Path) -> tuple[Path, dict]:
    path = resolve_store_path(arg)
    mpath = path / "manifest.json"
    if not path.is_dir():
        raise UserError(f"{path} is not a folder; give the path of a MoE Ferry store "
                        f"(made by `moeferry convert`) or the word `demo`.")
    if not mpath.is_file():
        raise UserError(f"{path} has no manifest.json, so it is not a MoE Ferry store; "
                        f"convert a checkpoint into it first with `moeferry convert`.")
    if not inside(path, mpath):
        raise UserError(f"{mpath} is a link to a file outside the store; convert or download the model "
                        f"again.", 1)
    manifest = read_json(mpath)
    if manifest is None:
        raise UserError(f"{mpath} is damaged (not valid JSON); convert or download the model again.", 1)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else None
        raise UserError(f"{path} is not a MoE Ferry store (its manifest names format "
                        f"{got!r}); convert the checkpoint with `moeferry convert`.")
    if manifest.get("version") != VERSION:
        raise UserError(f"{path} is a store of format version {manifest.get('version')}, but this "
                        f"MoE Ferry reads version {VERSION}; convert the model again or update MoE Ferry.")
    problem = manifest_problem(manifest)
    if problem:
        raise UserError(f"{mpath} {problem}, so the store cannot be trusted; convert or download the "
                        f"model again.", 1)
    return path, manifest


def manifest_problem(manifest: dict) -> str | None:
    """Why the manifest's file list cannot be used, or None."""
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return "lists no files"
    for name, meta in files.items():
        problem = path_problem(name) or ("is in a subfolder" if "/" in name else None)
        if problem:
            return f"names the file {name[:80]!r}, which {problem}; a store holds plain files of its folder"
        if not (isinstance(meta, dict) and type(meta.get("size")) is int and meta["size"] >= 0
                and isinstance(meta.get("sha256"), str) and len(meta["sha256"]) == 64):
            return f"has no size and sha256 for {name}"
    missing = [f for f in REQUIRED_FILES if f not in files]
    if not any(f in files for f in TOKENIZER_MODELS):
        missing.append(" or ".join(TOKENIZER_MODELS))
    if missing:
        return f"does not list {', '.join(missing)}, which every store has"
    for key in ("quantization", "experts"):
        if not isinstance(manifest.get(key), dict):
            return f"has no {key} section"
    return None


def inside(folder: Path, p: Path) -> bool:
    """True when p, links followed, lies in folder (links followed too)."""
    try:
        return p.resolve().is_relative_to(folder.resolve())
    except (OSError, RuntimeError):  # a link loop
        return False


MAX_JSON_BYTES = 64 << 20  # a config, manifest or index is kilobytes; a larger one is not read into memory


def read_json(path: Path):
    """The file's JSON value, or None when it is missing, larger than MAX_JSON_BYTES or not JSON."""
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            return None
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None


def describe(folder: Path) -> dict | None:
    """The manifest of a folder as it reads, unchecked: {"source", "quantization", ...} with
    every section a dict ({} when absent or of another type); None when there is no manifest
    or it is not a JSON object."""
    manifest = read_json(Path(folder) / "manifest.json")
    if not isinstance(manifest, dict):
        return None
    return {key: section(manifest, key) for key in ("source", "quantization", "experts")}


def section(mapping: dict, key: str) -> dict:
    """mapping[key] when it is a dict, else {}."""
    value = mapping.get(key)
    return value if isinstance(value, dict) else {}
