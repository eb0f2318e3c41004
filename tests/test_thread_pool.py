"""The thread pool's contract (csrc/thread_pool.h): every job of a region runs exactly once,
whichever participant takes it (owners from the front of their range, others from the back once
theirs is empty); a job's exception reaches the caller and the pool stays usable."""
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
