"""Steps through the set-up wizard that several app tests share."""

from __future__ import annotations

from moeferry.app.wizard.wizard import Page


def next_page(wizard, qtbot, expect: Page, timeout=5000):
    qtbot.waitUntil(wizard.currentPage().isComplete, timeout=timeout)
    wizard.next()
    assert wizard.currentId() == expect


def open_install_page(wizard, qtbot, model_id: str):
    """From the welcome page to the install page of `model_id`; that page."""
    next_page(wizard, qtbot, Page.HARDWARE)
    next_page(wizard, qtbot, Page.MODEL)
    wizard.pages[Page.MODEL].select(model_id)
    next_page(wizard, qtbot, Page.INSTALL)
    return wizard.pages[Page.INSTALL]
