"""The thread pool's contract (csrc/thread_pool.h): every job of a region runs exactly once,
whichever participant takes it (owners from the front of their range, others from the back once
theirs is empty); a job's exception reaches the caller and the pool stays usable; solo periods
(regions on the caller alone after a contended one) start, double and reset as SoloPeriods says."""
import pytest

from sapwood import _core


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_every_job_runs_once(threads):
    for n in list(range(0, 40)) + [63, 64, 65, 650]:
        counts, raised = _core.pool_job_counts(n, threads, repeats=25)
        assert counts == [25] * n, (n, threads)
        assert raised == 0


@pytest.mark.parametrize("raise_at", [0, 5, 16])
def test_a_jobs_exception_reaches_the_caller_and_the_pool_goes_on(raise_at):
    counts, raised = _core.pool_job_counts(17, 2, repeats=10, raise_at=raise_at)
    assert raised == 10
    assert counts == [10] * 17  # the other jobs of a region still ran
    counts, raised = _core.pool_job_counts(17, 2, repeats=3)
    assert (counts, raised) == ([3] * 17, 0)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="repeats=0"):
        _core.pool_job_counts(4, 2, repeats=0)


MS = 1_000_000  # ns


def test_solo_periods_start_double_and_reset():
    """(now, end, contended) per region on a virtual clock: the answers of solo(now)."""
    events = [(0, 1 * MS, 0),            # together, uncontended
              (2 * MS, 3 * MS, 1),       # contended: solo until 3 + 5 ms, next period 10
              (5 * MS, 0, 0),            # solo
              (7 * MS, 0, 0),            # still solo (until 8)
              (9 * MS, 10 * MS, 1),      # together again, contended: solo until 10 + 10
              (19 * MS, 0, 0),           # solo (until 20): the period doubled
              (21 * MS, 22 * MS, 0),     # together, uncontended: the period is 5 again
              (23 * MS, 24 * MS, 1),     # contended: solo until 24 + 5
              (28 * MS, 0, 0),           # solo
              (30 * MS, 31 * MS, 0)]     # together
    assert _core.solo_periods_trace(events) == [False, False, True, True, False, True, False,
                                                False, True, False]


def test_solo_periods_cap():
    """Contended regions, each after the last one's period has run out, double the period
    5, 10, ... up to its cap of 640 ms, never past it."""
    seq = [(i * 2_000 * MS, i * 2_000 * MS, 1) for i in range(8)]
    assert _core.solo_periods_trace(seq) == [False] * 8
    last = seq[-1][1]
    assert _core.solo_periods_trace(seq + [(last + 639 * MS, 0, 0)])[-1] is True
    assert _core.solo_periods_trace(seq + [(last + 641 * MS, 0, 0)])[-1] is False


def test_solo_regions_run_every_job_once():
    """With solo periods on (the default outside tests), regions still run each job once."""
    _core.set_solo_periods(True)
    try:
        counts, raised = _core.pool_job_counts(65, 2, repeats=50)
        assert counts == [50] * 65 and raised == 0
    finally:
        _core.set_solo_periods(False)
