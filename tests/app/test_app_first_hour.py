"""Issue 13, points 8-13: what a new user hit in the app in their first hour, each checked here."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
from PySide6.QtCore import QPoint, QPointF, Qt
from PySide6.QtGui import QColor, QDesktopServices, QGuiApplication, QPalette, QWheelEvent
from PySide6.QtWidgets import QApplication

from moeferry.app.settings import Key
from moeferry.app.setup_backend import PlanSummary
from moeferry.app.theme import colors, contrast_ratio, palette_colors
from moeferry.app.wizard.wizard import Page
from tests.app.fakes import NO_GPU, FakeEngineBackend, fake_setup_backend, write_settings
from tests.app.wizard_steps import next_page, open_install_page

ROOT = Path(__file__).resolve().parents[2]



def send(parts, qtbot, text="Hello there"):
    parts.window.chat.input.editor.setPlainText(text)
    with qtbot.waitSignal(parts.controller.reply_finished, timeout=5000) as blocker:
        parts.window.chat.input.send_button.click()
    return blocker.args[0]


def text_contrast(widget) -> float:
    """The best contrast between any pixel the widget draws and its window color: 1.0 = invisible."""
    image = widget.grab().toImage()
    background = widget.palette().color(QPalette.ColorRole.Window)
    seen = {image.pixelColor(x, y).name() for x in range(0, image.width(), 1) for y in range(image.height())}
    return max((contrast_ratio(c, background) for c in seen), default=1.0)


# Point 8: a failed download no longer traps the wizard ----------------------------------------

def test_a_failed_download_is_forgotten_and_another_model_can_be_chosen(launch, qtbot, tmp_path, data_dir):
    from moeferry.engine.errors import UserError

    def fetch(*a, **k):
        raise UserError("Cannot reach the hub at https://huggingface.co (ConnectError): check your network "
                        "connection or --endpoint.", 1)

    parts = launch(setup=fake_setup_backend(tmp_path, fetch=fetch))
    wizard = parts.window.wizard
    install = open_install_page(wizard, qtbot, "mixtral-src")
    qtbot.waitUntil(lambda: "Cannot reach" in install.message.text(), timeout=3000)
    assert "--endpoint" not in install.message.text() and "ConnectError" not in install.message.text()
    assert parts.settings.get(Key.PENDING_INSTALL) is None, "a failed install is not reopened at the next start"
    assert install.other_button.isVisibleTo(install)
    install.other_button.click()
    assert wizard.currentId() == Page.MODEL and wizard.visitedIds()[0] == Page.HARDWARE, "Back works"
    wizard.pages[Page.MODEL].select("demo")
    next_page(wizard, qtbot, Page.INSTALL)
    qtbot.waitUntil(wizard.pages[Page.INSTALL].isComplete, timeout=3000)
    wizard.reject()
    parts.window.close()

    again = launch(setup=fake_setup_backend(tmp_path, fetch=fetch))
    assert again.window.wizard.currentId() == Page.WELCOME, "set-up starts over, not on the failed download"


def stopped_install(data_dir) -> dict:
    return {"source": "catalog", "name": "Mixtral-8x7B Instruct, converted here", "repo_id": "tiny/mixtral",
            "src_path": str(data_dir / "models" / "downloads" / "tiny--mixtral"), "needs_convert": True,
            "expert_bits": 3, "dest": str(data_dir / "models" / "tiny--mixtral-3bit")}


def test_a_stopped_install_resumes_at_start_and_can_be_left(launch, qtbot, tmp_path, data_dir):
    gate = threading.Event()

    def fetch(repo_id, dest, progress=None, cancel=None, **_):
        gate.wait(5)
        raise RuntimeError("cancelled")

    write_settings(data_dir, pending_install=stopped_install(data_dir))
    parts = launch(setup=fake_setup_backend(tmp_path, fetch=fetch))
    wizard = parts.window.wizard
    install = wizard.pages[Page.INSTALL]
    assert wizard.currentId() == Page.INSTALL and install.what.text().startswith("Resuming")
    assert install.other_button.isVisibleTo(install), "Back is off on the first page: this is the way out"
    install.other_button.click()
    gate.set()
    assert wizard.currentId() == Page.HARDWARE
    assert parts.settings.get(Key.PENDING_INSTALL) is None
    next_page(wizard, qtbot, Page.MODEL)
    assert wizard.pages[Page.MODEL].current() is not None
    wizard.stop_tasks()


def test_the_menu_starts_over_and_cancel_forgets_a_stopped_install(ready, qtbot, data_dir):
    ready.settings.set(Key.PENDING_INSTALL, stopped_install(data_dir))
    menu = next(a.menu() for a in ready.window.menuBar().actions() if a.text() == "&Model")
    next(a for a in menu.actions() if a.text().startswith("Set up a model")).trigger()
    wizard = ready.window.wizard
    assert wizard.currentId() == Page.WELCOME, "Set up a model… is a new choice, not the old download"
    wizard.reject()
    assert ready.settings.get(Key.PENDING_INSTALL) is None


# Point 9: switching Light <-> Dark keeps every text readable --------------------------------

def test_theme_switch_keeps_the_title_and_status_bar_readable(ready, qtbot):
    send(ready, qtbot, "A question about themes")
    window, panel = ready.window, ready.window.settings_panel
    for theme in ("dark", "light", "dark"):
        panel.theme.setCurrentIndex(panel.theme.findData(theme))
        QApplication.processEvents()
        window_color = window.palette().color(QPalette.ColorRole.Window)
        assert (window_color.lightness() < 128) == (theme == "dark")
        for widget in (window.chat.title, window.status.labels["tps"], window.status.model_label):
            assert widget.palette().color(QPalette.ColorRole.Window) == window_color
            assert text_contrast(widget) >= 4.5, (theme, widget)


# Point 10: the model page and the chat without a GPU ----------------------------------------

def no_gpu_backend(tmp_path, disk_free=40_000_000_000):
    backend = fake_setup_backend(tmp_path, hw=dict(NO_GPU, disk_free_bytes=disk_free))
    backend.plan = lambda hw, entry, budget, cache_experts=None: PlanSummary(
        cache_experts_per_layer=0, predicted_tokens_per_s=0.0046, verdict="Runs on the CPU.", hit_rate=1.0)
    return backend


def test_model_page_without_a_gpu(launch, qtbot, tmp_path):
    parts = launch(setup=no_gpu_backend(tmp_path))
    wizard = parts.window.wizard
    next_page(wizard, qtbot, Page.HARDWARE)
    hw = wizard.pages[Page.HARDWARE]
    qtbot.waitUntil(hw.isComplete, timeout=5000)
    assert "about 4 min per token" in hw.headline.text()
    disk = re.search(r"Free disk space: ([\d.]+ GB)", hw.details.text()).group(1)
    next_page(wizard, qtbot, Page.MODEL)
    model = wizard.pages[Page.MODEL]
    demo, small, big = model.options[0], model.options[1], model.options[2]
    assert demo.key == "demo" and model.current() is demo, "the demo comes first and is the choice"
    assert [o.key for o in model.options if o.recommended] == ["demo"], "Recommended sits on the choice made"
    card = model.cards[0]
    assert card.visibleRegion().boundingRect().height() == card.height(), "the demo is above the fold"
    assert "about 4 min per token here" in small.facts and "0.0 tokens/s" not in small.facts
    assert f"{disk} is free" in big.notes, "the same free disk as on the hardware page"
    assert not big.enabled and small.enabled  # 114 GB needed, 40 GB free
    for text in (o.details for o in model.options):
        assert not re.search(r"perplexity|fp16|H2D", text), text
    model.select(big.key)
    assert model.current() is demo, "an option without enough disk cannot be chosen"
    model.cards[2].radio.setChecked(True)  # even when forced, Next stays off
    assert not model.isComplete()


def test_chat_without_a_gpu_names_the_model_and_hides_gpu_numbers(launch, qtbot, data_dir, store):
    write_settings(data_dir, wizard_done=True, store_path=str(store),
                   installed=[{"path": str(store), "name": "Demo model", "expert_bits": 2}])
    backend = FakeEngineBackend(device="cpu")
    parts = launch(engine=backend)
    qtbot.waitUntil(lambda: parts.controller.loaded is not None, timeout=3000)
    window = parts.window
    assert "Demo model" in window.chat.view.toPlainText() and "Mixtral" not in window.chat.view.toPlainText()
    assert "Mixtral" not in window.chat.input.editor.placeholderText()
    send(parts, qtbot)
    assert window.status.shown_keys() == ["tps", "ttft"], "no cache, prefetch, GPU memory or copy speed"
    panel = window.settings_panel
    assert not any(w.isVisibleTo(panel) for w in (panel.prefetch, panel.cache, panel.budget, panel.cpu_experts)), \
        "no GPU cache to size"
    assert "tok/s" in window.status.labels["tps"].text()
    assert panel.cpu_threads.isVisibleTo(panel) and panel.cpu_threads.text() == "Auto"
    assert backend.engine.cpu_threads == 0
    panel.cpu_threads.setValue(1)  # goes with the next message, without a reload
    send(parts, qtbot)
    assert backend.engine.cpu_threads == 1 and len(backend.engines) == 1
    assert parts.controller.settings.get(Key.CPU_THREADS) == 1


def test_status_bar_words_on_a_gpu(ready, qtbot):
    send(ready, qtbot)
    texts = [label.text() for label in ready.window.status.labels.values()]
    assert any(t.startswith("GPU memory 8.5 / 10.2 GB") for t in texts) and any("copies to GPU" in t for t in texts)
    assert not any(re.search(r"\bH2D\b|VRAM", t) for t in texts)


# Point 11: layout at 900x600, long titles, edit mode, large text ----------------------------

def test_layout_at_900x600_with_a_long_title_and_edit_mode(ready, qtbot):
    window = ready.window
    window.resize(900, 600)
    send(ready, qtbot, "Short question")
    QApplication.processEvents()
    list_w, chat_w, side_w = window.splitter.sizes()
    assert chat_w >= 380 and list_w >= 150 and side_w >= 250
    before = window.splitter.sizes()
    ready.controller.rename(ready.controller.current_id, "A very long conversation title " * 12)
    QApplication.processEvents()
    assert window.splitter.sizes() == before, "a long title does not push the panes"
    assert window.chat.title.text().endswith("…") and window.chat.title.width() < chat_w
    window.start_edit()
    QApplication.processEvents()
    assert window.chat.input.editing and window.splitter.sizes() == before, "edit mode does not shift the panes"
    window.chat.input.cancel_edit()


def test_large_text_opens_within_the_screen(launch, data_dir, store, qtbot, qapp):
    size = round(qapp.font().pointSizeF() * 1.5, 1)
    write_settings(data_dir, wizard_done=True, store_path=str(store), font_size=size,
                   window_geometry="")
    parts = launch()
    window = parts.window
    QApplication.processEvents()
    screen = window.screen().availableGeometry()
    assert qapp.font().pointSizeF() == size
    assert screen.contains(window.frameGeometry())
    send_button = window.chat.input.send_button
    corner = send_button.mapToGlobal(QPoint(send_button.width(), send_button.height()))
    assert screen.contains(corner) and window.rect().contains(window.mapFromGlobal(corner))


# Point 12: replies -----------------------------------------------------------------------------

REPLY = ("Read it with [the docs](https://docs.python.org/3/tutorial/inputoutput.html):\n\n"
         "```python\ndef read(path):\n    return open(path).read()  # whole file\n```\n\n"
         "Or, indented:\n\n    lines = read('a.txt').splitlines()\n")


def anchors(view) -> dict[str, int]:
    """href -> a document position inside that link."""
    found, block = {}, view.document().begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            fragment = it.fragment()
            if fragment.charFormat().isAnchor():
                found[fragment.charFormat().anchorHref()] = fragment.position() + fragment.length() // 2
            it += 1
        block = block.next()
    return found


def click_at(qtbot, view, position: int) -> None:
    cursor = view.textCursor()
    cursor.setPosition(position)
    point = view.cursorRect(cursor).center()
    qtbot.mouseClick(view.viewport(), Qt.MouseButton.LeftButton, pos=point)


def fragment_color(view, text: str) -> QColor:
    block = view.document().begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            if it.fragment().text() == text:
                return it.fragment().charFormat().foreground().color()
            it += 1
        block = block.next()
    raise AssertionError(f"no fragment {text!r}")


def test_code_blocks_copy_highlight_and_shade_links_open(launch, data_dir, store, qtbot, monkeypatch):
    write_settings(data_dir, wizard_done=True, store_path=str(store), theme="light")
    parts = launch(engine=FakeEngineBackend(reply=lambda m, s: REPLY))
    qtbot.waitUntil(lambda: parts.controller.loaded is not None, timeout=3000)
    parts.window.resize(1280, 800)
    send(parts, qtbot, "How do I read a file?")
    view = parts.window.chat.view
    links = anchors(view)
    copies = sorted(h for h in links if h.startswith("moeferry:copycode/"))
    assert len(copies) == 2, "one Copy per code block, the fenced and the indented one"
    click_at(qtbot, view, links[copies[0]])
    assert QGuiApplication.clipboard().text() == "def read(path):\n    return open(path).read()  # whole file"
    click_at(qtbot, view, links[copies[1]])
    assert QGuiApplication.clipboard().text() == "lines = read('a.txt').splitlines()"
    palette = colors(False)
    assert fragment_color(view, "def").name() == palette["keyword"]
    assert fragment_color(view, "# whole file").name() == palette["comment"]
    code_bg = QColor(palette["code_bg"])
    shaded = [b.text() for b in iter_blocks(view) if b.blockFormat().background().color() == code_bg]
    assert "lines = read('a.txt').splitlines()" in shaded and "def read(path):" in shaded
    opened = []
    monkeypatch.setattr(QDesktopServices, "openUrl", lambda url: opened.append(url.toString()) or True)
    click_at(qtbot, view, links["https://docs.python.org/3/tutorial/inputoutput.html"])
    assert opened == ["https://docs.python.org/3/tutorial/inputoutput.html"]


def iter_blocks(view):
    block = view.document().begin()
    while block.isValid():
        yield block
        block = block.next()


def test_the_users_line_breaks_are_kept(ready, qtbot):
    send(ready, qtbot, "first line\nsecond line\n\n*not emphasis*")
    view = ready.window.chat.view
    assert "first line\nsecond line\n\n*not emphasis*" in view.toPlainText()
    block = next(b for b in iter_blocks(view) if b.text() == "first line")
    fmt = block.begin().fragment().charFormat()
    assert not fmt.isAnchor() and fmt.foreground().style() == Qt.BrushStyle.NoBrush, "plain text, not the header's"


def test_status_bar_does_not_show_the_last_replys_speed_while_streaming(ready, qtbot, engine_backend):
    send(ready, qtbot, "first")
    tps = ready.window.status.labels["tps"]
    assert re.fullmatch(r"[\d.]+ tok/s", tps.text())
    engine_backend.engine.gate.clear()
    ready.window.chat.input.editor.setPlainText("second")
    ready.window.chat.input.send_button.click()
    assert tps.text() == "generating…" and ready.window.status.labels["cache"].text() == "cache hits –"
    with qtbot.waitSignal(ready.controller.reply_finished, timeout=5000):
        engine_backend.engine.gate.set()
    assert re.fullmatch(r"[\d.]+ tok/s", tps.text())


def test_expert_map_and_status_bar_say_the_same_hit_rate(ready, qtbot, engine_backend):
    engine = engine_backend.engine
    stream = engine.stream

    def stream_counting_the_prompt_too(messages, sampling, cancel=None):
        yield from stream(messages, sampling, cancel)
        engine.last_stats.cache_hits += 40  # the engine counts prompt tokens as well; the trace does not

    engine.stream = stream_counting_the_prompt_too
    send(ready, qtbot)
    summary = ready.window.expert_map.summary
    stats = engine.last_stats
    assert round(stats.cache_hits / (stats.cache_hits + stats.cache_misses), 2) != round(summary.hit_rate(), 2)
    assert ready.window.status.labels["cache"].text() == f"cache hits {summary.hit_rate():.0%}"
    assert f"cache hits {summary.hit_rate():.0%}" in ready.window.expert_map._header()[0][2]


def test_orange_in_the_expert_map_means_only_copied_in(ready, qtbot):
    from moeferry.app.widgets.expert_map import MISS

    send(ready, qtbot)
    emap = ready.window.expert_map
    emap.resize(400, 700)
    image = emap.grab().toImage()
    s = emap.summary
    layer, expert = max(((la, e) for la in range(s.num_layers) for e in range(s.num_experts)),
                        key=lambda le: s.counts[le[0]][le[1]])
    heat = emap._heat_rect()
    x = int(heat.left() + (layer + 0.5) * emap._col_w())
    y = int(heat.top() + expert * emap._row_h() + 3)
    hottest = image.pixelColor(x, y)
    assert abs(hottest.hslHue() - MISS.hslHue()) > 90, "the most-chosen cell is not the misses' orange"


# Point 13: keyboard and reading ---------------------------------------------------------------

def test_ctrl_n_focuses_the_message_box_and_tab_leaves_it(ready, qtbot):
    window = ready.window
    window.activateWindow()
    qtbot.waitUntil(lambda: QApplication.activeWindow() is window, timeout=2000)
    window.conversations.search.setFocus()
    qtbot.keyClick(window, Qt.Key.Key_N, Qt.KeyboardModifier.ControlModifier)
    editor = window.chat.input.editor
    assert QApplication.focusWidget() is editor
    qtbot.keyClicks(editor, "typed")
    qtbot.keyClick(editor, Qt.Key.Key_Tab)
    assert QApplication.focusWidget() is not editor and editor.toPlainText() == "typed"


@pytest.mark.parametrize("dark", [False, True])
def test_text_colors_meet_wcag_aa(dark):
    pal, named = palette_colors(dark), colors(dark)
    backgrounds = [pal["Window"], pal["Base"], pal["AlternateBase"]]
    for fg in ("WindowText", "Text", "PlaceholderText", "Link"):
        for bg in backgrounds:
            assert contrast_ratio(pal[fg], bg) >= 4.5, (fg, bg)
    for name in ("you", "assistant", "good", "warning", "error"):
        for bg in backgrounds:
            assert contrast_ratio(named[name], bg) >= 4.5, (name, bg)
    for name in ("keyword", "string", "comment", "number", "name", "you"):
        assert contrast_ratio(named[name], named["code_bg"]) >= 4.5, name
    assert contrast_ratio("#ffffff", named["badge_bg"]) >= 4.5
    assert contrast_ratio(pal["HighlightedText"], pal["Highlight"]) >= 4.5


def test_text_size_setting_and_ctrl_wheel_are_kept_across_restarts(ready, qtbot, launch, qapp):
    window = ready.window
    default = qapp.font().pointSizeF()
    window.settings_panel.font_size.setValue(round(default) + 3)
    assert qapp.font().pointSizeF() == round(default) + 3
    view = window.chat.view
    wheel = QWheelEvent(QPointF(20, 20), QPointF(view.mapToGlobal(QPoint(20, 20))), QPoint(0, 0), QPoint(0, 120),
                        Qt.MouseButton.NoButton, Qt.KeyboardModifier.ControlModifier, Qt.ScrollPhase.NoScrollPhase,
                        False)
    QApplication.sendEvent(view.viewport(), wheel)
    assert ready.settings.get(Key.FONT_SIZE) == round(default) + 4
    assert window.settings_panel.font_size.value() == round(default) + 4
    window.close()
    again = launch()
    assert again.settings.get(Key.FONT_SIZE) == round(default) + 4
    assert qapp.font().pointSizeF() == round(default) + 4
    again.window.settings_panel.font_size.setValue(again.window.settings_panel.font_size.minimum())
    assert again.settings.get(Key.FONT_SIZE) == 0 and qapp.font().pointSizeF() == default


def test_a_renamed_chat_shows_its_new_title_and_empty_chats_do_not_pile_up(ready, qtbot):
    window = ready.window
    send(ready, qtbot, "Something to talk about")
    ready.controller.rename(ready.controller.current_id, "Renamed chat")
    assert window.chat.title.full_text() == "Renamed chat"
    for _ in range(3):
        window.new_chat()
    empty = [c for c in ready.history.conversations() if not c.messages]
    assert len(empty) == 1 and ready.controller.current_id == empty[0].id


def test_the_real_download_error_is_said_in_app_words(tmp_path, hub_online):
    from moeferry.app.errors import describe_error
    from moeferry.engine.setup.download import fetch_repo

    with pytest.raises(Exception) as caught:  # a closed local port: no network is used
        fetch_repo("org/model", tmp_path / "dl", endpoint="http://127.0.0.1:9", max_retries=0, backoff_s=0)
    assert "--endpoint" in str(caught.value), "the engine's sentence is written for the command line"
    info = describe_error(caught.value)
    assert "--endpoint" not in info.message and "ConnectError" not in info.message
    assert "internet connection" in info.message


def test_app_doc_names_only_files_that_exist():
    text = (ROOT / "docs" / "APP.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`((?:app|tests|resources|docs|engine)/[\w./-]+\.(?:py|qss|json|md))`", text))
    assert len(named) > 10
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, missing
