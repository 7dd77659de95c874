"""Take settings-local-api-light.png: the real app with the demo model and the Local API switched on.

    xvfb-run -a -s "-screen 0 1440x960x24" python docs/screenshots/take_local_api.py

Nothing is replayed: the app runs on a throwaway data folder (MOEFERRY_DATA_DIR), loads the
embedded demo model with the real engine and serves it on 127.0.0.1:8080.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
OUT = Path(__file__).resolve().parent / "settings-local-api-light.png"
PORT = 8080


def wait_until(app, cond, timeout=60.0):
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError("the app did not get ready")
        app.processEvents()
        time.sleep(0.01)


def main() -> int:
    folder = Path(tempfile.mkdtemp(prefix="moeferry-shot-"))
    os.environ["MOEFERRY_DATA_DIR"] = str(folder)
    from PySide6.QtWidgets import QApplication

    from moeferry.app.engine_backend import real_engine_backend
    from moeferry.app.main import start
    from moeferry.app.setup_backend import real_setup_backend
    from moeferry.engine.setup.demo import demo_store_path

    demo = str(demo_store_path())
    (folder / "settings.json").write_text(json.dumps({
        "version": 1, "wizard_done": True, "store_path": demo, "theme": "light", "device": "cpu",
        "installed": [{"path": demo, "name": "Demo (Python docs)"}], "api_enabled": True, "api_port": PORT}))
    app = QApplication(sys.argv)
    parts = start(app, folder, real_engine_backend(), real_setup_backend())
    window = parts.window
    window.resize(1280, 800)
    wait_until(app, lambda: parts.controller.loaded is not None)
    panel = window.settings_panel
    wait_until(app, lambda: panel.local_api.state.text().startswith("Serving"))

    panel.ensureWidgetVisible(panel.local_api, 0, 0)
    end = time.monotonic() + 0.5
    while time.monotonic() < end:
        app.processEvents()
        time.sleep(0.01)
    window.grab().save(str(OUT))
    print(OUT.relative_to(ROOT))
    window.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
