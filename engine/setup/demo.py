"""The embedded demo model: where it is, a self-test, and the expert-locality study.

The demo is a small Mixtral (8 experts, top-2, 8 layers, about 24M parameters) trained on the
Python 3.11 documentation by training/train_demo.py and shipped as a MoE Ferry store in
resources/demo (docs/DEMO.md says how it was made). `STORE` arguments accept the word `demo`.

    moeferry demo                 where the demo store is and how to chat with it
    moeferry demo --path          print its folder
    moeferry demo --selftest      verify its files and generate a few greedy tokens on the CPU
    moeferry demo locality [--store STORE] [--text FILE] [--json] [--plot PNG] [--max-tokens N]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from moeferry.engine.errors import UserError
from moeferry.engine.paths import demo_store_path

SELFTEST_PROMPT = "What is a list in Python?"


def require_demo() -> Path:
    path = demo_store_path()
    if not (path / "manifest.json").is_file():
        raise UserError(f"The demo model is missing from {path}; reinstall MoE Ferry.", exit_code=1)
    return path


def greedy_reply(prompt: str, max_new_tokens: int = 24, device: str = "cpu") -> tuple[str, list[int], float]:
    """(text, token ids, tokens/s) of the demo model's greedy answer to one chat message."""
    from moeferry.engine.runtime.generate import SamplingSettings, load_engine

    engine = load_engine("demo", device=device)
    # No repetition controls: the greedy tokens stay comparable with transformers' generate.
    settings = SamplingSettings(temperature=0.0, top_p=1.0, max_new_tokens=max_new_tokens,
                                repeat_penalty=1.0, no_repeat_ngram=0)
    pieces = list(engine.stream(prompt, settings, chat=True))
    stats = engine.last_stats
    engine.close()
    return "".join(p.text for p in pieces), [p.token_id for p in pieces], stats.tokens_per_s


def selftest() -> int:
    from moeferry.engine.storage.store import open_store, verify_store

    path = require_demo()
    bad = verify_store(path)
    for line in bad:
        print(f"BAD {line}", file=sys.stderr)
    if bad:
        print(f"moeferry: {len(bad)} file(s) of the demo model are damaged; reinstall MoE Ferry.",
              file=sys.stderr)
        return 1
    n_files = len(open_store(path).manifest["files"])
    t0 = time.perf_counter()
    text, ids, tok_s = greedy_reply(SELFTEST_PROMPT, max_new_tokens=16)
    again, ids2, _ = greedy_reply(SELFTEST_PROMPT, max_new_tokens=16)
    if not ids or ids != ids2:
        print("moeferry: the demo model's greedy output is not reproducible; report this.",
              file=sys.stderr)
        return 1
    print(f"Verified {n_files} files of {path}.")
    print(f"Q: {SELFTEST_PROMPT}\nA: {text.strip()}")
    print(f"Demo self-test passed: {len(ids)} greedy tokens, twice the same, {tok_s:.1f} tokens/s "
          f"({time.perf_counter() - t0:.1f} s in all).")
    return 0


def cli_demo(argv: list[str]) -> int:
    """`moeferry demo ...` (argv: the words after `demo`)."""
    if argv and argv[0] == "locality":
        p = argparse.ArgumentParser(prog="moeferry demo locality",
                                    description="LRU hit ratio and prefetch recall of a model's "
                                                "expert routing on held-out text.")
        p.add_argument("--store", default="demo", help="a store folder or `demo` (the default)")
        p.add_argument("--text", help="UTF-8 text file (default: the demo corpus' held-out text)")
        p.add_argument("--json", action="store_true", help="print one JSON object")
        p.add_argument("--plot", help="write a PNG plot here")
        p.add_argument("--max-tokens", type=int, help="at most this many tokens of text (default 131,072)")
        a = p.parse_args(argv[1:])
        if a.max_tokens is not None and a.max_tokens < 16:
            raise UserError("--max-tokens must be at least 16.")
        from moeferry.engine.measure.locality import cli_locality
        print("moeferry: routing the text through the model and replaying the expert cache; the "
              "default text takes about 100 s on 2 CPU cores (--max-tokens N for a shorter run).",
              file=sys.stderr, flush=True)
        return cli_locality(a.store, a.text, a.json, a.plot, max_tokens=a.max_tokens)
    p = argparse.ArgumentParser(prog="moeferry demo",
                                description="The embedded demo model (see also `moeferry demo "
                                            "locality --help`).")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--path", action="store_true", help="print the demo store's folder")
    g.add_argument("--selftest", action="store_true", help="verify it and generate a few tokens")
    a = p.parse_args(argv)
    if a.selftest:
        return selftest()
    path = require_demo()
    if a.path:
        print(path)
        return 0
    print(f"The demo model (a small Mixtral trained on the Python docs) is in {path}.\n"
          f"Chat with it: moeferry generate demo --chat --prompt \"What is a list?\"")
    return 0
