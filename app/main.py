"""Start the desktop app: `moeferry` with no subcommand calls run_gui()."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path

from PySide6.QtGui import QIcon
from PySide6.QtWidgets import QApplication, QMessageBox

from app.chat_controller import ChatController
from app.engine_backend import EngineBackend, real_engine_backend
from app.engine_worker import EngineHost
from app.history import History
from app.history_db import DB_FILE
from app.main_window import MainWindow
from app.paths import DATA_DIR_ENV, data_dir, resources_dir
from app.settings import Key, Settings, load_settings
from app.setup_backend import SetupBackend, real_setup_backend
from app.theme import apply_theme, follow_system


@dataclass
class AppParts:
    settings: Settings
    history: History
    controller: ChatController
    window: MainWindow


def start(app: QApplication, folder: Path, engine: EngineBackend, setup: SetupBackend) -> AppParts:
    """Open the data folder, build the window, and either load the model or show the set-up wizard."""
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
    if not settings.get(Key.WIZARD_DONE) or settings.get(Key.PENDING_INSTALL):
        controller.load_model()  # says "No model set up" when there is none yet
        window.open_wizard()
    else:
        controller.load_model()
    return AppParts(settings, history, controller, window)


def _setup_logging(folder: Path) -> None:
    try:
        handler = logging.FileHandler(folder / "moeferry.log", encoding="utf-8")
    except OSError:
        return  # no log file is no reason not to start
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)


def run_gui(argv: list[str] | None = None) -> int:
    """Run the app until its window closes; returns the exit code."""
    argv = list(sys.argv if argv is None else argv)
    app = QApplication.instance() or QApplication(argv)
    app.setApplicationName("MoE Ferry")
    app.setOrganizationName("moeferry")
    app.setDesktopFileName("moeferry")
    icon = resources_dir() / "icons" / "moeferry.svg"
    if icon.exists():
        app.setWindowIcon(QIcon(str(icon)))
    try:
        folder = data_dir()
        _setup_logging(folder)
        parts = start(app, folder, real_engine_backend(), real_setup_backend())
    except OSError as exc:
        where = exc.filename or "the data folder"
        QMessageBox.critical(None, "MoE Ferry cannot start",
                             f"MoE Ferry cannot write to {where} ({exc.strerror or exc}); free some disk space "
                             f"or set {DATA_DIR_ENV} to a folder you can write to.")
        return 1
    code = app.exec()
    del parts
    return code


if __name__ == "__main__":
    sys.exit(run_gui())
