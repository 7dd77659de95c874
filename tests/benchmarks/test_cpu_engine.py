"""benchmarks/cpu_engine.py: the CPU engine on a synthetic full-width model, its low-bit dense
forms against float32 (one OLMoE layer: 64 experts of 3.3 MB, a few seconds)."""

import re

import pytest

from benchmarks import cpu_engine


@pytest.mark.slow
def test_the_low_bit_dense_forms_read_less_than_float32(capsys):
    assert cpu_engine.main(["--model", "olmoe-1b-7b", "--layers", "1", "--expert-bits", "4", "--attn-bits", "8",
                            "--threads", "1", "--prompt-len", "3", "--new-tokens", "3", "--repeats", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "tok/s" not in line]
    assert [r.split(" | ")[0] for r in rows] == ["| low-bit: 2-4 bit in place, 8-bit and the head int8",
                                                 "| dequantized to float32"]
    read = [float(r.split(" | ")[2]) for r in rows]  # GB a decoded token reads
    assert read[0] < read[1] / 2
    rates = [float(re.search(r"\*\*([\d.]+)\*\*", r).group(1)) for r in rows]
    assert all(rate > 0 for rate in rates)


@pytest.mark.slow
def test_several_prompt_lengths_give_a_row_each_and_low_bit_alone_leaves_out_float32(capsys):
    assert cpu_engine.main(["--model", "olmoe-1b-7b", "--layers", "1", "--expert-bits", "4", "--attn-bits", "8",
                            "--threads", "1", "--prompt-len", "3", "9", "--new-tokens", "3", "--repeats", "1",
                            "--dense", "low-bit"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "tok/s" not in line]
    assert [(r.split(" | ")[0], r.split(" | ")[3]) for r in rows] == [
        ("| low-bit: 2-4 bit in place, 8-bit and the head int8", "3"),
        ("| low-bit: 2-4 bit in place, 8-bit and the head int8", "9")]
