"""App settings: one JSON file, keys in an enum, types coerced in one place. No Qt here.

The file is read field by field: a value of the wrong type, out of its range, NaN or
infinite (JSON's 1e400), an `installed` entry or a `pending_install` that does not have the
fields the app reads, is replaced by its default and named in `Settings.notice` ("A setting
was damaged and reset: ..."), so a damaged file can never stop the app from starting.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from moeferry.app.paths import move_aside, portable_store_path

log = logging.getLogger(__name__)
SETTINGS_FILE = "settings.json"
_SAVE_LOCK = threading.Lock()
SCHEMA_VERSION = 1


class Key(str, Enum):
    WIZARD_DONE = "wizard_done"
    STORE_PATH = "store_path"          # the store the chat loads ("" = none chosen yet)
    INSTALLED = "installed"            # list of {"path", "name", "expert_bits", "attn_bits", "source"}
    PENDING_INSTALL = "pending_install"  # an install to resume after a restart, or None
    DEVICE = "device"                  # auto | cpu | cuda
    PREFETCH = "prefetch"              # 0..4
    CACHE_EXPERTS = "cache_experts"    # experts per layer kept on the GPU; 0 = from the VRAM budget
    VRAM_BUDGET_GB = "vram_budget_gb"  # 0 = let the engine decide
    CPU_EXPERTS = "cpu_experts"        # off | auto | all: missed experts computed on the CPU
    CPU_THREADS = "cpu_threads"        # threads of the CPU's work; 0 = the engine's choice
    TEMPERATURE = "temperature"
    TOP_P = "top_p"
    MAX_NEW_TOKENS = "max_new_tokens"
    SEED = "seed"                      # -1 = random
    THEME = "theme"                    # system | light | dark
    FONT_SIZE = "font_size"            # text size in points; 0 = the system's
    LAST_CONVERSATION = "last_conversation"
    WINDOW_GEOMETRY = "window_geometry"  # hex of QWidget.saveGeometry()
    API_ENABLED = "api_enabled"        # serve the loaded model on 127.0.0.1 (engine/api/serve.py)
    API_PORT = "api_port"
    API_KEY = "api_key"                # "" = no key asked for


DEFAULTS: dict[Key, Any] = {
    Key.WIZARD_DONE: False,
    Key.STORE_PATH: "",
    Key.INSTALLED: [],
    Key.PENDING_INSTALL: None,
    Key.DEVICE: "auto",
    Key.PREFETCH: 1,
    Key.CACHE_EXPERTS: 0,
    Key.VRAM_BUDGET_GB: 0.0,
    Key.CPU_EXPERTS: "off",
    Key.CPU_THREADS: 0,
    Key.TEMPERATURE: 0.7,
    Key.TOP_P: 0.9,
    Key.MAX_NEW_TOKENS: 512,
    Key.SEED: -1,
    Key.THEME: "system",
    Key.FONT_SIZE: 0.0,
    Key.LAST_CONVERSATION: "",
    Key.WINDOW_GEOMETRY: "",
    Key.API_ENABLED: False,
    Key.API_PORT: 8080,
    Key.API_KEY: "",
}

_CHOICES = {Key.DEVICE: ("auto", "cpu", "cuda"), Key.THEME: ("system", "light", "dark"),
            Key.CPU_EXPERTS: ("off", "auto", "all")}
_RANGES = {
    Key.PREFETCH: (0, 4),
    Key.CACHE_EXPERTS: (0, 64),
    Key.CPU_THREADS: (0, 1024),
    Key.VRAM_BUDGET_GB: (0.0, 1024.0),
    Key.TEMPERATURE: (0.0, 2.0),
    Key.TOP_P: (0.01, 1.0),
    Key.MAX_NEW_TOKENS: (1, 32768),
    Key.SEED: (-1, 2**31 - 1),
    Key.API_PORT: (1024, 65535),
    Key.FONT_SIZE: (0.0, 32.0),
}
# Above 0 but below this, a temperature divides the logits into infinities: 0 (greedy) or at least this
MIN_TEMPERATURE = 1e-3


def coerce(key: Key, value: Any) -> Any:
    """Return `value` as the key's type, clamped to its range; the default when it can't be read.

    Lenient, for values set by the app (Qt may hand over strings); the file is read by `validated`.
    """
    default = DEFAULTS[key]
    if isinstance(value, float) and not math.isfinite(value):
        return default
    try:
        if isinstance(default, bool):
            out: Any = value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")
        elif isinstance(default, int):
            out = int(value)
        elif isinstance(default, float):
            out = float(value)
        elif isinstance(default, str):
            out = "" if value is None else str(value)
        elif isinstance(default, list):
            out = [dict(v) for v in value] if isinstance(value, list) else list(default)
        else:  # optional dict
            out = dict(value) if isinstance(value, dict) else None
    except (TypeError, ValueError, OverflowError):
        return default
    if isinstance(out, float) and not math.isfinite(out):
        return default
    if key in _CHOICES and out not in _CHOICES[key]:
        return default
    if key == Key.STORE_PATH:
        out = portable_store_path(out)
    if key == Key.INSTALLED:
        out = portable_entries(out)
    if key in _RANGES:
        lo, hi = _RANGES[key]
        out = min(max(out, lo), hi)
    if key is Key.TEMPERATURE and 0 < out < MIN_TEMPERATURE:
        return default
    return out


_ENTRY_FIELDS = {"path": str, "name": str}  # what the app reads of every `installed` entry
_ENTRY_OPTIONAL = {"expert_bits": (int, type(None)), "attn_bits": (int, type(None)), "source_path": (str,),
                   "source_deleted": (bool,)}
_REQUEST_TYPES = {"str": (str,), "str | None": (str, type(None)), "bool": (bool,), "int": (int,)}


def _number(value: Any, kind: type) -> Any:
    """value as an int or float if it is one (finite; 512.0 counts as an int), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if kind is int:
        return int(value) if float(value).is_integer() else None
    return float(value)


