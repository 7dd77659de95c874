"""The chat window against the fake engine: stream, stop, regenerate, edit, settings, restart, errors."""

from __future__ import annotations

import pytest

from moeferry.app.errors import Action
from moeferry.app.settings import Key


def send(parts, qtbot, text="Hello there"):
    panel = parts.window.chat
    panel.input.editor.setPlainText(text)
    with qtbot.waitSignal(parts.controller.reply_finished, timeout=5000) as blocker:
        panel.input.send_button.click()
    return blocker.args[0]


def test_a_message_streams_a_reply(ready, qtbot, engine_backend):
    texts = []
    ready.controller.reply_text.connect(texts.append)
    msg = send(ready, qtbot, "Hello there")
    assert msg.complete and msg.content.startswith("You said: Hello there")
    assert len(texts) > 1, "the reply arrives in pieces"
    conv = ready.history.get(ready.controller.current_id)
    assert [m.role for m in conv.messages] == ["user", "assistant"]
    assert conv.title == "Hello there"
    view = ready.window.chat.view.toPlainText()
    assert "You said: Hello there" in view and "print('hi')" in view
    status = ready.window.status.labels
    assert "tok/s" in status["tps"].text() and "%" in status["cache"].text()
    assert ready.window.expert_map.summary is not None
    assert ready.window.expert_map.summary.num_tokens == len(msg.content.split(" "))


def test_stop_keeps_the_partial_reply(ready, qtbot, engine_backend):
    engine = engine_backend.engine
    engine.delay = 0.02
    panel = ready.window.chat
    panel.input.editor.setPlainText("Tell me a long story")
    panel.input.send_button.click()
    assert panel.input.send_button.text() == "Stop"
    qtbot.waitUntil(lambda: len(ready.controller._reply.content) > 0 if ready.controller._reply else False,
                    timeout=3000)
    with qtbot.waitSignal(ready.controller.reply_finished, timeout=3000) as blocker:
        panel.input.send_button.click()  # now "Stop"
    msg = blocker.args[0]
    assert msg.stats.get("stopped") is True
    assert 0 < len(msg.content) < len("You said: Tell me a long story")  + 60
    assert panel.input.send_button.text() == "Send"
    assert "Stopped." in panel.view.toPlainText()


def test_regenerate_replaces_the_last_reply(ready, qtbot, engine_backend):
    send(ready, qtbot, "First question")
    conv = ready.history.get(ready.controller.current_id)
    first_reply_id = conv.messages[-1].id
    with qtbot.waitSignal(ready.controller.reply_finished, timeout=5000):
        ready.window.chat.input.regenerate_button.click()
    assert len(conv.messages) == 2
    assert conv.messages[-1].id != first_reply_id
    assert len(engine_backend.engine.calls) == 2
    assert engine_backend.engine.calls[1][0][-1]["content"] == "First question"


def test_edit_last_message_and_resend(ready, qtbot, engine_backend):
    send(ready, qtbot, "Waht is MoE?")
    inp = ready.window.chat.input
    inp.edit_button.click()
    assert inp.editing and inp.editor.toPlainText() == "Waht is MoE?"
    inp.editor.setPlainText("What is MoE?")
    with qtbot.waitSignal(ready.controller.reply_finished, timeout=5000):
        inp.send_button.click()
    conv = ready.history.get(ready.controller.current_id)
    assert [m.content for m in conv.messages if m.role == "user"] == ["What is MoE?"]
    assert conv.messages[-1].content.startswith("You said: What is MoE?")


def test_settings_change_applies_to_the_next_reply(ready, qtbot, engine_backend):
    send(ready, qtbot)
    panel = ready.window.settings_panel
    panel.temperature.setValue(0.2)
    panel.prefetch.setValue(3)
    panel.cache.setValue(5)
    panel.max_tokens.setValue(4)
    msg = send(ready, qtbot, "again")
    engine = engine_backend.engine
    sampling = engine.calls[-1][1]
    assert sampling.temperature == pytest.approx(0.2) and sampling.max_new_tokens == 4
    assert engine.prefetch == 3 and engine.cache_experts == 5
    assert len(msg.content.split(" ")) == 4
    assert len(engine_backend.loads) == 1, "no reload for prefetch, cache or sampling"


def test_system_prompt_goes_first(ready, qtbot, engine_backend):
    ready.controller.new_conversation()
    ready.window.chat.system_prompt.setText("Answer like a pirate.")
    ready.window.chat.system_prompt.editingFinished.emit()
    send(ready, qtbot, "Hi")
    send(ready, qtbot, "More")
    messages = engine_backend.engine.calls[-1][0]
    # Mixtral's template has no system role: the prompt leads the first user turn
    assert messages[0] == {"role": "user", "content": "Answer like a pirate.\n\nHi"}
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    conv = ready.history.get(ready.controller.current_id)
    assert conv.system_prompt == "Answer like a pirate." and conv.messages[0].content == "Hi"


