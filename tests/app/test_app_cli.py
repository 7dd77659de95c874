"""app/cli.py: the `moeferry` console script opens the app alone and is the engine's CLI otherwise."""

from __future__ import annotations

import re
import sys

import pytest

from moeferry.app import cli
from moeferry.engine.paths import demo_store_path
from tests.conftest import ROOT, run_cli


def test_no_arguments_open_the_app(monkeypatch):
    from moeferry.app import main as app_main

    opened = []
    monkeypatch.setattr(app_main, "run_gui", lambda: opened.append(True) or 0)
    monkeypatch.setattr(sys, "argv", ["moeferry"])
    assert cli.main() == 0 and opened


def test_a_command_goes_to_the_engine(capsys):
    assert cli.main(["demo", "--path"]) == 0
    assert capsys.readouterr().out.strip() == str(demo_store_path())


def test_bad_usage_is_the_engines_exit_code(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["generate"])
    assert stop.value.code == 2 and "--prompt" in capsys.readouterr().err


def test_the_console_script_is_this_module():
    scripts = re.search(r"^\[project\.scripts\]\n((?:.+\n)+)", (ROOT / "pyproject.toml").read_text(), re.M)
    assert scripts.group(1).strip() == 'moeferry = "moeferry.app.cli:main"'


def test_the_engine_cli_without_a_command_says_what_to_do():
    out = run_cli()
    assert out.returncode == 2 and "give a command" in out.stderr and "Traceback" not in out.stderr
