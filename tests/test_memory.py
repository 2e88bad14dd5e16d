"""Memory really shards: per-rank peak of a training step at s=2048 (profiler allocation events), vs one device."""
import pytest

from bench.memory import measure


@pytest.mark.parametrize("sp,limit", [(4, 0.45)])      # SP = 2's figures: bench/memory.py, bench/RESULTS.md
def test_per_rank_peak_memory(sp, limit):
    m = measure(2048, sp)
    ratio = max(m["sp"]) / m["single"]
    assert abs(m["loss"] - m["ref"]) <= 1e-5 * abs(m["ref"])
    assert ratio <= limit, f"SP={sp}: per-rank peak {ratio:.3f} of single-device, limit {limit}"
