"""The memory benchmark rewrites only its own section of docs/benchmarks.md."""

from __future__ import annotations

from research.evals.docs import replace_section

DOCUMENT = "# Benchmarks\n\n## Memory modes\n\nold table\n\n## Neurocache\n\nkept figures\n"


def test_replaces_its_section_and_keeps_the_others():
    out = replace_section(DOCUMENT, "## Memory modes\n\nnew table\n")
    assert out == "# Benchmarks\n\n## Memory modes\n\nnew table\n\n## Neurocache\n\nkept figures\n"


def test_last_section_and_missing_section():
    out = replace_section(DOCUMENT, "## Neurocache\n\nnew figures\n")
    assert out == "# Benchmarks\n\n## Memory modes\n\nold table\n\n## Neurocache\n\nnew figures\n"
    added = replace_section("# Benchmarks\n", "## Memory modes\n\nt\n")
    assert added == "# Benchmarks\n\n## Memory modes\n\nt\n"
