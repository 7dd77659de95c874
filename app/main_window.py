"""The main window: conversations | chat | settings and expert map, with live stats in the status bar.

The window opens no larger than the screen (whatever the text size), the chat column keeps a
readable minimum width, and the text size (Settings or Ctrl+wheel over the chat) is a setting.
"""

from __future__ import annotations

import html
import logging
from pathlib import Path

from PySide6.QtCore import QByteArray, Qt, QTimer
from PySide6.QtGui import QAction, QCloseEvent, QGuiApplication, QKeySequence
from PySide6.QtWidgets import (
    QApplication,
    QFileDialog,
    QLabel,
    QMainWindow,
    QScrollArea,
    QSplitter,
    QTabWidget,
)

from moeferry.app.chat_controller import ChatController
from moeferry.app.errors import Action, ErrorInfo
from moeferry.app.history import export_markdown
from moeferry.app.install import InstallRequest
from moeferry.app.local_api import LocalApi
from moeferry.app.paths import models_dir
from moeferry.app.settings import Key
from moeferry.app.setup_backend import SetupBackend
from moeferry.app.task_runner import TaskRunner
from moeferry.app.theme import apply_theme
from moeferry.app.widgets.chat_panel import ChatPanel
from moeferry.app.widgets.conversation_list import ConversationList
from moeferry.app.widgets.error_dialog import ErrorDialog
from moeferry.app.widgets.expert_map import ExpertMap
from moeferry.app.widgets.settings_panel import SettingsPanel
from moeferry.app.widgets.status_strip import StatusStrip

log = logging.getLogger(__name__)
CHAT_MIN_W = 380      # the chat column never gets narrower than this
LIST_W, SIDE_W = 220, 360  # preferred widths of the conversation list and the side panel
FONT_STEPS = (7.0, 28.0)   # the text sizes Ctrl+wheel moves between, in points


def empty_chat_html(model_name: str) -> str:
    """What an empty conversation shows: the model that will answer, or how to get one."""
    if model_name:
        head = f"<h2>Chat offline with {html.escape(model_name)}</h2>"
        tail = "<p>Another model: <b>Model → Set up a model…</b></p>"
    else:
        head, tail = "<h2>Chat offline</h2>", "<p>No model yet? <b>Model → Set up a model…</b></p>"
    return (f"<div style='margin-top:80px; text-align:center'>{head}"
            "<p>Type a message below. Replies stream in as they are generated; the expert map "
            f"on the right shows which experts each layer used.</p>{tail}</div>")


