"""The benchmarks' timing harness (comm/bench/harness.py): quartiles, the tie rule, the
rotating interleave and the 30-step floor. Times here are made up: no timing is asserted."""

from __future__ import annotations

import pytest

from soapstone.comm.bench.harness import MIN_STEPS, Ratio, Timing, Verdict, interleave


def test_median_and_interquartile_range():
    t = Timing("a", tuple(float(x) for x in range(1, 10)))
    assert (t.q1, t.median, t.q3) == (3.0, 5.0, 7.0)
    assert t.text() == "5000.0 ms (IQR 3000.0-7000.0)"
    assert t.to_json() == {"median_s": 5.0, "q1_s": 3.0, "q3_s": 7.0, "steps": 9}


def test_overlapping_ranges_are_a_tie_not_a_win():
    ours = Timing("ours", (1.0, 1.1, 1.2, 1.3, 1.4))
    close = Timing("peer", (1.15, 1.25, 1.35, 1.45, 1.55))
    far = Timing("peer", (2.0, 2.1, 2.2, 2.3, 2.4))
    assert Ratio(ours, close).verdict is Verdict.TIE
    assert Ratio(ours, close).value == pytest.approx(1.35 / 1.2)
    assert "tie" in Ratio(ours, close).text()
    assert Ratio(ours, far).verdict is Verdict.FASTER
    assert Ratio(far, ours).verdict is Verdict.SLOWER
    assert Ratio(ours, far).to_json()["verdict"] == "faster"


def test_interleave_rotates_the_order_and_times_after_warmup():
    calls = []
    runs = {n: (lambda n=n: calls.append(n) or n) for n in "abc"}
    seen = []
    session = interleave(runs, MIN_STEPS, warmup=2, after=lambda n, i, v: seen.append((n, i)))
    assert calls[:9] == list("abc" "bca" "cab")  # no one always first
    assert all(len(t.times) == MIN_STEPS for t in session.timings.values())
    assert all(len(v) == MIN_STEPS + 2 for v in session.values.values())
    assert len(seen) == 3 * (MIN_STEPS + 2) and session.load_before >= 0
    with pytest.raises(ValueError, match="at least 30 steps"):
        interleave(runs, MIN_STEPS - 1)


def test_interleave_reads_the_clock_it_is_given():
    """bench_dp --clock cpu passes time.process_time: each step is read from that clock."""
    ticks = iter(range(10**6))
    session = interleave({"a": lambda: None}, MIN_STEPS, warmup=0,
                         clock=lambda: float(next(ticks)))
    assert session.timings["a"].times == (1.0,) * MIN_STEPS
