"""App settings: one JSON file, keys in an enum, types coerced in one place. No Qt here."""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from app.paths import move_aside, portable_store_path

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
    TEMPERATURE = "temperature"
    TOP_P = "top_p"
    MAX_NEW_TOKENS = "max_new_tokens"
    SEED = "seed"                      # -1 = random
    THEME = "theme"                    # system | light | dark
    LAST_CONVERSATION = "last_conversation"
    WINDOW_GEOMETRY = "window_geometry"  # hex of QWidget.saveGeometry()


DEFAULTS: dict[Key, Any] = {
    Key.WIZARD_DONE: False,
    Key.STORE_PATH: "",
    Key.INSTALLED: [],
    Key.PENDING_INSTALL: None,
    Key.DEVICE: "auto",
    Key.PREFETCH: 1,
    Key.CACHE_EXPERTS: 0,
    Key.VRAM_BUDGET_GB: 0.0,
    Key.TEMPERATURE: 0.7,
    Key.TOP_P: 0.9,
    Key.MAX_NEW_TOKENS: 512,
    Key.SEED: -1,
    Key.THEME: "system",
    Key.LAST_CONVERSATION: "",
    Key.WINDOW_GEOMETRY: "",
}

_CHOICES = {Key.DEVICE: ("auto", "cpu", "cuda"), Key.THEME: ("system", "light", "dark")}
_RANGES = {
    Key.PREFETCH: (0, 4),
    Key.CACHE_EXPERTS: (0, 64),
    Key.VRAM_BUDGET_GB: (0.0, 1024.0),
    Key.TEMPERATURE: (0.0, 2.0),
    Key.TOP_P: (0.01, 1.0),
    Key.MAX_NEW_TOKENS: (1, 32768),
    Key.SEED: (-1, 2**31 - 1),
}


def coerce(key: Key, value: Any) -> Any:
    """Return `value` as the key's type, clamped to its range; the default when it can't be read."""
    default = DEFAULTS[key]
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
    except (TypeError, ValueError):
        return default
    if key in _CHOICES and out not in _CHOICES[key]:
        return default
    if key == Key.STORE_PATH:
        out = portable_store_path(out)
    if key == Key.INSTALLED:  # the demo under its portable name, each path once (the last wins)
        out = list({e.get("path"): e for e in
                    ({**e, "path": portable_store_path(str(e.get("path") or ""))} for e in out)}.values())
    if key in _RANGES:
        lo, hi = _RANGES[key]
        out = min(max(out, lo), hi)
    return out


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
    for key in Key:
        if key.value in data:
            settings.values[key] = coerce(key, data[key.value])
    return settings
