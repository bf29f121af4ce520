"""The memory benchmark rewrites only its own section of docs/benchmarks.md."""

from __future__ import annotations

import datetime

from research.evals.docs import dated, replace_section, write_section

DOCUMENT = "# Benchmarks\n\n## Memory modes\n\nold table\n\n## Neurocache\n\nkept figures\n"


def test_replaces_its_section_and_keeps_the_others():
    out = replace_section(DOCUMENT, "## Memory modes\n\nnew table\n")
    assert out == "# Benchmarks\n\n## Memory modes\n\nnew table\n\n## Neurocache\n\nkept figures\n"


def test_last_section_and_missing_section():
    out = replace_section(DOCUMENT, "## Neurocache\n\nnew figures\n")
    assert out == "# Benchmarks\n\n## Memory modes\n\nold table\n\n## Neurocache\n\nnew figures\n"
    added = replace_section("# Benchmarks\n", "## Memory modes\n\nt\n")
    assert added == "# Benchmarks\n\n## Memory modes\n\nt\n"


def test_a_written_section_says_when_it_was_measured(tmp_path):
    path = tmp_path / "figures.md"
    write_section(path, "## Memory modes\n\nnew table\n")
    today = datetime.date.today().isoformat()
    assert path.read_text() == f"# Benchmarks\n\n## Memory modes\n\nMeasured {today}.\n\nnew table\n"
    assert dated("## H\nbody\n", datetime.date(2026, 11, 23)) == "## H\n\nMeasured 2026-11-23.\n\nbody\n"


def test_the_memory_benchmark_stops_at_once_when_its_server_exits(monkeypatch):
    """A server that dies while starting (a missing package on a GPU machine, 2026-11-29) fails the benchmark
    at once, not after the 300 s readiness deadline."""
    import sys
    import time

    import pytest

    from bench import bench_memories

    monkeypatch.setattr(sys, "executable", "false")  # `false -m clients.cli serve ...`: exits 1 at once
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with status 1"):
        bench_memories.start_server(1)
    assert time.monotonic() - started < 30
