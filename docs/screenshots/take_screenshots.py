"""Take the app's screenshots: the real app under Xvfb, every wizard page, the chat, settings, expert map.

    xvfb-run -a -s "-screen 0 1440x960x24" python docs/screenshots/take_screenshots.py --theme light
    xvfb-run -a -s "-screen 0 1440x960x24" python docs/screenshots/take_screenshots.py --theme dark

This machine has no GPU and no network, so three things are replayed rather than measured:
the hardware probe is an RTX 3060 desktop's (the --no-gpu run uses this machine's real probe and
goes on to the model page and a chat with the demo model running on the CPU),
the download reports scripted progress, and the chat's engine streams a scripted reply with a
Mixtral-shaped expert trace (32 layers, 8 experts, top-2, LRU cache of 3 per layer) and stats
in the range of the paper's RTX 3060 numbers. Everything else is the real app: windows,
wizard, planner (engine/setup/plan.py) and catalog (resources/catalog.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
OUT = Path(__file__).resolve().parent

REPLY = """Reversing a list in Python can be done in three common ways:

1. **In place** with `list.reverse()`, which changes the list and returns `None`.
2. **A reversed copy** with slicing: `items[::-1]`.
3. **A lazy iterator** with `reversed(items)`, handy in loops.

```python
items = [1, 2, 3, 4]
items.reverse()          # items is now [4, 3, 2, 1]
copy = items[::-1]       # a new list: [1, 2, 3, 4]
for x in reversed(items):
    print(x)
```

