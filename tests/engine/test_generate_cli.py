"""`moeferry generate` as a new user meets it: repetition controls, hints, limits, Ctrl-C, --help.

The repetition controls are checked against transformers' own logits processors; the demo
model shows that they change a looping reply and that README's command does not loop.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from moeferry.engine import cli
from moeferry.engine.runtime.generate import (
    SamplingSettings,
    load_engine,
    penalize,
    sample,
    store_sampling_defaults,
)

ROOT = Path(__file__).resolve().parents[2]
README_PROMPT = "How do I read a file in Python?"


def run_cli(*args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moeferry.engine.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def repeated_lines(text: str) -> int:
    """How often the most frequent non-blank line occurs."""
    lines = Counter(line.strip() for line in text.splitlines() if line.strip())
    return max(lines.values(), default=0)


@pytest.fixture(scope="module")
def demo():
    return load_engine("demo", device="cpu")


def reply(engine, prompt: str, **settings) -> str:
    s = SamplingSettings(temperature=0, max_new_tokens=128, **settings)
    return "".join(p.text for p in engine.stream(prompt, s, chat=True))


# ---------------------------------------------------------------------------------------------
# The repetition controls


@pytest.mark.parametrize("last_n", [-1, 5])
@pytest.mark.parametrize("penalty", [1.3, 0.8])
def test_repeat_penalty_is_transformers_repetition_penalty_over_the_last_n_tokens(penalty, last_n):
    from transformers import RepetitionPenaltyLogitsProcessor
    torch.manual_seed(0)
    logits = torch.randn(50) * 3  # positive and negative logits
    context = [3, 7, 7, 11, 20, 3, 41, 42, 43, 44]
    window = context if last_n < 0 else context[-last_n:]
    want = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([window]), logits[None].clone())[0]
    got = penalize(logits, SamplingSettings(repeat_penalty=penalty, repeat_last_n=last_n), context)
    assert torch.equal(got, want)
    assert not torch.equal(got, logits)  # the control did something; the input is left alone
    assert torch.equal(logits[[0, 1, 2]], got[[0, 1, 2]])  # tokens outside the context keep theirs


@pytest.mark.parametrize("n", [1, 2, 3])
def test_no_repeat_ngram_is_transformers_no_repeat_ngram_size(n):
    from transformers import NoRepeatNGramLogitsProcessor
    logits = torch.randn(30)
    context = [5, 6, 7, 4, 6, 9, 5, 6]  # "6" was followed by 7 and 9, "5 6" by 7
    want = NoRepeatNGramLogitsProcessor(n)(torch.tensor([context]), logits[None].clone())[0]
    got = penalize(logits, SamplingSettings(no_repeat_ngram=n), context)
    assert torch.equal(got, want)
    banned = set(torch.nonzero(torch.isinf(got)).flatten().tolist())
    assert banned == {1: {4, 5, 6, 7, 9}, 2: {7, 9}, 3: {7}}[n]


def test_greedy_ignores_controls_that_are_off():
    logits = torch.tensor([0.5, 3.0, 2.9, -1.0])
    off = SamplingSettings(temperature=0, repeat_penalty=1.0, no_repeat_ngram=0)
    assert penalize(logits, off, [1, 1, 1]) is logits
    assert sample(logits, off, None, [1, 1, 1]) == 1
    assert sample(logits, SamplingSettings(temperature=0, repeat_penalty=1.1), None, [1]) == 2


def test_the_demo_store_sets_its_repetition_defaults():
    from moeferry.engine.setup.demo import demo_store_path
    defaults = store_sampling_defaults(demo_store_path())
    assert defaults == {"repeat_penalty": 1.0, "no_repeat_ngram": 4}


@pytest.mark.slow
def test_repeat_penalty_stops_the_demo_looping_on_one_line(demo):
    plain = reply(demo, README_PROMPT, repeat_penalty=1.0, no_repeat_ngram=0)
    assert repeated_lines(plain) >= 3  # the loop the issue reported
    penalized = reply(demo, README_PROMPT, repeat_penalty=1.1, no_repeat_ngram=0)
    assert penalized != plain and repeated_lines(penalized) == 1


@pytest.mark.slow
def test_readme_command_does_not_loop():
    readme = (ROOT / "README.md").read_text()
    command = re.search(r'moeferry generate demo --chat --prompt "([^"]+)"', readme)
    assert command, "README's set-up command runs the demo with --chat"
    r = run_cli("generate", "demo", "--chat", "--prompt", command.group(1), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["stats"]["new_tokens"] > 20 and repeated_lines(out["text"]) == 1


# ---------------------------------------------------------------------------------------------
# What the command says


def test_a_raw_question_to_a_chat_model_suggests_chat(capsys):
    assert cli.main(["generate", "demo", "--prompt", README_PROMPT]) == 0
    err = capsys.readouterr().err
    assert "add --chat" in err


def test_a_chat_reply_gets_no_hint(capsys):
    assert cli.main(["generate", "demo", "--chat", "--prompt", README_PROMPT, "--max-new-tokens", "12"]) == 0
    assert "--chat" not in capsys.readouterr().err


def test_an_over_long_prompt_is_one_sentence_without_transformers_warning():
    r = run_cli("generate", "demo", "--prompt", "word " * 2000, env={"TRANSFORMERS_VERBOSITY": "warning"})
    assert r.returncode == 2
    [line] = r.stderr.strip().splitlines()
    assert re.fullmatch(r"moeferry: The prompt has 20\d\d tokens, which leaves no room for a reply in this "
                        r"model's context of 1024; shorten it or start a new conversation\.", line)


def test_max_new_tokens_cut_to_the_context_says_so(capsys):
    rc = cli.main(["generate", "demo", "--prompt", "word " * 1000, "--max-new-tokens", "500", "--json"])
    captured = capsys.readouterr()
    assert rc == 0
    cut = re.search(r"--max-new-tokens 500 is cut to (\d+)", captured.err)
    assert cut, captured.err
    assert json.loads(captured.out)["stats"]["new_tokens"] <= int(cut.group(1)) < 500


def test_a_prompt_that_starts_with_a_dash_is_the_prompt(capsys):
    """argparse takes a value starting with "-" for an option and stopped with "expected one
    argument" (found by random prompts through the CLI); a forgotten prompt is still refused."""
    engine = load_engine("demo", device="cpu")
    for text in ("- a list", "-x", "--help me"):
        assert cli.main(["generate", "demo", "--prompt", text, "--max-new-tokens", "2", "--json"]) == 0, text
        out = json.loads(capsys.readouterr().out)
        assert out["stats"]["prompt_tokens"] == len(engine.encode(text, False))
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "demo", "--prompt", "--json"])
    assert e.value.code == 2 and "--prompt: expected one argument" in capsys.readouterr().err


