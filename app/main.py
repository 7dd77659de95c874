"""Start the desktop app: `moeferry` with no subcommand calls run_gui().

Every start writes `moeferry.log` in the data folder (app/paths.py), and unhandled errors
while the app runs go there too. Without a display (a Linux shell with neither DISPLAY nor
WAYLAND_DISPLAY) run_gui says so in one sentence and returns 2 instead of letting Qt abort.
A start that fails anyway is logged there and shown in a dialog that names the log file; when
Qt itself cannot be loaded (a broken install) the sentence goes to stderr, the details to the
log. This module imports Qt only inside its functions, so that all of this can happen.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moeferry.app.paths import DATA_DIR_ENV, data_dir, resources_dir

if TYPE_CHECKING:
    from PySide6.QtWidgets import QApplication

    from moeferry.app.chat_controller import ChatController
    from moeferry.app.engine_backend import EngineBackend
    from moeferry.app.history import History
    from moeferry.app.main_window import MainWindow
    from moeferry.app.settings import Settings
    from moeferry.app.setup_backend import SetupBackend


@dataclass
class AppParts:
    settings: Settings
    history: History
    controller: ChatController
    window: MainWindow


def start(app: QApplication, folder: Path, engine: EngineBackend, setup: SetupBackend) -> AppParts:
    """Open the data folder, build the window, and either load the model or show the set-up wizard."""
    from moeferry.app.chat_controller import ChatController
    from moeferry.app.engine_worker import EngineHost
    from moeferry.app.history import History
    from moeferry.app.history_db import DB_FILE
    from moeferry.app.main_window import MainWindow
    from moeferry.app.settings import Key, load_settings
    from moeferry.app.theme import apply_theme, follow_system

    settings = load_settings(folder)
    history = History(folder / DB_FILE)
    apply_theme(app, settings.get(Key.THEME))
    follow_system(app, lambda: settings.get(Key.THEME))
    host = EngineHost(engine)
    controller = ChatController(history, settings, host)
    window = MainWindow(controller, setup)
    for notice in (settings.notice, history.notice):
        if notice:
            window.chat.notice.show_notice(notice)
    window.show()
    controller.load_model()  # says "No model set up" when there is none yet
    if not settings.get(Key.WIZARD_DONE) or settings.get(Key.PENDING_INSTALL):
        window.open_wizard()
    return AppParts(settings, history, controller, window)


LOG_FILE = "moeferry.log"
NO_DISPLAY = "no display found; the desktop app needs one; the command line works: moeferry --help"
# Qt platforms that draw without a display server
HEADLESS_PLATFORMS = ("offscreen", "minimal", "minimalegl", "vnc", "linuxfb", "eglfs", "vkkhrdisplay")
log = logging.getLogger(__name__)


def has_display(env=os.environ, platform: str = sys.platform) -> bool:
    """False on Linux and the BSDs when Qt would find no display to open (Windows and macOS have one)."""
    if not platform.startswith(("linux", "freebsd", "openbsd", "netbsd")):
        return True
    if env.get("QT_QPA_PLATFORM", "").split(":")[0].split(";")[0] in HEADLESS_PLATFORMS:
        return True
    return bool(env.get("DISPLAY") or env.get("WAYLAND_DISPLAY"))


def setup_logging(folder: Path) -> Path | None:
    """Append this run's log to moeferry.log in the data folder; its path, or None if unwritable."""
    path = folder / LOG_FILE
    try:
        handler = logging.FileHandler(path, encoding="utf-8")
    except OSError:
        return None  # no log file is no reason not to start
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    return path


def start_failed(exc: BaseException, log_path: Path | None) -> None:
    """Log a failed start and say so in a dialog that names the log file."""
    from PySide6.QtWidgets import QMessageBox

    log.error("MoE Ferry could not start", exc_info=exc)
    where = f"The details are in {log_path}." if log_path else "No log file could be written."
    if isinstance(exc, OSError):
        what = (f"MoE Ferry cannot write to {exc.filename or 'the data folder'} ({exc.strerror or exc}); free "
                f"some disk space or set {DATA_DIR_ENV} to a folder you can write to.")
    else:
        what = f"MoE Ferry could not start ({type(exc).__name__}: {str(exc)[:300]})."
    QMessageBox.critical(None, "MoE Ferry cannot start", f"{what} {where}")


def log_unhandled(kind, value, tb) -> None:
    """sys.excepthook while the app runs: errors raised in Qt slots reach the log file too."""
    log.error("unhandled error", exc_info=(kind, value, tb))
    sys.__excepthook__(kind, value, tb)


def run_gui(argv: list[str] | None = None) -> int:
    """Run the app until its window closes; returns the exit code."""
    argv = list(sys.argv if argv is None else argv)
    folder: Path | None = None
    try:
        folder = data_dir()
    except OSError as exc:
        folder_error: OSError | None = exc
    else:
        folder_error = None
    log_path = setup_logging(folder) if folder is not None else None
    try:
        from PySide6.QtGui import QIcon
        from PySide6.QtWidgets import QApplication
    except ImportError as exc:  # a broken install: no Qt to show a dialog with
        log.error("Qt cannot be loaded", exc_info=exc)
        print(f"moeferry: the desktop app cannot load Qt ({exc}); reinstall MoE Ferry"
              f"{f' (details in {log_path})' if log_path else ''}; the command line works: "
              f"moeferry --help", file=sys.stderr)
        return 1
    if QApplication.instance() is None and not has_display():
        print(f"moeferry: {NO_DISPLAY}", file=sys.stderr)
        return 2
    app = QApplication.instance() or QApplication(argv)
    app.setApplicationName("MoE Ferry")
    app.setOrganizationName("moeferry")
    app.setDesktopFileName("moeferry")
    icon = resources_dir() / "icons" / "moeferry.svg"
    if icon.exists():
        app.setWindowIcon(QIcon(str(icon)))
    if folder_error is not None:
        start_failed(folder_error, None)
        return 1
    try:
        from moeferry.app.engine_backend import real_engine_backend
        from moeferry.app.setup_backend import real_setup_backend
        parts: Any = start(app, folder, real_engine_backend(), real_setup_backend())
    except Exception as exc:  # noqa: BLE001 - a desktop user sees no stderr: log it and say so
        start_failed(exc, log_path)
        return 1
    previous_hook, sys.excepthook = sys.excepthook, log_unhandled
    try:
        code = app.exec()
    finally:
        sys.excepthook = previous_hook
    del parts
    return code


if __name__ == "__main__":
    sys.exit(run_gui())
