"""Mutants: one kernel source edited (a barrier or a simdgroup reduction deleted, a wrong tie rule
or formula, a thread or lane that leaves early), built into an emulated device of its own
(tests/mutant_device.py), on which a named oracle case of the device tests must then fail, with
wrong numbers or the emulator's report of the defect. So those cases can fail, and the emulator
really synchronises: a deleted barrier or collective changes results (threadgroup memory starts
as NaN) or is reported, with the thread or lane that skipped it.

This is the one place the kernels are built outside _core, which compiles them once from the
unedited sources; every mutant build takes g++ a while on the first run (cached in build/emu/).
"""
from __future__ import annotations

import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import mutant_device as md
import test_gpu_ops as ops_cases  # oracle cases taking a device (not collected from here)
import test_gpu_state as state_cases
from gpu_util import METAL, SYCL
from util import TREES

pytestmark = pytest.mark.skipif(not md.compiler_available(), reason=f"no {md.CXX}: mutants are built with it")

BARRIER = "threadgroup_barrier(mem_flags::mem_threadgroup);"


def delete(needle, n, repl=""):
    """The edit replacing the n-th occurrence of needle that is code (not in a // comment)."""
    def edit(text):
        i, seen = -1, -1
        while seen < n:
            i = text.index(needle, i + 1)
            seen += "//" not in text[text.rfind("\n", 0, i) + 1:i]
        return text[:i] + repl + text[i + len(needle):]
    return edit


def early_return(kernel, cond):
    """The edit making threads with `cond` return at the top of a Metal kernel."""
    def edit(text):
        i = text.index("\n{\n", text.index(f"kernel void {kernel}(")) + 3
        return text[:i] + f"  if ({cond}) return;\n" + text[i:]
    return edit


def replace(old, new):
    return lambda text: text.replace(old, new)


def rng():
    return np.random.default_rng(1234)


attention = lambda d: state_cases.attention_case(d, state_cases.SMALL, 100, TREES["random1"])  # 256 threads
kv_quantize = lambda d: state_cases.kv_quantize_case(d, rng())
gdn = lambda d: state_cases.gdn_case(d)