class MainWindow(QMainWindow):
    def __init__(self, controller: ChatController, setup_backend: SetupBackend):
        super().__init__()
        self.controller = controller
        self.settings = controller.settings
        self.history = controller.history
        self.setup_backend = setup_backend
        self.error_dialog: ErrorDialog | None = None
        self.wizard = None
        self._tasks: list[TaskRunner] = []
        self._closing = False
        self._shown = False
        self.on_gpu = True  # the loaded model runs on a GPU (the status bar's GPU items make sense)
        self.setWindowTitle("MoE Ferry")

        self.conversations = ConversationList()
        self.conversations.setMinimumWidth(150)
        self.chat = ChatPanel()
        self.chat.setMinimumWidth(CHAT_MIN_W)
        self.chat.view.empty_text = empty_chat_html("")
        self.settings_panel = SettingsPanel()
        self.expert_map = ExpertMap()
        map_scroll = QScrollArea()
        map_scroll.setWidgetResizable(True)
        map_scroll.setWidget(self.expert_map)
        self.side = QTabWidget()
        self.side.addTab(self.settings_panel, "Settings")
        self.side.addTab(map_scroll, "Expert map")
        self.splitter = QSplitter(Qt.Orientation.Horizontal)
        for w in (self.conversations, self.chat, self.side):
            self.splitter.addWidget(w)
        self.splitter.setStretchFactor(1, 1)  # the chat takes what the window gains
        self.splitter.setChildrenCollapsible(False)
        self.setCentralWidget(self.splitter)
        self.status = StatusStrip()
        self.setStatusBar(self.status)
        self.local_api = LocalApi(controller.host, self)
        self.api_label = QLabel()
        self.api_label.setContentsMargins(12, 0, 6, 0)
        self.api_label.hide()
        self.status.addWidget(self.api_label)
        self._build_menu()

        self._save_timer = QTimer(self)
        self._save_timer.setSingleShot(True)
        self._save_timer.setInterval(400)
        self._save_timer.timeout.connect(self.settings.save_in_background)

        c, cl, inp = controller, self.conversations, self.chat.input
        cl.new_requested.connect(self.new_chat)
        cl.selected.connect(c.show_conversation)
        cl.rename_requested.connect(c.rename)
        cl.delete_requested.connect(c.delete)
        cl.search_changed.connect(lambda _t: self._refresh_list())
        inp.send_requested.connect(c.send)
        inp.resend_requested.connect(c.edit_last)
        inp.stop_requested.connect(c.stop)
        inp.regenerate_requested.connect(c.regenerate)
        inp.edit_requested.connect(self.start_edit)
        self.chat.view.action_requested.connect(self._message_action)
        self.chat.view.code_copied.connect(lambda: self.statusBar().showMessage("Code copied.", 2000))
        self.chat.view.zoom_requested.connect(self.zoom_text)
        self.chat.system_prompt_changed.connect(c.set_system_prompt)
        self.chat.export_requested.connect(self.export_conversation)
        self.chat.copy_requested.connect(self.copy_conversation)
        self.settings_panel.changed.connect(self.change_settings)
        self.settings_panel.setup_requested.connect(lambda: self.open_wizard(resume_pending=False))
        self.settings_panel.convert_requested.connect(self.convert_variant)
        c.conversations_changed.connect(self._refresh_list)
        c.conversation_shown.connect(self._show_conversation)
        c.reply_started.connect(self._reply_started)
        c.conversations_changed.connect(self._refresh_title)
        c.reply_text.connect(self.chat.view.set_stream_text)
        c.busy_changed.connect(inp.set_busy)
        c.stats_ready.connect(self._stats_ready)
        c.error.connect(self.show_error)
        c.model_state.connect(self.status.set_model_state)
        c.model_loaded.connect(self._model_loaded)
        c.model_ready.connect(lambda ok: None if ok else self.local_api.set_model(None))
        self.local_api.state_changed.connect(self.settings_panel.local_api.set_state)
        self.local_api.status_text.connect(self._api_status)

        self.settings_panel.load(self.settings)
        apply_theme(QApplication.instance(), self.settings.get(Key.THEME), self.settings.get(Key.FONT_SIZE))
        self._place_on_screen(self.settings.get(Key.WINDOW_GEOMETRY))
        self._refresh_list()
        last = self.settings.get(Key.LAST_CONVERSATION)
        first = self.history.conversations()
        c.show_conversation(last if self.history.get(last) else (first[0].id if first else ""))
        self.local_api.apply(self.settings)

    def _build_menu(self) -> None:
        bar = self.menuBar()
        file_menu = bar.addMenu("&File")
        self._action(file_menu, "New chat", self.new_chat, QKeySequence.StandardKey.New)
        self._action(file_menu, "Export conversation…", self.export_conversation, "Ctrl+E")
        file_menu.addSeparator()
        self._action(file_menu, "Quit", self.close, QKeySequence.StandardKey.Quit)
        model_menu = bar.addMenu("&Model")
        self._action(model_menu, "Set up a model…", lambda: self.open_wizard(resume_pending=False))
        self._action(model_menu, "Re-verify the model files", self.reverify)
        self._action(model_menu, "Reload the model", self.controller.load_model)
        chat_menu = bar.addMenu("&Chat")
        self._action(chat_menu, "Stop", self.controller.stop, "Esc")
        self._action(chat_menu, "Regenerate", self.controller.regenerate, "Ctrl+R")
        self._action(chat_menu, "Edit last message", self.start_edit, "Ctrl+Shift+E")

    def _action(self, menu, text, slot, shortcut=None) -> QAction:
        action = menu.addAction(text)
        action.triggered.connect(slot)
        if shortcut is not None:
            action.setShortcut(QKeySequence(shortcut))
        return action

    def _place_on_screen(self, geometry: str) -> None:
        """Restore the saved geometry, or a default size; either way no larger than the screen."""
        if geometry:
            self.restoreGeometry(QByteArray.fromHex(geometry.encode()))
        else:
            self.resize(1280, 800)
        width = self._fit_to_screen()
        list_w = min(LIST_W, width // 5)
        side = min(SIDE_W, (width - list_w) * 2 // 5)
        self.splitter.setSizes([list_w, width - list_w - side, side])

    def _fit_to_screen(self) -> int:
        """Shrink and move the window (its frame included) into the screen; returns the new width."""
        screen = (self.screen() or QGuiApplication.primaryScreen()).availableGeometry()
        frame = self.frameGeometry()
        extra_w, extra_h = frame.width() - self.width(), frame.height() - self.height()
        hint = self.minimumSizeHint()
        width = min(max(self.width(), hint.width()), screen.width() - extra_w)
        height = min(max(self.height(), hint.height()), screen.height() - extra_h)
        self.resize(width, height)
        frame = self.frameGeometry()
        if not screen.contains(frame):
            frame.moveTopLeft(screen.topLeft())
            self.move(frame.topLeft())
        return width

    def showEvent(self, event) -> None:
        super().showEvent(event)
        if not self._shown:  # the frame's size is known once the window is shown
            self._shown = True
            self._fit_to_screen()

    # Conversations and messages
    def new_chat(self) -> None:
        """A new conversation (or the empty one already there), with the message box ready to type in."""
        self.controller.new_conversation()
        self.chat.input.editor.setFocus()

    def _refresh_title(self) -> None:
        conv = self.history.get(self.controller.current_id)
        self.chat.title.setText(conv.title if conv else "New chat")

    def _refresh_list(self) -> None:
        self.conversations.set_conversations(self.history.search(self.conversations.search.text()),
                                             self.controller.current_id)

    def _show_conversation(self, conv_id: str) -> None:
        conv = self.history.get(conv_id)
        streaming = self.controller._reply.id if self.controller.busy and conv_id == self.controller._reply_conv \
            else ""
        self.chat.view.show_conversation(conv, streaming)
        self.chat.title.setText(conv.title if conv else "New chat")
        self.chat.system_prompt.setText(conv.system_prompt if conv else "")
        has = conv is not None and bool(conv.messages)
        for w in (self.chat.copy_button, self.chat.export_button):
            w.setEnabled(has)
        self._refresh_list()

    def _reply_started(self, _msg_id: str) -> None:
        self._show_conversation(self.controller.current_id)
        self.status.set_stats(None, self.on_gpu, streaming=True)  # not the numbers of the reply before

    def _stats_ready(self, stats, trace, setup: str) -> None:
        self.expert_map.set_trace(trace, setup)
        summary = self.expert_map.summary  # one hit rate for the map and the status bar: the trace's
        self.status.set_stats(stats, self.on_gpu, summary.hit_rate() if summary else None)

    def start_edit(self) -> None:
        text = self.controller.last_user_text()
        if text and not self.controller.busy:
            self.chat.input.start_edit(text)

    def _message_action(self, action: str, msg_id: str) -> None:
        conv = self.history.get(self.controller.current_id)
        msg = next((m for m in conv.messages if m.id == msg_id), None) if conv else None
        if action == "copy" and msg is not None:
            QGuiApplication.clipboard().setText(msg.content)
            self.statusBar().showMessage("Copied.", 2000)
        elif action == "edit":
            self.start_edit()
        elif action == "regenerate":
            self.controller.regenerate()

    def copy_conversation(self) -> None:
        conv = self.history.get(self.controller.current_id)
        if conv:
            QGuiApplication.clipboard().setText(export_markdown(conv))
            self.statusBar().showMessage("Conversation copied as Markdown.", 2000)

    def export_conversation(self) -> None:
        conv = self.history.get(self.controller.current_id)
        if conv is None:
            return
        name = "".join(ch if ch.isalnum() or ch in " -_" else "_" for ch in conv.title).strip() or "conversation"
        path, _ = QFileDialog.getSaveFileName(self, "Export conversation", str(Path.home() / f"{name}.md"),
                                              "Markdown (*.md)")
        if path:
            text = export_markdown(conv)
            self._run_task(lambda report, cancel: Path(path).write_text(text, encoding="utf-8"),
                           lambda _r: self.statusBar().showMessage(f"Exported to {path}.", 4000))

    # Settings
    def change_settings(self, changes: dict) -> None:
        changes = {Key(k): v for k, v in changes.items()}
        self.settings.update(changes)
        if Key.THEME in changes or Key.FONT_SIZE in changes:
            apply_theme(QApplication.instance(), self.settings.get(Key.THEME), self.settings.get(Key.FONT_SIZE))
            self._show_conversation(self.controller.current_id)  # re-render with the new colors and size
        self._save_timer.start()
        self.controller.apply_settings()
        self.local_api.apply(self.settings)

    def zoom_text(self, step: int) -> None:
        """Ctrl+wheel: one point bigger or smaller, kept as the text-size setting."""
        current = self.settings.get(Key.FONT_SIZE) or QApplication.instance().font().pointSizeF()
        size = min(max(round(current) + step, FONT_STEPS[0]), FONT_STEPS[1])
        if size != current:
            self.change_settings({Key.FONT_SIZE: size})
            self.settings_panel.load(self.settings)

    # Model set-up and errors
    def open_wizard(self, request: InstallRequest | None = None, resume_pending: bool = True):
        """The set-up wizard; `resume_pending` continues a stopped install (at start-up), the menu starts over."""
        from moeferry.app.wizard.wizard import SetupWizard

        if self.wizard is not None and self.wizard.isVisible():
            self.wizard.raise_()
            return self.wizard
        self.wizard = SetupWizard(self.setup_backend, self.settings, parent=self, start_request=request,
                                  resume_pending=resume_pending)
        self.wizard.installed.connect(self._model_installed)
        self.wizard.show()
        return self.wizard

    def _model_loaded(self, info) -> None:
        self.on_gpu = info.device != "cpu"
        name = next((e.get("name") for e in self.settings.get(Key.INSTALLED)
                     if e.get("path") == info.options.store), "") or Path(info.options.store).name
        self.chat.view.empty_text = empty_chat_html(name)
        self._show_conversation(self.controller.current_id)
        self.status.set_stats(None, self.on_gpu)
        self.settings_panel.set_on_gpu(self.on_gpu)
        self.settings_panel.load(self.settings, info.num_experts)
        self.local_api.set_model(info)
        self.settings_panel.local_api.set_model_id(Path(info.options.store).name)
        if info.note:
            self.chat.notice.show_notice(info.note)

    def _api_status(self, text: str) -> None:
        self.api_label.setText(text)
        self.api_label.setVisible(bool(text))

    def _model_installed(self) -> None:
        self.settings_panel.load(self.settings)
        self._save_timer.start()
        self.controller.load_model()

    def convert_variant(self, bits: int) -> None:
        source = next((e for e in self.settings.get(Key.INSTALLED) if e.get("source_path")), None)
        if source is None or not bits:
            return
        name = Path(source["source_path"]).name
        self.open_wizard(InstallRequest(source="folder", name=f"{name}, {bits}-bit experts",
                                        src_path=source["source_path"], needs_convert=True, expert_bits=bits,
                                        attn_bits=source.get("attn_bits") or 4,
                                        dest=str(models_dir() / f"{name}-{bits}bit")))

    def show_error(self, info: ErrorInfo) -> None:
        if self._closing:
            return
        self.error_dialog = ErrorDialog(info, self._error_action, self)
        self.error_dialog.open()

    def _error_action(self, action: Action) -> None:
        if action == Action.SMALLER_CACHE:
            current = self.settings.get(Key.CACHE_EXPERTS) or 4
            self.settings.set(Key.CACHE_EXPERTS, max(1, current // 2))
            budget = self.settings.get(Key.VRAM_BUDGET_GB)
            if budget:
                self.settings.set(Key.VRAM_BUDGET_GB, budget * 0.75)
            self.settings_panel.load(self.settings)
            self._save_timer.start()
            self.controller.load_model()
        elif action == Action.REVERIFY:
            self.reverify()
        elif action in (Action.REDOWNLOAD, Action.CHOOSE_MODEL):
            self.open_wizard(resume_pending=False)

    def reverify(self) -> None:
        store = self.settings.get(Key.STORE_PATH)
        if not store:
            self.show_error(ErrorInfo("No model", "No model is set up yet; run the set-up first.",
                                      Action.CHOOSE_MODEL))
            return
        self.status.set_model_state("Verifying the model files", 0.0)
        verify = self.setup_backend.verify

        def done(bad: list[str]) -> None:
            if bad:
                self.status.set_model_state("The model files are damaged", -1.0)
                self.show_error(ErrorInfo("The model files are damaged",
                                          f"{len(bad)} file(s) failed the check ({bad[0]}); download the model again.",
                                          Action.REDOWNLOAD, "\n".join(bad)))
            else:
                self.status.set_model_state("All model files are intact", -1.0)
        self._run_task(lambda report, cancel: verify(Path(store)), done)

    def _run_task(self, fn, on_done) -> TaskRunner:
        task = TaskRunner(fn, self)
        task.finished.connect(on_done)
        task.failed.connect(self.show_error)
        task.finished.connect(lambda _r: self._tasks.remove(task) if task in self._tasks else None)
        self._tasks.append(task)
        task.start()
        return task

    # Closing
    def closeEvent(self, event: QCloseEvent) -> None:
        self._closing = True
        if self.wizard is not None:
            self.wizard.stop_tasks()
        for task in list(self._tasks):
            task.stop(2000)
        self.local_api.stop()
        self.controller.shutdown(5000)
        self._save_timer.stop()
        self.settings.set(Key.WINDOW_GEOMETRY, bytes(self.saveGeometry().toHex()).decode())
        try:
            self.settings.save()
        except OSError:
            log.exception("saving the settings failed")
        self.history.close()
        super().closeEvent(event)
