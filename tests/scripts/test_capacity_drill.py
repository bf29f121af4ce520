"""The capacity drill's arithmetic (scripts/drills/capacity.py): the rounds' ratio is the median of
those measured, and a failed wave in any round fails the drill."""

from __future__ import annotations

from scripts.drills.capacity import _median, capacity_passed


def wave(failed: int = 0) -> dict:
    return {"refused": 0, "failed": failed}


def result(single_failed: int = 0) -> dict:
    rounds = [{"single": wave(), "streams": wave()}, {"single": wave(single_failed), "streams": wave()}]
    return {"people": wave(), "rounds": rounds, "kv_blocks_after": 0.0, "alive": True}


def test_the_median_leaves_out_rounds_that_measured_nothing():
    assert _median([3.87, None, 3.06, 3.43]) == 3.43
    assert _median([None, 2.93]) == 2.93
    assert _median([None, None]) is None


def test_a_failed_lone_stream_in_any_round_fails_the_drill():
    assert capacity_passed(result())
    assert not capacity_passed(result(single_failed=1))
