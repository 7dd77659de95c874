"""engine/units.py: the byte formatter the CLI and the app share."""

from __future__ import annotations

from moeferry.engine.units import GB, GiB, MiB, fmt_bytes, fmt_memory


def test_binary_and_decimal_units():
    assert fmt_bytes(int(1.5 * GiB)) == "1.5 GiB" and fmt_bytes(int(1.5 * GiB), decimal=True) == "1.6 GB"
    assert fmt_bytes(300 * MiB) == "300.0 MiB" and fmt_bytes(17_500_000_000, decimal=True) == "17.5 GB"
    assert fmt_bytes(512) == "512 B" and fmt_bytes(None) == "unknown"
    assert fmt_bytes(2 * 1024 * GiB) == "2.0 TiB" and fmt_bytes(999 * GB, decimal=True) == "999.0 GB"


def test_memory_as_it_is_sold():
    assert fmt_memory(12 * GiB) == "12 GB" and fmt_memory(int(7.5 * GiB)) == "7.5 GB"
    assert fmt_memory(int(31.9 * GiB)) == "32 GB" and fmt_memory(int(3.98 * GiB)) == "4 GB"


def test_one_duration_formatter_for_the_cli_and_the_app():
    from moeferry.engine.units import fmt_duration

    assert fmt_duration(45) == "45 s" and fmt_duration(75) == "1 min 15 s" and fmt_duration(3725) == "1 h 02 min"
    assert fmt_duration(None) == fmt_duration(float("nan")) == fmt_duration(-1) == "unknown"


def test_the_download_bar_writes_bytes_and_time_left_with_engine_units():
    import io

    from moeferry.engine.setup.download_progress import FetchProgress, _ProgressBar

    out = io.StringIO()
    _ProgressBar(out)(FetchProgress("model.safetensors", 0, 0, int(1.5 * GiB), 3 * GiB, 100 * MiB, 75.0, 0, 2,
                                    phase="done"))
    line = out.getvalue()
    assert "1.5 GiB/3.0 GiB 100.0 MiB/s ETA 1 min 15 s  model.safetensors" in line