# name: (api, source, edit, oracle case, None or the emulator's report it must give)
MUTANTS = {
    "attn-barrier-tile-loaded": ("metal", "tree_attention.metal", delete(BARRIER, 0), attention, None),
    "attn-barrier-tile-consumed": ("metal", "tree_attention.metal", delete(BARRIER, 1), attention, None),
    "attn-simd_sum-score": ("metal", "tree_attention.metal", delete("simd_sum(", 0, "("), attention, None),
    # the tile's score max (the kernel's first simd_max is the query's int8 amax)
    "attn-simd_max-tile": ("metal", "tree_attention.metal", delete("simd_max(", 1, "("), attention, None),
    "kv-simd_max": ("metal", "kv_quant.metal", delete("simd_max(", 0, "("), kv_quantize, None),
    "gdn-barrier-recur": ("metal", "gdn.metal", delete(BARRIER, 2), gdn, None),
    "gdn-barrier-commit-replay": ("metal", "gdn.metal", delete(BARRIER, 5), gdn, None),
    "q8-barrier": ("metal", "q8_matmul.metal", delete(BARRIER, 0),
                   lambda d: ops_cases.test_int8_matmul_is_the_cpus(d, rng(), "q8", 5), None),
    # out aliasing x: without the barrier a simdgroup writes what another has yet to sum
    "rms_norm-barrier": ("metal", "rows.metal", delete("threadgroup_barrier(mem_flags::mem_device);", 0),
                         lambda d: ops_cases.test_rms_norm(d, rng(), 300), None),
    "logsumexp-barrier": ("metal", "rows.metal", delete(BARRIER, 4),
                          lambda d: ops_cases.test_logsumexp_rows(d, rng(), 300), None),
    # a group's lane sum missing a step
    "q4-simd_shuffle": ("metal", "q8_matmul.metal", replace("d += simd_shuffle_xor(d, ushort(1));", ""),
                        lambda d: ops_cases.test_int8_matmul_is_the_cpus(d, rng(), "q4", 5), None),
    # affine q4 groups (as stored): the bias term dropped, every lane's inputs taken from the
    # run's first group (right for groups of 64 only), an fma where the CPU rounds twice
    "q4-affine-bias-dropped": ("metal", "q8_matmul.metal",
                               replace("if (affine) acc[r] = fma(bi[s], float(sx + sx_o), acc[r]);", ""),
                               lambda d: ops_cases.test_affine_q4_matmul_is_the_cpus(d, rng(), 64, 320, 5), None),
    "q4-affine-g32-one-group-a-run": ("metal", "q8_matmul.metal", replace("const int in_lo = (4 * l / h) * p.group + 4 * l % h;", "const int in_lo = 4 * l % h;"),
                                      lambda d: ops_cases.test_affine_q4_matmul_is_the_cpus(d, rng(), 32, 320, 5), None),
    "embed-q4-affine-fma": ("metal", "elementwise.metal", replace("v = qs + bias[sg];", "v = fma(float(q), scale[sg], bias[sg]);"),
                            lambda d: ops_cases.test_affine_embed_rows_are_the_cpus(d, rng(), 64), None),
    "gdn_gates-plain-log": ("metal", "elementwise.metal", replace("log1p_of(exp(a))", "log(1.0f + exp(a))"),
                            lambda d: ops_cases.test_gdn_gates(d, rng()), None),
    "top_k-ties-upper": ("metal", "rows.metal", replace("(v == bv && i < bi)", "(v == bv && i > bi)"),
                         lambda d: ops_cases.test_top_k_rows(d, rng(), 300, 3), None),
    # a whole simdgroup, so that the first sync point it skips is a barrier, not a simd_max
    "attn-simdgroup-returns": ("metal", "tree_attention.metal", early_return("tree_attn_partial", "tid / 32 == 1"),
                               attention, r"partial barrier.*only 224 of 256 threads.*thread 32 returned"),
    "kv-lane-returns": ("metal", "kv_quant.metal", early_return("kv_quantize", "lane == 7"), kv_quantize,
                        r"partial simdgroup collective: simd_max.*31 of 32 lanes.*lane 7 returned"),
    "sycl-attn-barrier": ("sycl", "tree_attention.hpp", delete("barrier(it);", 0), attention, None),
    "sycl-rms_norm-barrier": ("sycl", "rows.hpp", delete("barrier(it);", 0),
                              lambda d: ops_cases.test_rms_norm(d, rng(), 300), None),
    "sycl-q4-sg_shuffle": ("sycl", "q8_matmul.hpp", replace("d += sg_shuffle_xor(it, d, 2);", ""),
                           lambda d: ops_cases.test_int8_matmul_is_the_cpus(d, rng(), "q4", 5), None),
    "sycl-q4-affine-bias-first": ("sycl", "q8_matmul.hpp",
                                  replace("acc[r] = fma(sc[2 * s], float(first ? d : d_o), acc[r]);\n        acc[r] = fma(bi[2 * s], float(first ? sx : sx_o), acc[r]);",
                                          "acc[r] = fma(bi[2 * s], float(first ? sx : sx_o), acc[r]);\n        acc[r] = fma(sc[2 * s], float(first ? d : d_o), acc[r]);"),
                                  lambda d: ops_cases.test_affine_q4_matmul_is_the_cpus(d, rng(), 32, 320, 16), None),
    "sycl-embed-q4-g32-nibble": ("sycl", "elementwise.hpp", replace("k % a.group < half", "j < kQ4Run / 2"),
                                 lambda d: ops_cases.test_affine_embed_rows_are_the_cpus(d, rng(), 32), None),
    "sycl-matmul-sg_sum": ("sycl", "matmul.hpp", replace("sg_sum(it, acc[r])", "acc[r]"),
                           lambda d: ops_cases.test_float_matmul(d, rng(), "f32", 5), None),
    "sycl-top_k-lane-returns": ("sycl", "rows.hpp", replace("  if (K <= 0) return;", "  if (K <= 0 || tid == 40) return;"),
                                lambda d: ops_cases.test_top_k_rows(d, rng(), 300, 3),
                                r"partial simdgroup collective.*lane 8 returned"),
}


@pytest.fixture(scope="module")
def devices(tmp_path_factory):
    """Every mutant's device and the two unedited ones, two compilers at a time. A SYCL mutant
    gets all of sycl/ beside its edited header (quoted includes search the including file's
    directory first)."""
    dirs = {}
    for name, (api, src, edit, _, _) in MUTANTS.items():
        d = dirs[name] = tmp_path_factory.mktemp(name)
        if api == "sycl":
            for p in SYCL.glob("*.hpp"):
                shutil.copy(p, d / p.name)
        text = ((METAL if api == "metal" else SYCL) / src).read_text()
        (d / src).write_text(edit(text))
        assert (d / src).read_text() != text, f"{name}: the edit changed nothing"
    jobs = {name: (MUTANTS[name][0], dirs[name]) for name in MUTANTS} | {"metal": ("metal", None), "sycl": ("sycl", None)}
    with ThreadPoolExecutor(2) as ex:
        return dict(zip(jobs, ex.map(lambda job: md.MutantDevice(*job), jobs.values())))


@pytest.mark.parametrize("api", ["metal", "sycl"])
def test_unedited_sources_pass_every_case(devices, api):
    """The harness on the unedited sources passes the cases, so a failure below is the edit's."""
    for name, (mapi, _, _, case, _) in MUTANTS.items():
        if mapi == api:
            case(devices[api])


@pytest.mark.parametrize("name", list(MUTANTS))
def test_mutant_is_caught(devices, name):
    *_, case, report = MUTANTS[name]
    with pytest.raises((AssertionError, md.EmuError)) as e:
        case(devices[name])
    if report:  # a thread gone before a sync point: the emulator's diagnosis, not a wrong number
        assert e.type is md.EmuError and re.search(report, str(e.value)), str(e.value)
