"""The chat's logic between the conversations, the settings and the engine worker (UI thread)."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QObject, QTimer, Signal

from moeferry.app.engine_backend import LoadOptions
from moeferry.app.engine_worker import EngineHost, LoadedInfo, ReplyResult
from moeferry.app.errors import ErrorInfo
from moeferry.app.history import History, title_from
from moeferry.app.history_db import Message
from moeferry.app.settings import Key, Settings
from moeferry.app.stats_format import stats_dict
from moeferry.engine.contract import SamplingSettings
from moeferry.engine.units import GiB  # the VRAM budget is in GiB, as GPU memory is sold ("12 GB")

SAVE_STREAM_MS = 1000  # how often a streaming reply is written (marked incomplete) to the database
RELOAD_DELAY_MS = 600  # settings that need a reload wait for the user to stop clicking


def load_options(settings: Settings) -> LoadOptions:
    cache = settings.get(Key.CACHE_EXPERTS)
    budget = settings.get(Key.VRAM_BUDGET_GB)
    return LoadOptions(store=settings.get(Key.STORE_PATH), device=settings.get(Key.DEVICE),
                       cache_experts=cache or None, vram_budget=int(budget * GiB) if budget else None,
                       prefetch=settings.get(Key.PREFETCH), cpu_experts=settings.get(Key.CPU_EXPERTS))


def engine_messages(system_prompt: str, messages: list[Message]) -> list[dict]:
    """The chat as the engine takes it. Mixtral's chat template has no system role (it insists on
    user/assistant turns), so the system prompt goes in front of the first user message."""
    out = [{"role": m.role, "content": m.content} for m in messages]
    system = system_prompt.strip()
    if system and out and out[0]["role"] == "user":
        out[0]["content"] = f"{system}\n\n{out[0]['content']}"
    return out


def sampling_from(settings: Settings) -> SamplingSettings:
    seed = settings.get(Key.SEED)
    return SamplingSettings(temperature=settings.get(Key.TEMPERATURE), top_p=settings.get(Key.TOP_P),
                            max_new_tokens=settings.get(Key.MAX_NEW_TOKENS), seed=None if seed < 0 else seed)


class ChatController(QObject):
    conversations_changed = Signal()
    conversation_shown = Signal(str)      # conversation id ("" = none)
    reply_started = Signal(str)           # message id
    reply_text = Signal(str)              # the whole streaming text so far
    reply_finished = Signal(object)       # the finished Message
    busy_changed = Signal(bool)
    stats_ready = Signal(object, object, str)  # stats, trace, the speed settings it ran with
    error = Signal(object)                # ErrorInfo
    model_state = Signal(str, float)      # words, fraction (-1 = no progress to show)
    model_ready = Signal(bool)
    model_loaded = Signal(object)         # LoadedInfo

    def __init__(self, history: History, settings: Settings, host: EngineHost, parent: QObject | None = None):
        super().__init__(parent)
        self.history = history
        self.settings = settings
        self.host = host
        self.current_id: str = ""
        self.loaded: LoadOptions | None = None
        self._loading: LoadOptions | None = None
        self._reply: Message | None = None
        self._reply_conv = ""
        self._reply_setup = ""
        self._request_id = 0
        self._save_timer = QTimer(self)
        self._save_timer.setInterval(SAVE_STREAM_MS)
        self._save_timer.timeout.connect(self._save_stream)
        self._reload_timer = QTimer(self)
        self._reload_timer.setSingleShot(True)
        self._reload_timer.setInterval(RELOAD_DELAY_MS)
        self._reload_timer.timeout.connect(self.load_model)
        w = host.worker
        w.load_progress.connect(self._on_load_progress)
        w.loaded.connect(self._on_loaded)
        w.load_failed.connect(self._on_load_failed)
        w.pieces.connect(self._on_pieces)
        w.reply_done.connect(self._on_reply_done)

    # Model
    @property
    def busy(self) -> bool:
        return self._reply is not None

    def load_model(self) -> None:
        self._reload_timer.stop()
        opts = load_options(self.settings)
        if not opts.store:
            self.model_state.emit("No model set up", -1.0)
            self.model_ready.emit(False)
            return
        self._loading = opts
        self.model_state.emit("Loading the model", 0.0)
        self.model_ready.emit(False)
        self.host.load(opts)

    def apply_settings(self) -> None:
        """Called after the settings changed: reload only when what was loaded differs."""
        want = load_options(self.settings)
        current = self._loading or self.loaded
        if current is None or (want.store, want.device, want.vram_budget, want.cpu_experts) != (
                current.store, current.device, current.vram_budget, current.cpu_experts):
            self.model_state.emit("Reloading the model with the new settings", -1.0)
            self._reload_timer.start()
        # prefetch, cache size, CPU threads and sampling go with the next message

    def _on_load_progress(self, fraction: float, message: str) -> None:
        self.model_state.emit(message or "Loading the model", fraction)

    def _on_loaded(self, info: LoadedInfo) -> None:
        self.loaded = info.options
        if self._loading == info.options:
            self._loading = None
        name = next((e.get("name") for e in self.settings.get(Key.INSTALLED) if e.get("path") == info.options.store),
                    None) or Path(info.options.store).name
        self.model_state.emit(f"Ready: {name}", -1.0)
        self.model_ready.emit(True)
        self.model_loaded.emit(info)

    def _on_load_failed(self, info: ErrorInfo) -> None:
        self._loading = None
        self.loaded = None
        self.model_state.emit("The model did not load", -1.0)
        self.model_ready.emit(False)
        self.error.emit(info)

    # Conversations
    def show_conversation(self, conv_id: str) -> None:
        self.current_id = conv_id if self.history.get(conv_id) else ""
        self.settings.set(Key.LAST_CONVERSATION, self.current_id)
        self.conversation_shown.emit(self.current_id)

    def new_conversation(self) -> str:
        """Show a new conversation; an empty one already in the list is reused, so they don't pile up."""
        empty = next((c for c in self.history.conversations() if not c.messages), None)
        if empty is not None:
            self.show_conversation(empty.id)
            return empty.id
        conv = self.history.new_conversation()
        self.conversations_changed.emit()
        self.show_conversation(conv.id)
        return conv.id

    def rename(self, conv_id: str, title: str) -> None:
        self.history.rename(conv_id, title)
        self.conversations_changed.emit()

    def delete(self, conv_id: str) -> None:
        if self.busy and conv_id == self._reply_conv:
            self.stop()
        self.history.delete(conv_id)
        self.conversations_changed.emit()
        if conv_id == self.current_id:
            remaining = self.history.conversations()
            self.show_conversation(remaining[0].id if remaining else "")

    def set_system_prompt(self, text: str) -> None:
        if self.current_id:
            self.history.set_system_prompt(self.current_id, text)

    # Messages
    def send(self, text: str) -> bool:
        text = text.strip()
        if not text or self.busy:
            return False
        if not self.current_id:
            self.new_conversation()
        conv = self.history.get(self.current_id)
        if not conv.messages and conv.title == "New chat":
            self.history.rename(conv.id, title_from(text))
            self.conversations_changed.emit()
        self.history.add_message(conv.id, "user", text)
        self.conversation_shown.emit(conv.id)
        self._start_reply()
        return True

    def regenerate(self) -> bool:
        conv = self.history.get(self.current_id)
        if self.busy or conv is None or not conv.messages:
            return False
        if conv.messages[-1].role == "assistant":
            self.history.truncate(conv.id, len(conv.messages) - 1)
        if not conv.messages or conv.messages[-1].role != "user":
            return False
        self.conversation_shown.emit(conv.id)
        self._start_reply()
        return True

    def last_user_text(self) -> str:
        conv = self.history.get(self.current_id)
        users = [m for m in conv.messages if m.role == "user"] if conv else []
        return users[-1].content if users else ""

    def edit_last(self, text: str) -> bool:
        """Replace the last user message with `text`, drop what followed it, and ask again."""
        conv = self.history.get(self.current_id)
        text = text.strip()
        if self.busy or conv is None or not text:
            return False
        idx = max((i for i, m in enumerate(conv.messages) if m.role == "user"), default=-1)
        if idx < 0:
            return False
        self.history.truncate(conv.id, idx)
        self.history.add_message(conv.id, "user", text)
        self.conversation_shown.emit(conv.id)
        self._start_reply()
        return True

    def stop(self) -> None:
        self.host.stop()

    def shutdown(self, timeout_ms: int = 5000) -> None:
        """Stop the reply and the worker thread (bounded); a stopped reply is kept, marked stopped."""
        self._reload_timer.stop()
        self.host.shutdown(timeout_ms)
        self._save_timer.stop()
        if self._reply is not None:
            msg, self._reply = self._reply, None
            msg.complete = True
            msg.stats = {"stopped": True}
            self.history.save_message(self._reply_conv, msg)

    def _start_reply(self) -> None:
        conv = self.history.get(self.current_id)
        messages = engine_messages(conv.system_prompt, conv.messages)
        self._reply = self.history.add_message(conv.id, "assistant", "", complete=False)
        self._reply_conv = conv.id
        cache = self.settings.get(Key.CACHE_EXPERTS)
        prefetch = self.settings.get(Key.PREFETCH)
        self._reply_setup = f"{cache or 'auto'} cached per layer, prefetch {prefetch}"
        req = self.host.generate(messages, sampling_from(self.settings), prefetch, cache or None,
                                 self.settings.get(Key.CPU_THREADS))
        self._request_id = req.id
        self._save_timer.start()
        self.busy_changed.emit(True)
        self.reply_started.emit(self._reply.id)

    def _save_stream(self) -> None:
        if self._reply is not None:
            self.history.save_message(self._reply_conv, self._reply)

    def _on_pieces(self, request_id: int, text: str) -> None:
        if self._reply is None or request_id != self._request_id:
            return
        self._reply.content += text
        self.reply_text.emit(self._reply.content)

    def _on_reply_done(self, result: ReplyResult) -> None:
        if self._reply is None or result.id != self._request_id:
            return
        msg, conv_id = self._reply, self._reply_conv
        self._reply = None
        self._save_timer.stop()
        msg.content = result.text or msg.content
        conv = self.history.get(conv_id)
        if result.error is not None and not msg.content and conv is not None:
            self.history.truncate(conv_id, len(conv.messages) - 1)  # nothing was said: drop the empty reply
        elif conv is not None:
            msg.complete = True
            msg.stats = stats_dict(result.stats) or {}
            if result.stopped:
                msg.stats["stopped"] = True
            self.history.save_message(conv_id, msg)
        self.busy_changed.emit(False)
        self.reply_finished.emit(msg)
        if conv_id == self.current_id:
            self.conversation_shown.emit(conv_id)
        if result.error is not None:
            self.error.emit(result.error)
        elif result.stats is not None or result.trace is not None:
            self.stats_ready.emit(result.stats, result.trace, self._reply_setup)
