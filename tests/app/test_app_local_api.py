"""The settings panel's Local API switch: the app serves the chat's model on 127.0.0.1.

The tests with the real demo engine drive the server with the `openai` client from a thread
while the UI runs, so the status bar and the chat window can be watched meanwhile.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import openai
import pytest

from moeferry.app.engine_backend import EngineBackend, real_load
from moeferry.app.settings import Key, load_settings
from moeferry.engine.setup.demo import demo_store_path
from tests.app.fakes import write_settings

QUESTION = "What is a list in Python?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def client(port: int, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, timeout=60, max_retries=0)


@pytest.fixture
def demo_app(launch, data_dir, qtbot):
    """The app with the real demo engine loaded (loads counted), the API off, on a free port."""
    loads = []

    def counting_load(opts, progress):
        loads.append(opts)
        return real_load(opts, progress)

    port = free_port()
    demo = str(demo_store_path())
    write_settings(data_dir, wizard_done=True, store_path=demo, installed=[{"path": demo, "name": "Demo"}],
                   api_port=port, temperature=0.0, max_new_tokens=12)
    parts = launch(engine=EngineBackend(load=counting_load))
    qtbot.waitUntil(lambda: parts.controller.loaded is not None, timeout=60000)
    parts.loads, parts.port = loads, port
    return parts


@pytest.mark.slow
def test_the_switch_serves_the_chat_model_and_they_take_turns(demo_app, qtbot):
    window, port = demo_app.window, demo_app.port
    panel = window.settings_panel.local_api
    assert panel.url.text() == f"http://127.0.0.1:{port}/v1"
    assert f"curl http://127.0.0.1:{port}/v1/chat/completions" in panel.curl.toPlainText()
    assert '"model": "demo"' in panel.curl.toPlainText() and "Authorization" not in panel.curl.toPlainText()
    panel.enabled.click()
    assert demo_app.settings.get(Key.API_ENABLED)
    qtbot.waitUntil(lambda: panel.state.text().startswith("Serving at"), timeout=5000)

    api = client(port)
    answer = api.chat.completions.create(model="demo", messages=[{"role": "user", "content": QUESTION}],
                                         temperature=0, max_tokens=12).choices[0].message.content
    chat_done = []
    demo_app.controller.reply_finished.connect(lambda msg: chat_done.append(msg.content))
    demo_app.controller.send(QUESTION)
    qtbot.waitUntil(lambda: bool(chat_done), timeout=30000)
    assert chat_done == [answer] and answer  # the same model, the same greedy reply
    assert len(demo_app.loads) == 1  # the API used the chat's engine, no second copy

    # a long API request: the status bar says so, and a chat message waits for its turn
    times: dict[str, list[float]] = {"api": [], "chat": []}

    def long_request():
        for _chunk in api.completions.create(model="demo", prompt="def f(x):", temperature=0, max_tokens=300,
                                             stream=True):
            times["api"].append(time.monotonic())
    worker = threading.Thread(target=long_request)
    worker.start()
    qtbot.waitUntil(lambda: window.api_label.text() == "API: serving a request…", timeout=10000)
    assert window.api_label.isVisible()
    demo_app.controller.reply_text.connect(lambda _t: times["chat"].append(time.monotonic()))
    demo_app.controller.send("And a tuple?")
    qtbot.waitUntil(lambda: len(chat_done) == 2, timeout=60000)
    worker.join(30)
    assert len(times["api"]) > 200 and times["chat"]
    assert times["chat"][0] > times["api"][-1]  # the chat's first words came after the API's last
    qtbot.waitUntil(lambda: window.api_label.text() == f"API on port {port}", timeout=5000)

    panel.enabled.click()
    qtbot.waitUntil(lambda: panel.state.text() == "Off.", timeout=5000)
    assert not window.api_label.isVisible()
    with pytest.raises(openai.APIConnectionError):
        api.models.list()


def test_a_key_set_in_the_panel_is_required(ready, qtbot):
    panel = ready.window.settings_panel.local_api
    port = free_port()
    panel.port.setValue(port)
    panel.key.setText("sk-panel-71")
    panel.key.editingFinished.emit()
    panel.enabled.click()
    qtbot.waitUntil(lambda: "key required" in panel.state.text(), timeout=5000)
    assert 'Authorization: Bearer sk-panel-71' in panel.curl.toPlainText()
    with pytest.raises(openai.AuthenticationError):
        client(port).models.list()
    listed = client(port, "sk-panel-71").models.list()  # the fake engine's model, by its store's name
    assert [m.id for m in listed.data] == [Path(ready.controller.loaded.store).name]
    ready.settings.save()
    saved = load_settings(ready.settings.path.parent)
    assert (saved.get(Key.API_ENABLED), saved.get(Key.API_PORT), saved.get(Key.API_KEY)) == (True, port, "sk-panel-71")


def test_a_port_in_use_is_said_in_words(ready, qtbot):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        panel = ready.window.settings_panel.local_api
        panel.port.setValue(port)
        panel.enabled.click()
        qtbot.waitUntil(lambda: "in use" in panel.state.text(), timeout=5000)
        assert panel.state.text() == f"Not serving: port {port} is in use by another program; pick another port."
        assert not ready.window.api_label.isVisible()