Use `reverse()` when you no longer need the original order, and slicing when you do. More in the
[Python tutorial](https://docs.python.org/3/tutorial/datastructures.html)."""
QUESTION = "How do I reverse a list in Python?\nIn place, and as a copy."

RTX_3060 = {"gpu_name": "NVIDIA GeForce RTX 3060", "vram_total_bytes": 12 * 1024**3,
            "vram_free_bytes": 11 * 1024**3, "driver_version": "550.54.14", "cuda_driver_version": "12.4",
            "compute_capability": "8.6", "pcie_gen": 4, "pcie_width": 16, "h2d_bytes_per_s": 24.8e9,
            "h2d_gb_per_s": 24.8, "gpu_mem_bandwidth_bytes_per_s": 360e9, "ram_total_bytes": 32 * 1024**3,
            "disk_free_bytes": 412 * 1024**3, "cpu_name": "AMD Ryzen 5 5600X 6-Core Processor",
            "cpu_cores_logical": 12, "torch_cuda": True, "cuda_available": True, "gpu_count": 1}


def wait_until(app, cond, timeout=20.0):
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError("screen did not get ready")
        app.processEvents()
        time.sleep(0.01)


def settle(app, seconds=0.3):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        app.processEvents()
        time.sleep(0.01)


def save(widget, name, theme):
    path = OUT / f"{name}-{theme}.png"
    widget.grab().save(str(path))
    print(f"{path.relative_to(ROOT)}  {path.stat().st_size // 1024} KB")


def scripted_engine_backend(device: str = "cuda"):
    from tests.app.fakes import FakeEngineBackend

    backend = FakeEngineBackend(reply=lambda m, s: REPLY, delay=0.004, layers=32, experts=8, top_k=2,
                                device=device)
    load = backend.load

    def load_scripted(opts, progress):
        engine = load(opts, progress)
        engine.cache_experts = 3
        stream = engine.stream

        def stream_with_stats(messages, sampling, cancel=None):
            yield from stream(messages, sampling, cancel)
            s = engine.last_stats
            s.tokens_per_s, s.first_token_s, s.h2d_gb_per_s = 2.31, 1.08, 24.1
            s.peak_vram_bytes, s.vram_budget_bytes = int(10.2 * 1024**3), int(11 * 1024**3)
            s.prefetch_used = int(s.prefetch_issued * 0.71)

        engine.stream = stream_with_stats
        return engine

    backend.load = load_scripted
    return backend.as_backend()


def screenshot_setup_backend(tmp: Path, gate: threading.Event):
    from moeferry.app.setup_backend import real_setup_backend
    from tests.app.fakes import make_store

    backend = real_setup_backend()
    backend.probe = lambda: dict(RTX_3060)

    def fetch(repo_id, dest, revision=None, endpoint=None, progress=None, cancel=None, **_):
        total = 18_833_431_593
        done = int(total * 0.43)
        progress(SimpleNamespace(file="model-00002-of-00004.safetensors", done=done, total=total,
                                 rate_bps=48.6e6, eta_s=(total - done) / 48.6e6, phase="download"))
        gate.wait(60)
        Path(dest).mkdir(parents=True, exist_ok=True)
        return Path(dest)

    def convert(src, dest, expert_bits, attn_bits, tokenizer=None, progress=None, cancel=None):
        make_store(Path(dest), expert_bits, source="lavawolfiee/Mixtral-8x7B-Instruct-v0.1-offloading-demo")

    backend.fetch, backend.convert = fetch, convert
    backend.verify = lambda path: []
    backend.find_in_hf_cache = lambda repo: None
    backend.demo_path = lambda: make_store(tmp / "demo", source="demo")
    return backend


def add_history(history):
    for title, q, a in [("Trip plan for Lisbon", "Plan three days in Lisbon.", "Day 1: Alfama and the castle…"),
                        ("SQL window functions", "Explain ROW_NUMBER().", "ROW_NUMBER() numbers rows…"),
                        ("Haiku about GPUs", "A haiku about GPUs, please.", "Silicon rivers…")]:
        conv = history.new_conversation(title)
        history.add_message(conv.id, "user", q)
        history.add_message(conv.id, "assistant", a)
        time.sleep(0.01)


def take(theme: str, no_gpu_only: bool = False) -> None:
    from PySide6.QtCore import QRect
    from PySide6.QtWidgets import QApplication, QWizard

    from moeferry.app.main import start
    from moeferry.app.wizard.wizard import Page

    app = QApplication.instance() or QApplication([sys.argv[0]])
    app.setApplicationName("MoE Ferry")
    tmp = Path(tempfile.mkdtemp(prefix="moeferry-shots-"))
    os.environ["HOME"] = str(tmp)  # paths then read ~/.local/share/moeferry/..., as on a user's machine
    data = tmp / ".local" / "share" / "moeferry"
    data.mkdir(parents=True)
    os.environ["MOEFERRY_DATA_DIR"] = str(data)
    # The app starts in the other theme and is switched while running, as a user would.
    other = "dark" if theme == "light" else "light"
    (data / "settings.json").write_text(json.dumps({"version": 1, "theme": other}))
    gate = threading.Event()
    setup = screenshot_setup_backend(tmp, gate)
    if no_gpu_only:
        from moeferry.app.setup_backend import real_probe

        setup.probe = real_probe  # this machine, as it is
    parts = start(app, data, scripted_engine_backend("cpu" if no_gpu_only else "cuda"), setup)
    panel = parts.window.settings_panel
    panel.theme.setCurrentIndex(panel.theme.findData(theme))
    wizard = parts.window.wizard
    wizard.resize(820, 600)
    settle(app)
    if not no_gpu_only:
        save(wizard, "wizard-1-welcome", theme)
    wizard.next()
    wait_until(app, wizard.currentPage().isComplete, 60)
    settle(app)
    save(wizard, "wizard-2-hardware-no-gpu" if no_gpu_only else "wizard-2-hardware", theme)
    if no_gpu_only:
        take_no_gpu(app, parts, theme)
        return
    wizard.next()
    settle(app)
    save(wizard, "wizard-3-model", theme)
    wizard.next()
    install = wizard.pages[Page.INSTALL]
    wait_until(app, lambda: "GB of" in install.detail.text())
    settle(app)
    save(wizard, "wizard-4-download", theme)
    gate.set()
    wait_until(app, install.isComplete)
    wizard.next()
    settle(app)
    save(wizard, "wizard-5-cache", theme)
    wizard.next()
    settle(app)
    save(wizard, "wizard-6-done", theme)
    wizard.button(QWizard.WizardButton.FinishButton).click()

    window = parts.window
    wait_until(app, lambda: parts.controller.loaded is not None)
    add_history(parts.history)
    parts.controller.conversations_changed.emit()
    parts.controller.new_conversation()
    window.resize(1360, 860)
    window.settings_panel.cache.setValue(2)
    parts.controller.send(QUESTION)
    wait_until(app, lambda: not parts.controller.busy, 60)
    window.settings_panel.cache.setValue(4)  # the map then compares the two replies
    parts.controller.regenerate()
    wait_until(app, lambda: not parts.controller.busy, 60)
    settle(app, 0.5)
    save(window, "chat", theme)
    body = window.settings_panel.widget()
    height = min(body.height(), body.layout().sizeHint().height())
    path = OUT / f"settings-{theme}.png"
    body.grab(QRect(0, 0, body.width(), height)).save(str(path))
    print(f"{path.relative_to(ROOT)}  {path.stat().st_size // 1024} KB")
    window.side.setCurrentIndex(1)
    window.expert_map.set_layer(5)
    settle(app)
    save(window, "expert-map", theme)
    window.side.setCurrentIndex(0)
    window.resize(900, 600)
    settle(app, 0.5)
    save(window, "chat-900x600", theme)
    window.close()


def take_no_gpu(app, parts, theme: str) -> None:
    """The model page of a machine without a GPU, then the demo model's chat on the CPU."""
    from PySide6.QtWidgets import QWizard

    from moeferry.app.setup_backend import real_fetch
    from moeferry.app.wizard.wizard import Page

    wizard = parts.window.wizard
    wizard.next()
    settle(app)
    save(wizard, "wizard-3-model-no-gpu", theme)
    # This machine has no network: the real download fails, as it would for a user offline.
    os.environ.pop("HF_HUB_OFFLINE", None)
    parts.window.setup_backend.fetch = real_fetch
    model = wizard.pages[Page.MODEL]
    model.select(next(o.key for o in model.options if o.key not in ("demo", "folder") and o.enabled))
    wizard.next()
    install = wizard.pages[Page.INSTALL]
    wait_until(app, lambda: install.other_button.isVisible(), 60)
    settle(app)
    save(wizard, "wizard-4-download-failed", theme)
    install.other_button.click()  # back to the model choice, the demo chosen again
    settle(app)
    wizard.next()
    wait_until(app, wizard.pages[Page.INSTALL].isComplete)
    wizard.next()
    wizard.next()
    wizard.button(QWizard.WizardButton.FinishButton).click()
    window = parts.window
    wait_until(app, lambda: parts.controller.loaded is not None)
    window.resize(1200, 760)
    settle(app, 0.3)
    parts.controller.send(QUESTION)
    wait_until(app, lambda: not parts.controller.busy, 60)
    settle(app, 0.5)
    save(window, "chat-no-gpu", theme)
    window.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--theme", choices=("light", "dark"), required=True)
    parser.add_argument("--no-gpu", action="store_true", help="only the hardware page, with this machine's probe")
    args = parser.parse_args()
    take(args.theme, args.no_gpu)


if __name__ == "__main__":
    main()
