"""The locality study: LRU and prefetch numbers against hand-computed cases."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moeferry.engine.measure import locality as loc
from moeferry.engine.measure.routing import RoutingTrace

# One layer, 4 experts, top-2; each row is a token's experts, best first.
ROUTING = np.array([[0, 1], [1, 2], [0, 1], [3, 0], [0, 3]])


def test_lru_hits_hand_computed():
    # The cache is looked up before the update; after token t it holds t's experts (top-1
    # most recent), then older ones, cut to C.
    # C=1 holds the previous top-1: t0 []->0, t1 [0] vs {1,2} 0, t2 [1] vs {0,1} 1,
    #   t3 [0] vs {3,0} 1, t4 [3] vs {0,3} 1 -> 3 hits of 10.
    assert loc.lru_hits(ROUTING, 1) == 3
    # C=2: t0 0 -> [0,1]; t1 {1,2} 1 -> [1,2]; t2 {0,1} 1 -> [0,1]; t3 {3,0} 1 -> [3,0];
    #   t4 {0,3} 2 -> 5 hits.
    assert loc.lru_hits(ROUTING, 2) == 5
    # C=3: t0 0 -> [0,1]; t1 1 -> [1,2,0]; t2 2 -> [0,1,2]; t3 1 (0) -> [3,0,1]; t4 2 -> 6.
    assert loc.lru_hits(ROUTING, 3) == 6
    # C=4: t0 0; t1 1 -> [1,2,0]; t2 2 -> [0,1,2]; t3 1 (3 never seen) -> [3,0,1,2]; t4 2 -> 6.
    assert loc.lru_hits(ROUTING, 4) == 6
    assert loc.lru_hit_ratio(ROUTING[None], 2) == pytest.approx(0.5)


def test_lru_ratio_averages_layers():
    # Layer 0 as above (C=1: 0.3); layer 1 always (2, 3): 4 of 5 tokens hit their top-1
    # (the previous top-1 is 2 again) -> 4/10. Mean 0.35.
    sel = np.stack([ROUTING, np.tile([2, 3], (5, 1))])
    assert loc.lru_hit_ratio(sel, 1) == pytest.approx(0.35)


def test_prefetch_recall_hand_computed():
    used = np.array([[0, 1], [2, 3]])
    guessed = np.array([[1, 2, 0], [3, 0, 1]])
    # m=1: {1} finds 1 of {0,1}; {3} finds 1 of {2,3} -> 2/4.
    assert loc.prefetch_recall(guessed, used, 1) == pytest.approx(0.5)
    # m=2: {1,2} finds 1; {3,0} finds 1 -> 2/4.
    assert loc.prefetch_recall(guessed, used, 2) == pytest.approx(0.5)
    # m=3: {1,2,0} finds both; {3,0,1} finds 1 -> 3/4.
    assert loc.prefetch_recall(guessed, used, 3) == pytest.approx(0.75)


def test_report_aligns_guesses_with_the_layer_ahead():
    # 3 layers, one token, 4 experts. Layer experts: L0 {0,1}, L1 {2,3}, L2 {1,3}.
    sel = np.array([[[0, 1]], [[2, 3]], [[1, 3]]])
    guesses = np.full((2, 3, 1, 3), -1)  # [D, L, T, m]: what layer l guessed for layer l + d
    guesses[0, 0, 0] = [2, 0, 1]  # from L0 for L1
    guesses[0, 1, 0] = [3, 0, 2]  # from L1 for L2
    guesses[1, 0, 0] = [1, 3, 0]  # from L0 for L2
    weights = np.full((3, 1, 2), 0.5, dtype=np.float32)
    r = loc.report_from_trace(RoutingTrace(sel, weights, guesses, num_experts=4), distances=(1, 2, 3))
    # d=1, m=1: {2} vs {2,3} 1, {3} vs {1,3} 1 -> 2/4; m=2: {2,0} 1, {3,0} 1 -> 2/4;
    # m=3: {2,0,1} 1 (3 missing), {3,0,2} 1 (1 missing) -> 2/4.
    assert r.prefetch_recall[1] == pytest.approx({1: 0.5, 2: 0.5, 3: 0.5})
    # d=2: {1} vs {1,3} 1/2; {1,3} 2/2; {1,3,0} 2/2.
    assert r.prefetch_recall[2] == pytest.approx({1: 0.5, 2: 1.0, 3: 1.0})
    assert 3 not in r.prefetch_recall  # no layer is 3 ahead of another here
    # Random routing, E=4: a cache of C hits C/4; m guesses recall m/4.
    assert r.lru_hit_ratio_random == pytest.approx({1: 0.25, 2: 0.5, 3: 0.75, 4: 1.0})
    assert r.prefetch_recall_random == pytest.approx({1: 0.25, 2: 0.5, 3: 0.75})
    assert "| 2 layers ahead | 0.500 | 1.000 | 1.000 |" in loc.markdown_tables(r)


def test_random_baseline_matches_a_simulation():
    rng = np.random.default_rng(0)
    sel = np.stack([rng.permutation(8)[:2] for _ in range(4000)])[None]  # uniform top-2 of 8
    guess = np.stack([rng.permutation(8)[:3] for _ in range(4000)])
    for c in (1, 2, 3, 4):
        assert loc.lru_hit_ratio(sel, c) == pytest.approx(loc.random_lru_hit_ratio(8, c), abs=0.02)
    for m in (1, 2, 3):
        assert loc.prefetch_recall(guess, sel[0], m) == pytest.approx(
            loc.random_prefetch_recall(8, m), abs=0.02)


def test_cli_locality_on_a_store(tiny_store, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("abc def ghi jkl mno pqr stu vwx yz " * 20)
    assert loc.cli_locality(str(tiny_store), str(text), json_out=True, plot=None) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["layers"] == 2 and r["num_experts"] == 4 and r["top_k"] == 2
    assert set(r["prefetch_recall"]) == {"1"}  # only 1 layer ahead exists in 2 layers
    assert r["lru_hit_ratio_random"]["4"] == 1.0


def test_cli_locality_says_what_is_wrong(tiny_store, tmp_path):
    from moeferry.engine.errors import UserError
    with pytest.raises(UserError, match="not a file"):
        loc.cli_locality(str(tiny_store), str(tmp_path / "missing.txt"), json_out=False, plot=None)


def test_cli_locality_reports_progress_while_it_records(tiny_store, tmp_path, capsys):
    """`demo locality` runs for minutes on real text: stderr shows how far it is, per window."""
    from moeferry.engine.measure.routing import TRACE_WINDOW

    text = tmp_path / "text.txt"
    text.write_text("def read(path):\n    with open(path) as f:\n        return f.read()\n" * 80)
    assert loc.cli_locality(str(tiny_store), str(text), json_out=True, plot=None, max_tokens=3 * TRACE_WINDOW) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "recording the routing" in line]
    assert lines and lines[-1].strip().startswith("100.0%")
    assert f"of {3 * TRACE_WINDOW} tokens" in lines[-1]
