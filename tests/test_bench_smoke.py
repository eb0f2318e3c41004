"""Smoke runs of the benchmark commands (correctness only: they run, keep every block, check
identical tokens, and write reproducible JSON). Timings are not asserted."""
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from sapwood.benchmarks.ab import block_verdict, run_ab
from sapwood.benchmarks.common import ratio_text
from sapwood.benchmarks.width import accepted_by_width
from sapwood.cli import main
from sapwood.testing import make_tiny_checkpoint
from sapwood.tree import Tree


def bench_script(name):
    """bench/<name>.py imported as a module (bench/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        name, Path(__file__).resolve().parent.parent / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    p = tmp_path_factory.mktemp("bench") / "m"
    make_tiny_checkpoint(p, seed=1)
    return p


def test_block_verdict_rule():
    assert block_verdict([100, 100], [99, 99])["verdict"] == "pass"        # -1%: within 2%
    assert block_verdict([100, 100], [95, 95])["verdict"] == "regression"  # -5%
    assert block_verdict([100, 90], [100, 100])["verdict"] == "inconclusive"  # A spread 10.5%
    v = block_verdict([100, 104], [95, 99])
    assert v["verdict"] == "pass" and v["spread"] == pytest.approx(4 / 97)  # -4.9% <= 2*spread


def test_ab_command_writes_every_block(ckpt, tmp_path, capsys):
    out = tmp_path / "ab.json"
    assert main(["bench", "ab", "--model", str(ckpt), "--a", "verify=off",
                 "--b", "verify=tree,width=4,drafter=lookup", "--prompts", "2",
                 "--max-tokens", "8", "--blocks", "2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert len(res["per_prompt"]) == 2 and all(len(p["blocks"]) == 2 for p in res["per_prompt"])
    assert [b["order"] for b in res["per_prompt"][0]["blocks"]] == ["ABBA", "BAAB"]
    # the output once a prompt (every sample was checked equal to it), not once a sample
    assert len(res["per_prompt"][0]["tokens"]) == 8
    assert "tokens" not in res["per_prompt"][0]["blocks"][0]["samples"]["A"][0]
    assert res["revision"] and res["model"]["files"]
    assert "sha256" in capsys.readouterr().out


def test_ab_names_its_arms_and_every_ratios_direction(ckpt, tmp_path, capsys):
    out = tmp_path / "ab.json"
    assert main(["bench", "ab", "--model", str(ckpt), "--a", "verify=off",
                 "--b", "verify=chain,drafter=lookup", "--prompts", "2", "--max-tokens", "6",
                 "--blocks", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    s = json.loads(out.read_text())["summary"]
    assert "A = verify=off\nB = verify=chain,drafter=lookup\n" in printed
    assert printed.count("B/A first-token time") == 1  # one summary table
    for what, r, up, down in [("tokens/s", s["geomean_tok_s_ratio"], "faster", "slower"),
                              ("decode tokens/s", s["geomean_decode_tok_s_ratio"], "faster", "slower"),
                              ("time to first token", s["geomean_ttft_ratio"], "later", "sooner")]:
        assert f"B/A {what} x{r:.3f}: B {up if r > 1 else down}" in printed


def test_ratio_text_spells_out_the_direction():
    assert ratio_text("tokens/s", 1.12) == "B/A tokens/s x1.120: B faster"
    assert ratio_text("tokens/s", 0.9) == "B/A tokens/s x0.900: B slower"
    assert ratio_text("time to first token", 1.1, time=True).endswith("B later")
    assert ratio_text("time to first token", 0.8, time=True).endswith("B sooner")
    assert ratio_text("tokens/s", 1.0).endswith("the same")


def test_ab_across_processes_keeps_every_process(ckpt, tmp_path, capsys):
    out = tmp_path / "abp.json"
    assert main(["bench", "ab", "--model", str(ckpt), "--a", "verify=off",
                 "--b", "verify=chain,drafter=lookup", "--prompts", "1", "--max-tokens", "6",
                 "--blocks", "1", "--processes", "2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert len(res["processes"]) == 2
    dec = [r["summary"]["geomean_decode_tok_s_ratio"] for r in res["processes"]]
    assert res["summary"]["decode_ratio_range"] == [min(dec), max(dec)]
    assert len(res["summary"]["arm_a_decode_tok_s"]) == 2
    assert all(r["revision"] and len(r["per_prompt"]) == 1 for r in res["processes"])
    # each child ran this command line: its arms and sizes
    assert all(r["arms"]["B"] == {"verify": "chain", "drafter": "lookup"} and r["max_tokens"] == 6
               and r["blocks"] == 1 for r in res["processes"])
    pp = res["summary"]["per_prompt"]
    ch = [r["per_prompt"][0]["decode_tok_s_change_median"] for r in res["processes"]]
    assert len(pp) == 1 and pp[0]["decode_change_range"] == [min(ch), max(ch)]
    printed = capsys.readouterr().out
    assert "process 2/2" in printed and "over 2 processes" in printed and "sha256" in printed
    assert pp[0]["id"] in printed


def test_ab_across_processes_reports_a_failing_process(ckpt, tmp_path, capsys):
    assert main(["bench", "ab", "--model", str(ckpt), "--a", "verify=sideways", "--prompts", "1",
                 "--max-tokens", "4", "--blocks", "1", "--processes", "2",
                 "--out", str(tmp_path / "x.json")]) == 1
    err = capsys.readouterr().err
    assert "sideways" in err and "process 1 of the A/B failed (exit 1)" in err
    assert not (tmp_path / "x.json").exists()
    assert main(["bench", "ab", "--model", str(ckpt), "--processes", "0"]) == 1
    assert "--processes must be at least 1, got 0" in capsys.readouterr().err


def test_ab_detects_different_outputs(ckpt):
    import sapwood
    m = sapwood.load(ckpt)
    prompts = [{"id": "x", "kind": "code", "text": "def f():"}]
    with pytest.raises(AssertionError, match="differs"):
        run_ab(m, {"temperature": 0.0}, {"temperature": 1.0, "seed": 3}, prompts, max_tokens=8,
               blocks=1, log=lambda *_: None)


def test_ab_arms_learn_their_own_policy(ckpt):
    """Each arm's requests run on a policy state of its own; the model's stays untouched."""
    import sapwood
    m = sapwood.load(ckpt)
    prompts = [{"id": "x", "kind": "code", "text": "def f(): return f() + f()"}]
    seen = []
    generate = m.generate

    def spy(*args, **kwargs):
        seen.append((kwargs.get("verify"), id(m._policies)))
        return generate(*args, **kwargs)
    m.generate = spy
    run_ab(m, {"verify": "chain", "drafter": "lookup"}, {"verify": "auto", "drafter": "lookup"},
           prompts, max_tokens=8, blocks=1, log=lambda *_: None)
    assert m._policies == {}  # the model's own: never used
    by_arm = {v: {s for a, s in seen if a == v} for v in ("chain", "auto")}
    assert len(by_arm["chain"]) == 1 and len(by_arm["auto"]) == 1
    assert by_arm["chain"] != by_arm["auto"]


def test_policy_arms_each_arm_its_own_policy_and_parameters(ckpt, tmp_path, capsys):
    states = bench_script("policy_arms").main([
        "chain:chain", 'never_wide:auto:{"ema_wide_below": 0}', "--blocks", "1",
        "--max-tokens", "6", "--model", str(ckpt)])
    out = capsys.readouterr().out
    assert "block 0: chain" in out and "never_wide: x" in out
    (chain,), (never,) = states["chain"].values(), states["never_wide"].values()
    assert chain is not never and never.params.ema_wide_below == 0
    assert chain.params.ema_wide_below == 6.5 and never.costs.t  # it served its requests
    assert list(states["chain"]) == ["lookup"]  # the tiny target's own drafter
    draft = tmp_path / "draft"
    make_tiny_checkpoint(draft, seed=2)
    states = bench_script("policy_arms").main([
        "chain:chain", "--blocks", "1", "--max-tokens", "6", "--model", str(ckpt),
        "--drafter", str(draft)])
    (key, pol), = states["chain"].items()
    assert key != "lookup" and pol.costs.t  # the named drafter served the requests


def test_accepted_by_width_uses_the_prefix_property():
    t = Tree(np.array([5, 1, 2, 3, 4]), np.array([-1, 0, 0, 1, 3]), np.array([0, 1, 1, 2, 3]),
             np.array([-1, 0, 1, 0, 0]), np.zeros(5))
    assert accepted_by_width(t, [0, 1, 3, 4], 5).tolist() == [0, 1, 1, 2, 3]


def test_width_command(ckpt, tmp_path):
    out = tmp_path / "w.json"
    assert main(["bench", "width", "--model", str(ckpt), "--depths", "8", "64",
                 "--max-width", "4", "--max-tokens", "6", "--drafter", "lookup", "--reps", "2",
                 "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [d["depth"] for d in res["depths"]] == [8, 64]
    assert all(len(d["fixed_tokens_per_s"]) == 4 for d in res["depths"])
    assert all(len(s) == 2 for d in res["depths"] for s in d["fixed_tokens_per_s_samples"])
    assert all(len(v) == 2 for v in res["first_request"].values())
    assert all(len(d["first_request_fixed_tokens_per_s"]) == 2 and d["fresh_fixed_ratio"] > 0
               for d in res["depths"])


def test_width_labels_depths_as_asked_and_honours_max_width(ckpt, tmp_path, capsys):
    """The tiny model drafting for itself accepts every row: before, the rule's chains reached
    9 nodes with --max-width 3, and depth 0 was reported as 1."""
    out = tmp_path / "w.json"
    assert main(["bench", "width", "--model", str(ckpt), "--depths", "0", "8",
                 "--max-width", "3", "--max-tokens", "12", "--drafter", str(ckpt), "--reps", "2",
                 "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [d["depth"] for d in res["depths"]] == [0, 8]
    assert [d["context_tokens"] for d in res["depths"]] == [1, 8]
    widths = [w for d in res["depths"] for w in d["rule_widths"]]
    assert widths and max(widths) >= 2 and all(1 <= w <= 3 for w in widths)
    printed = capsys.readouterr().out
    assert printed.count("depth (tokens)") == 1  # one summary table
    rows = printed.split("depth (tokens)")[1].splitlines()[1:3]
    assert [r.split()[0] for r in rows] == ["0", "8"]


@pytest.mark.parametrize("bad, named", [(["--max-width", "1"], "--max-width 1"),
                                        (["--max-width", "65"], "--max-width 65"),
                                        (["--depths", "8", "-1"], "--depths -1")])
def test_width_bad_values_are_named(ckpt, capsys, bad, named):
    assert main(["bench", "width", "--model", str(ckpt), *bad]) == 1
    assert named in capsys.readouterr().err


def test_peers_command_interleaves_and_reports_missing_peers(ckpt, tmp_path, capsys):
    out = tmp_path / "p.json"
    missing = tmp_path / "absent-q8_0.gguf"
    assert main(["bench", "peers", "--model", str(ckpt), "--weights", "f32", "--prompt-tokens", "12",
                 "--new-tokens", "4", "--reps", "2", "--gguf", str(missing), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert len(res["blocks"]) == 2 and res["blocks"][1]["order"] == res["blocks"][0]["order"][::-1]
    assert set(res["peers"]) == {"sapwood-f32", "transformers"}
    assert res["peers"]["sapwood-f32"]["sapwood-f32_over_this_decode_tok_s"]["median"] == 1.0
    assert res["not_run"]["llama.cpp-q8_0"].startswith("not run:")  # said, never skipped silently
    assert "not run" in capsys.readouterr().out


def test_kernel_microbenchmarks_smoke():
    """bench/test_bench_kernels.py at small sizes, each benchmark called once
    (--benchmark-disable) so that its checks of what it computed run; nothing is timed."""
    bench = Path(__file__).resolve().parent.parent / "bench" / "test_bench_kernels.py"
    r = subprocess.run([sys.executable, "-m", "pytest", str(bench), "-q", "-p", "no:cacheprovider",
                        "--benchmark-disable"], env=dict(os.environ, SAPWOOD_BENCH_SMOKE="1"),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout


def test_width_replay_records_and_replays_through_the_decoder(ckpt, tmp_path, capsys):
    """bench/replay_width.py: record a depth and a cohort prompt with a tiny draft model, then
    replay fixed widths, the chain and auto through the real decoder on the virtual clock
    (each replayed request asserts it emitted the recorded continuation)."""
    rw, draft = bench_script("replay_width"), tmp_path / "draft"
    make_tiny_checkpoint(draft, seed=2)
    rec, prompts = tmp_path / "rec.json", tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": [{"id": "mine", "text": "def f(x):"},
                                               {"id": "not taken", "text": "x"}]}))
    argv = sys.argv
    try:
        sys.argv = ["replay_width", "record", "--model", str(ckpt), "--drafter", str(draft),
                    "--depths", "8", "--cohort", "1", "--prompts", str(prompts), "--prompts-n", "1",
                    "--max-tokens", "6", "--reps", "1", "--out", str(rec)]
        rw.main()
        data = json.loads(rec.read_text())
        names = [c["name"] for c in data["contexts"]]
        assert names[0] == "depth 8" and names[2] == "mine" and len(names) == 3
        c = data["contexts"][0]
        assert len(c["lattices"]) == len(c["seq"]) and len(c["verify_s"]) == 16
        # every timing kept, the medians beside them; a replay charges each size the policy's
        # quantile of them, no size above a larger one
        assert [len(v) for v in c["verify_all_s"]] == [1] * 16 and len(c["draft_all_s"]) == 8
        assert c["verify_s"] == [v[0] for v in c["verify_all_s"]]
        charged = rw.charged(c, "verify")
        assert charged == [min(v[0] for v in c["verify_all_s"][i:]) for i in range(16)]
        sys.argv = ["replay_width", "replay", str(rec), "--requests", "2", "--widths", "1-3"]
        rw.main()
    finally:
        sys.argv = argv
    out = capsys.readouterr().out
    assert "best of the others" in out and "geometric means over 3 contexts" in out
    assert "a reloaded state's first" in out
    assert rw.G.time is __import__("time")  # the decoder's clock is restored
    # verify costs scattered by a noise sample (bench/verify_noise.py): deterministic too
    noise = tmp_path / "noise.json"
    vn = bench_script("verify_noise")
    try:
        sys.argv = ["verify_noise", "--model", str(ckpt), "--depth", "8", "--widths", "1", "2",
                    "--reps", "3", "--out", str(noise)]
        vn.main()
    finally:
        sys.argv = argv
    ratios = json.loads(noise.read_text())["ratios"]
    assert len(ratios) == 6 and all(r > 0 for r in ratios) and 1.0 in ratios  # each width's median
    try:  # or from a recording's timings: each over its charged cost, never below it
        sys.argv = ["verify_noise", "--recording", str(rec), "--out", str(tmp_path / "n2.json")]
        vn.main()
    finally:
        sys.argv = argv
    from_rec = json.loads((tmp_path / "n2.json").read_text())["ratios"]
    assert len(from_rec) == 3 * 16 and min(from_rec) == 1.0
    def replayed(noise_file):
        return rw.replay(SimpleNamespace(rec=str(rec), requests=2, max_tokens=6, widths="1-2",
                                         python_ms=0.2, one_rule=False, shared=False, trace=None,
                                         noise=noise_file, seed=0))
    noisy = [replayed(str(noise)) for _ in range(2)]
    assert noisy[0] == noisy[1]
    # and the scatter reaches the costs: the medians alone replay differently
    assert replayed(None) != noisy[0]
    # bench/replay_suite.py's summary of a recording, deterministic on the virtual clock
    suite = bench_script("replay_suite")
    lines = [suite.run("tiny", [str(rec)], dict(requests=2, widths="1-2", python_ms=0.2))
             for _ in range(2)]
    assert lines[0] == lines[1] and "auto / best other arm, warm x" in lines[0]
    assert "over 3 contexts" in lines[0]
    # its table: a row per depth context (the prompt apart), each figure per seed merged into
    # median [min, max]
    rows = [[], []]
    for seed in (0, 1):
        suite.run("tiny", [str(rec)], dict(requests=2, widths="1-2", python_ms=0.2),
                  table=rows[seed], seed=seed)
    assert [r.split("|")[2].strip() for r in rows[0]][:1] == ["depth 8"] and len(rows[0]) == 2
    merged = suite.merge_rows([rows[0][0], rows[1][0]])
    warm = sorted(float(r.split("|")[3]) for r in (rows[0][0], rows[1][0]))
    assert f"[{warm[0]:.3f}, {warm[1]:.3f}]" in merged.split("|")[3]


def test_first_request_command_pairs_a_fresh_rule_with_a_fixed_width(ckpt, tmp_path, capsys):
    """bench/first_request.py runs its pairs and prints the paired ratio."""
    fr, draft = bench_script("first_request"), tmp_path / "draft"
    make_tiny_checkpoint(draft, seed=2)
    argv = sys.argv
    try:
        sys.argv = ["first_request", "--model", str(ckpt), "--drafter", str(draft), "--depth", "8",
                    "--width", "3", "--pairs", "2", "--max-tokens", "6"]
        fr.main()
    finally:
        sys.argv = argv
    assert "depth 8: first request / fixed w3: median x" in capsys.readouterr().out


def test_ab_builds_in_process_on_one_core(ckpt, tmp_path, capsys):
    """bench/ab_builds.py --in-process --share-core: two copies of the Python package on one
    _core (here the one this process loaded), ABBA in one process."""
    import shutil

    import sapwood

    src = Path(sapwood.__file__).parent
    for d in ("old", "new"):
        shutil.copytree(src, tmp_path / d / "sapwood",
                        ignore=shutil.ignore_patterns("data", "__pycache__", "_core*"))
    draft = tmp_path / "draft"
    make_tiny_checkpoint(draft, seed=2)
    try:
        bench_script("ab_builds").main([
            str(tmp_path / "old"), str(tmp_path / "new"), "--in-process", "--share-core",
            "--model", str(ckpt), "--drafter", str(draft), "--modes", "off,chain",
            "--max-tokens", "4", "--blocks", "1"])
        assert sys.modules["sapwood_old._core"] is sys.modules["sapwood_new._core"]
    finally:
        for k in [k for k in sys.modules if k.startswith(("sapwood_old", "sapwood_new"))]:
            del sys.modules[k]
    out = capsys.readouterr().out
    assert "off: new/old decode geomean x" in out and "chain: new/old decode geomean x" in out


def test_int8_peak_measures_every_variant():
    """_core.int8_peak, the compute roof of bench/engine_table.py: a positive finite rate for
    every kernel variant here; bad arguments are refused by name."""
    from sapwood import _core
    old = _core.isa()
    try:
        for isa in _core.available_isas():
            _core.set_isa(isa)
            rate = _core.int8_peak(1, 0.01, 1)
            assert 1e6 < rate < 1e15, (isa, rate)
    finally:
        _core.set_isa(old)
    with pytest.raises(ValueError, match="seconds=0"):
        _core.int8_peak(1, 0.0, 1)
    with pytest.raises(ValueError, match="repeats=0"):
        _core.int8_peak(1, 0.01, 0)


def test_engine_table_smoke(tmp_path, capsys):
    """bench/engine_table.py end to end at a toy shape: every section, every variant given,
    every block kept in the JSON; llama.cpp said to be not run, never skipped silently."""
    from sapwood import _core
    isas = _core.available_isas()[-2:]
    out = tmp_path / "t.json"
    bench_script("engine_table").main([
        "--smoke", "--isa", *isas, "--contexts", "8", "64", "--attention-contexts", "64",
        "--reps", "2", "--prefill", "32", "--prefill-reps", "1", "--load-reps", "1",
        "--load-tokens", "2", "--json", str(out)])
    res = json.loads(out.read_text())
    assert res["isas"] == isas and [f["weights"] for f in res["formats"]] == ["q8", "q4"]
    for f in res["formats"]:
        assert [s["ctx"] for s in f["steps"]] == [8, 64]
        for s in f["steps"]:
            assert s["read_GBps"]["n"] == 2
            for isa in isas:
                c = s["isa"][isa]
                assert c["verify1_ms"]["n"] == 2 and c["verify16_of_roof"]["median"] > 0
                assert c["verify1_over_verify2"]["min"] <= c["verify1_over_verify2"]["max"]
        assert set(f["prefill_tok_s"]) == set(isas)
        assert all(f["load"][i]["loaded_tok_s"]["n"] == 2 for i in isas)  # Q L L Q: two loaded
    assert res["attention"]["64"]["isa"][isas[0]]["rows16_ms"]["n"] == 2
    assert all(res["int8_peak_GMACps"][i]["max"] > 0 for i in isas)
    assert res["llama"].startswith("not run")
    printed = capsys.readouterr().out
    for label in ("decode step ms @64", "verify(1) / verify(2) @8", "roof / verify(16)",
                  "16 rows ms @64", "prefill 32 tok/s", "loaded / quiet", "llama.cpp: not run"):
        assert label in printed, label
    with pytest.raises(SystemExit):
        bench_script("engine_table").main(["--smoke", "--isa", "sideways"])
    assert "--isa sideways: not available here" in capsys.readouterr().err


def test_ab_cores_alternates_two_builds(capsys):
    """bench/ab_cores.py as an A/A on this process's _core (one file: one module): every arm
    under both names, two samples a block, outputs compared."""
    from sapwood import _core
    bench_script("ab_cores").main([_core.__file__, _core.__file__, "--smoke", "--rows", "1", "3",
                                   "--blocks", "2", "--threads", "1", "--fastest"])
    out = capsys.readouterr().out
    assert "toy 48x64 rows 1: old" in out and "toy 48x64 rows 3: old" in out
    assert out.count("over 2 blocks") == 2


def test_ab_cores_attention_arm(capsys):
    """--attention: tree attention of each row count under both builds, with their largest
    output difference (0 for an A/A)."""
    from sapwood import _core
    bench_script("ab_cores").main([_core.__file__, _core.__file__, "--attention", "64",
                                   "--rows", "1", "3", "--blocks", "2", "--threads", "1"])
    out = capsys.readouterr().out
    assert "attention ctx 64 rows 1: max |old - new| 0" in out
    assert "attention ctx 64 rows 3: old" in out and out.count("over 2 blocks") == 2