def test_switching_variant_reloads_in_the_worker(ready, qtbot, engine_backend, tmp_path, data_dir):
    from tests.app.fakes import make_store

    other = make_store(tmp_path / "store3", expert_bits=3)
    s = ready.settings
    s.set(Key.INSTALLED, s.get(Key.INSTALLED) + [{"path": str(other), "name": "tiny", "expert_bits": 3}])
    ready.window.settings_panel.load(s)
    with qtbot.waitSignal(ready.controller.model_ready, timeout=3000, check_params_cb=lambda ok: ok):
        ready.window.settings_panel.variant.setCurrentIndex(1)
    assert engine_backend.loads[-1].store == str(other)
    assert engine_backend.engines[0].closed


def test_cpu_experts_setting_reloads_the_model_with_it(ready, qtbot, engine_backend, launch):
    """"Experts not on the GPU": the engine is loaded again with --cpu-experts' choice, and the
    choice is kept across a restart."""
    panel = ready.window.settings_panel
    assert panel.cpu_experts.currentData() == "off" and engine_backend.loads[-1].cpu_experts == "off"
    with qtbot.waitSignal(ready.controller.model_ready, timeout=3000, check_params_cb=lambda ok: ok):
        panel.cpu_experts.setCurrentIndex(panel.cpu_experts.findData("auto"))
    assert len(engine_backend.loads) == 2 and engine_backend.loads[-1].cpu_experts == "auto"
    assert ready.settings.get(Key.CPU_EXPERTS) == "auto"
    ready.window.close()
    again = launch()
    assert again.window.settings_panel.cpu_experts.currentData() == "auto"
    assert engine_backend.loads[-1].cpu_experts == "auto"


def test_restart_keeps_conversations_and_settings(ready, qtbot, launch, data_dir):
    send(ready, qtbot, "Remember me")
    ready.window.settings_panel.top_p.setValue(0.5)
    ready.window.settings_panel.theme.setCurrentIndex(2)  # dark
    conv_id = ready.controller.current_id
    ready.window.close()
    again = launch()
    assert again.settings.get(Key.TOP_P) == pytest.approx(0.5)
    assert again.settings.get(Key.THEME) == "dark"
    assert again.window.settings_panel.top_p.value() == pytest.approx(0.5)
    conv = again.history.get(conv_id)
    assert conv is not None and [m.role for m in conv.messages] == ["user", "assistant"]
    assert all(m.complete for m in conv.messages)
    assert again.controller.current_id == conv_id
    assert "Remember me" in again.window.chat.view.toPlainText()
    assert again.window.wizard is None, "no wizard once set up"


def test_a_reply_cut_by_a_crash_is_kept_and_marked(ready, qtbot, launch, engine_backend):
    engine = engine_backend.engine
    engine.gate.clear()  # hold the stream after its first piece
    ready.controller.send("crash test")
    msg = ready.controller._reply
    ready.controller._save_stream()  # what the periodic timer does
    assert ready.history.flush()
    # "crash": the process dies without closing; a new process opens the same folder
    from moeferry.app.history import History
    from moeferry.app.history_db import DB_FILE

    reopened = History(ready.history.path.parent / DB_FILE)
    kept = next(m for c in reopened.conversations() for m in c.messages if m.id == msg.id)
    assert kept.complete is False
    reopened.close()
    engine.gate.set()


def test_closing_mid_generation_stops_cleanly(ready, qtbot, engine_backend):
    engine_backend.engine.delay = 0.05
    ready.controller.send("a long one")
    qtbot.wait(100)
    ready.window.close()
    assert not ready.controller.host.thread.isRunning()
    assert engine_backend.engine.closed
    conv = ready.history.get(ready.controller.current_id)
    assert conv.messages[-1].stats == {"stopped": True}


def test_worker_error_shows_a_dialog_with_an_action(ready, qtbot, engine_backend):
    class OutOfMemoryError(RuntimeError):
        pass

    engine_backend.engine.fail_with = OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
    ready.controller.send("boom")
    qtbot.waitUntil(lambda: ready.window.error_dialog is not None and ready.window.error_dialog.isVisible(),
                    timeout=3000)
    dialog = ready.window.error_dialog
    assert dialog.info.action == Action.SMALLER_CACHE
    assert "memory" in dialog.informativeText()
    assert ready.window.chat.input.send_button.text() == "Send", "the window is usable again"
    before = len(engine_backend.loads)
    ready.settings.set(Key.CACHE_EXPERTS, 4)
    dialog.action_button.click()
    assert ready.settings.get(Key.CACHE_EXPERTS) == 2
    qtbot.waitUntil(lambda: len(engine_backend.loads) == before + 1, timeout=3000)


