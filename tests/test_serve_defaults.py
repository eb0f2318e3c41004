"""`sapwood serve`'s default slot count: a pure rule of the machine's cores and memory and the
model's per-sequence estimate (server.default_parallel), said in one line at start."""
import pytest
from util import require_packages, tiny_server_target

require_packages()

from sapwood import server  # noqa: E402
from sapwood.memory import estimate  # noqa: E402

GB = 10 ** 9


@pytest.mark.parametrize("cores, free, threads, want", [
    (2, 64 * GB, None, 1),     # two cores: one slot with both, as before the rule
    (8, 64 * GB, None, 4),     # cores for 4 slots of 2 threads
    (64, 64 * GB, None, 4),    # never more than 4 by default
    (8, 64 * GB, 1, 4),        # --threads 1: 8 slots' worth of cores, capped
    (6, 64 * GB, 3, 2),        # --threads 3
    (16, 4 * GB, None, 2),     # memory for 2 slots of 1 GB beside 2 GB shared
    (16, 2.5 * GB, None, 1),   # memory for none past the first: still one
    (1, 64 * GB, None, 1),     # one core: one slot
])
def test_default_parallel_rule(cores, free, threads, want):
    n, why = server.default_parallel(cores, int(free), 2 * GB, 1 * GB, threads)
    assert n == want
    assert why.startswith(f"--parallel {want} (the default:") and f"{cores} cores" in why


def test_default_parallel_says_each_bound():
    n, why = server.default_parallel(8, 5 * GB, 2 * GB, 1 * GB)
    assert n == 3
    assert "8 cores // 2 threads a slot = 4" in why and "holds 3 slots of 1.00 GB" in why


@pytest.mark.parametrize("bad", [{"cores": 0}, {"per_slot_bytes": 0}, {"cores": 2.5},
                                 {"threads": 0}])
def test_default_parallel_bad_input_names_the_value(bad):
    args = dict(cores=4, free_bytes=GB, shared_bytes=0, per_slot_bytes=GB)
    args.update(bad)
    name = next(iter(bad))
    with pytest.raises(ValueError, match=f"{name}="):
        server.default_parallel(**args)


def test_serve_without_parallel_uses_the_rule_and_says_why(tmp_path, monkeypatch, capsys):
    from sapwood.cli import main

    target = tiny_server_target(tmp_path)
    built = []
    monkeypatch.setattr(server, "run", lambda st, **kw: built.append(st))
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(6)), raising=False)
    monkeypatch.setenv("SAPWOOD_MEMORY_GB", "100")
    assert main(["serve", str(target), "--port", "1", "--max-context", "256"]) == 0
    est = estimate(target, max_context=256)
    want, why = server.default_parallel(6, 100 * GB, est.total - est.per_sequence,
                                        est.per_sequence)
    assert want == 3 and len(built[0].scheduler.slots) == 3
    assert f"sapwood serve: {why}" in capsys.readouterr().err
    built[0].close()
    assert main(["serve", str(target), "--port", "1", "--max-context", "256",
                 "--parallel", "1"]) == 0  # asked: no rule, no line
    assert len(built[1].scheduler.slots) == 1 and "the default" not in capsys.readouterr().err
    built[1].close()
