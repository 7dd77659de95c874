"""benchmarks/cpu_busy.py: the CPU engine with and without a busy loop beside it (one OLMoE layer)."""

import pytest

from benchmarks import cpu_busy


@pytest.mark.slow
def test_each_run_gives_its_rates_and_counts(capsys):
    assert cpu_busy.main(["--model", "olmoe-1b-7b", "--layers", "1", "--threads", "2", "--tokens", "12"]) == 0
    rows = [r.split(" | ") for r in capsys.readouterr().out.splitlines() if r.startswith("| ") and "tok/s" not in r]
    assert [(r[0], r[1]) for r in rows] == [("| none", "automatic"), ("| none", "2"), ("| none", "1"),
                                            ("| a busy loop", "automatic"), ("| a busy loop", "2"),
                                            ("| a busy loop", "1")]
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows)
    assert [r[4].rstrip(" |") for r in rows[1:3]] == ["2 2", "1 1"], "a count given stays"