def test_missing_model_offers_the_wizard(launch, data_dir, qtbot, engine_backend, tmp_path):
    from tests.app.fakes import write_settings

    write_settings(data_dir, wizard_done=True, store_path=str(tmp_path / "gone"))
    engine_backend.load_error = FileNotFoundError("no such folder")
    parts = launch()
    qtbot.waitUntil(lambda: parts.window.error_dialog is not None, timeout=3000)
    assert parts.window.error_dialog.info.action == Action.REDOWNLOAD
    parts.window.error_dialog.action_button.click()
    assert parts.window.wizard is not None and parts.window.wizard.isVisible()


def test_long_replies_render_on_a_throttle(ready, qtbot, engine_backend):
    engine_backend.engine.reply = lambda m, s: " ".join(["word"] * 400)
    engine_backend.engine.delay = 0.001
    msg = send(ready, qtbot, "long")
    view = ready.window.chat.view
    assert len(msg.content.split(" ")) == 400
    assert view.render_count < 60, f"{view.render_count} re-renders for 400 tokens"


def test_conversation_list_new_rename_delete_search(ready, qtbot):
    send(ready, qtbot, "About cats")
    ready.controller.new_conversation()
    send(ready, qtbot, "About dogs")
    cl = ready.window.conversations
    assert cl.list.count() == 2
    cl.search.setText("cats")
    assert cl.list.count() == 1 and cl.list.item(0).text() == "About cats"
    cl.search.setText("")
    item = cl.list.item(0)
    conv_id = item.data(0x0100)
    item.setText("Dogs, renamed")
    qtbot.waitUntil(lambda: ready.history.get(conv_id).title == "Dogs, renamed", timeout=2000)
    cl.list.setCurrentRow(0)
    cl.delete_button.click()
    assert cl.list.count() == 1
    assert ready.controller.current_id == cl.current_id()


def test_export_markdown(ready, qtbot, tmp_path, monkeypatch):
    from PySide6.QtWidgets import QFileDialog

    send(ready, qtbot, "Export me")
    target = tmp_path / "out.md"
    monkeypatch.setattr(QFileDialog, "getSaveFileName", lambda *a, **k: (str(target), ""))
    ready.window.chat.export_button.click()
    qtbot.waitUntil(target.exists, timeout=3000)
    text = target.read_text()
    assert text.startswith("# Export me") and "## You" in text and "```python" in text


def test_run_gui_opens_and_closes(qapp, data_dir, monkeypatch):
    """The console script's entry: first run shows the wizard over the window; closing returns 0."""
    from PySide6.QtCore import QTimer

    from moeferry.app.main import run_gui

    seen = []

    def close_all():
        seen.extend(type(w).__name__ for w in qapp.topLevelWidgets() if w.isVisible())
        for w in qapp.topLevelWidgets():
            if type(w).__name__ == "MainWindow":
                w.close()

    QTimer.singleShot(300, close_all)
    assert run_gui(["moeferry"]) == 0
    assert "MainWindow" in seen and "SetupWizard" in seen
    assert (data_dir / "settings.json").exists() and (data_dir / "conversations.sqlite3").exists()


def test_run_gui_explains_an_unwritable_data_folder(qapp, monkeypatch):
    from PySide6.QtWidgets import QMessageBox

    from moeferry.app import main as app_main

    def denied():
        raise PermissionError(13, "Permission denied", "/nope/moeferry")

    shown = []
    monkeypatch.setattr(app_main, "data_dir", denied)
    monkeypatch.setattr(QMessageBox, "critical", lambda parent, title, text: shown.append(text))
    assert app_main.run_gui(["moeferry"]) == 1
    assert shown and "/nope/moeferry" in shown[0] and "MOEFERRY_DATA_DIR" in shown[0]


def test_the_settings_panel_fits_the_side_panel_without_scrolling_sideways(ready, qtbot):
    """In a side panel of its preferred width every group of the settings (the longest combo box
    choices included) fits: nothing is cut off behind a horizontal scroll bar."""
    from PySide6.QtWidgets import QTabWidget

    from moeferry.app.main_window import SIDE_W
    from moeferry.app.widgets.settings_panel import SettingsPanel

    side, panel = QTabWidget(), SettingsPanel()
    qtbot.addWidget(side)
    panel.load(ready.settings)
    side.addTab(panel, "Settings")
    side.resize(SIDE_W, 800)
    side.show()
    qtbot.waitUntil(lambda: panel.viewport().width() > 200)
    assert panel.horizontalScrollBar().maximum() == 0, (panel.widget().minimumSizeHint().width(),
                                                        panel.viewport().width())
