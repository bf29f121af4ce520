"""A real server process killed with `kill -9` mid-ingestion and started again on the same data
folder: every earlier document and answer is intact."""

from __future__ import annotations

from scripts.drills.crash import crash_passed, run_crash
from tests.helpers import CACHE_DIR


def test_kill_9_mid_ingestion_loses_only_that_document(tiny_dir, alice):
    args = ["--model", str(tiny_dir), "--dtype", "float32", "--segment-len", "64", "--cache-dir", str(CACHE_DIR)]
    # two kept documents of 10,000 characters (`make drills ARGS="--only crash"`: the whole book)
    result = run_crash(args, alice[:40_000], memory="text")
    assert crash_passed(result), result
    assert len(result["documents_after"]) == 2
