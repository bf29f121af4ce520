"""What streams answered at once give together (the capacity drill, bench/peers.py)."""

from __future__ import annotations


def decode_while_all(streams: list[tuple[list[float], float]]) -> float | None:
    """Tokens a second, all streams together, while every one of them was decoding: from the last
    stream's first delta to the first stream's last one (None if that window is empty). Each stream
    is (the times of its deltas, its tokens); its tokens in the window are its tokens times its
    share of deltas there."""
    begin, end = max(times[0] for times, _ in streams), min(times[-1] for times, _ in streams)
    if end <= begin:
        return None
    inside = sum(tokens * sum(begin < t <= end for t in times) / len(times) for times, tokens in streams)
    return inside / (end - begin)