def test_cpu_run_reports_no_vram_and_refuses_fused_kernels(capsys):
    assert cli.main(["generate", "demo", "--chat", "--prompt", "hi", "--max-new-tokens", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["peak_vram_bytes"] == 0
    assert cli.main(["generate", "demo", "--prompt", "hi", "--kernels", "fused", "--device", "cpu"]) == 2
    assert "--kernels fused runs only on an NVIDIA GPU" in capsys.readouterr().err


def test_bad_repetition_settings_are_one_sentence(capsys):
    assert cli.main(["generate", "demo", "--prompt", "hi", "--repeat-penalty", "0"]) == 2
    assert "--repeat-penalty must be above 0" in capsys.readouterr().err
    assert cli.main(["generate", "demo", "--prompt", "hi", "--no-repeat-ngram", "-1"]) == 2
    assert "--no-repeat-ngram must be 0" in capsys.readouterr().err
    assert cli.main(["generate", "demo", "--prompt", "hi", "--seed", str(10**30)]) == 2  # torch would raise
    assert "--seed must be a whole number from 0 to" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Ctrl-C


def test_ctrl_c_in_json_mode_exits_130_and_says_interrupted(monkeypatch, capsys):
    from moeferry.engine.runtime.generate import Engine
    real_stream = Engine.stream

    def stream_then_ctrl_c(self, *args, **kwargs):  # the signal arrives after five tokens
        for n, piece in enumerate(real_stream(self, *args, **kwargs)):
            if n == 5:
                raise KeyboardInterrupt
            yield piece

    monkeypatch.setattr(Engine, "stream", stream_then_ctrl_c)
    rc = cli.main(["generate", "demo", "--chat", "--prompt", README_PROMPT, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 130
    assert out["interrupted"] is True and len(out["token_ids"]) == 5


def test_an_uninterrupted_json_reply_says_so(capsys):
    assert cli.main(["generate", "demo", "--chat", "--prompt", "hi", "--max-new-tokens", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["interrupted"] is False


@pytest.mark.slow
def test_sigint_during_generation_exits_130():
    # a runner started in the background by a shell ignores SIGINT, and so would the child,
    # whose Python then never installs its Ctrl-C handler: give it the terminal's default back
    p = subprocess.Popen([sys.executable, "-m", "moeferry.engine.cli", "generate", "demo", "--prompt", "The",
                          "--max-new-tokens", "1000", "--no-repeat-ngram", "0"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    first = p.stdout.read(1)  # the first streamed piece: generation is under way
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert first and p.returncode == 130
    assert "[interrupted after " in err and "Traceback" not in err


# ---------------------------------------------------------------------------------------------
# --help and --version


HELP_COMMANDS = [[], ["probe"], ["fetch"], ["convert"], ["verify"], ["generate"], ["bench"],
                 ["bench", "convert"], ["demo"], ["demo", "locality"]]


def options_without_help(help_text: str) -> list[str]:
    """Option lines of an argparse help screen that carry no description."""
    lines = help_text.splitlines()
    missing = []
    for i, line in enumerate(lines):
        m = re.match(r"^  (\S.*?)(?:\s{2,}(\S.*))?$", line)
        if not m or line.startswith(("usage", "   ")):
            continue
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if not m.group(2) and not re.match(r"^\s{4,}\S", nxt):
            missing.append(m.group(1))
    return missing


@pytest.mark.parametrize("words", HELP_COMMANDS, ids=lambda w: " ".join(w) or "moeferry")
def test_every_help_option_has_a_text(words, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main([*words, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "--help" in text
    assert options_without_help(text) == []


def test_the_help_checker_finds_an_option_without_text():
    text = "options:\n  -h, --help  show this\n  --bare\n  --long-one LONG_ONE\n          described\n"
    assert options_without_help(text) == ["--bare"]


def test_version_is_the_packages(capsys):
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"moeferry {version}"