def portable_entries(entries: list[dict]) -> list[dict]:
    """Installed entries with the demo under its portable name, each path once (the last wins)."""
    return list({e.get("path"): e for e in
                 ({**e, "path": portable_store_path(str(e.get("path") or ""))} for e in entries)}.values())


def validated(key: Key, value: Any) -> tuple[Any, bool]:
    """(value, True) when the stored value is of the key's type and in its range, else (default, False)."""
    default = DEFAULTS[key]
    if key is Key.INSTALLED:
        entries, ok = _valid_installed(value)
        return portable_entries(entries), ok
    if key is Key.PENDING_INSTALL:
        return (value, True) if value is None or _valid_request(value) else (None, False)
    if isinstance(default, bool):
        out = value if isinstance(value, bool) else None
    elif isinstance(default, (int, float)):
        out = _number(value, type(default))
    else:
        out = value if isinstance(value, str) else None
    if out is None or (key in _CHOICES and out not in _CHOICES[key]):
        return default, False
    if key in _RANGES and not _RANGES[key][0] <= out <= _RANGES[key][1]:
        return default, False
    if key is Key.TEMPERATURE and 0 < out < MIN_TEMPERATURE:
        return default, False
    return (portable_store_path(out) if key is Key.STORE_PATH else out), True


def _is(value: Any, types: tuple) -> bool:
    """isinstance, except that a bool is not taken for an int (JSON keeps them apart)."""
    return isinstance(value, types) and (isinstance(value, bool) == (bool in types) or object in types)


def _valid_entry(e: Any) -> bool:
    return (isinstance(e, dict) and all(_is(e.get(k), (t,)) and e.get(k) for k, t in _ENTRY_FIELDS.items())
            and all(_is(e[k], t) for k, t in _ENTRY_OPTIONAL.items() if k in e))


def _valid_installed(value: Any) -> tuple[list, bool]:
    """The well-formed entries, and whether there was nothing to drop."""
    if not isinstance(value, list):
        return [], False
    good = [dict(e) for e in value if _valid_entry(e)]
    return good, len(good) == len(value)


def _valid_request(value: Any) -> bool:
    """A pending install must be an InstallRequest's fields with their types (extra keys are ignored)."""
    from dataclasses import MISSING, fields

    from moeferry.app.install import InstallRequest

    if not isinstance(value, dict):
        return False
    for f in fields(InstallRequest):
        if f.name not in value:
            if f.default is MISSING:
                return False
            continue
        if not _is(value[f.name], _REQUEST_TYPES.get(str(f.type), (object,))):
            return False
    return True


@dataclass
class Settings:
    """The settings of one data folder. `notice` says what was recovered when loading."""

    path: Path
    values: dict[Key, Any] = field(default_factory=dict)
    notice: str = ""

    def get(self, key: Key) -> Any:
        value = self.values.get(key, DEFAULTS[key])
        return list(value) if isinstance(value, list) else value

    def set(self, key: Key | str, value: Any) -> None:
        key = Key(key)  # keys that crossed a Qt signal arrive as plain strings
        self.values[key] = coerce(key, value)

    def update(self, changes: dict[Key, Any]) -> None:
        for key, value in changes.items():
            self.set(key, value)

    def save(self) -> None:
        data = {"version": SCHEMA_VERSION}
        data.update({k.value: v for k, v in self.values.items()})
        text = json.dumps(data, indent=2)
        with _SAVE_LOCK:
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, self.path)

    def save_in_background(self) -> threading.Thread:
        """Write the file on a short-lived thread, so the UI thread does not wait on the disk."""
        def run() -> None:
            try:
                self.save()
            except OSError:
                log.exception("saving the settings failed")
        thread = threading.Thread(target=run, name="moeferry-settings", daemon=True)
        thread.start()
        return thread


def _migrate(data: dict) -> dict:
    """Bring an older settings file up to SCHEMA_VERSION (version 1 is the first)."""
    data.setdefault("version", SCHEMA_VERSION)
    return data


def load_settings(folder: Path) -> Settings:
    """Read `settings.json` in `folder`; a damaged file is moved aside and defaults are used."""
    path = folder / SETTINGS_FILE
    settings = Settings(path=path)
    if not path.exists():
        return settings
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError("settings file does not hold an object")
    except (OSError, ValueError, UnicodeDecodeError):
        moved = move_aside(path)
        settings.notice = f"The settings file was damaged, so it was moved to {moved.name} and defaults are used."
        return settings
    data = _migrate(data)
    reset = []
    for key in Key:
        if key.value in data:
            value, ok = validated(key, data[key.value])
            settings.values[key] = value
            if not ok:
                reset.append(key.value)
    if reset:
        settings.notice = f"A setting was damaged and reset: {', '.join(reset)}."
        log.warning("settings reset to their defaults: %s", ", ".join(reset))
    return settings
