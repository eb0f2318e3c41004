"""The GPU kernel sources against what they may use: metal/*.metal stay in the MSL subset that
metal/README.md documents and emu/metal_shim.hpp implements, sycl/*.hpp in the SYCL subset of
sycl/README.md and emu/sycl_emu.hpp, and the real SYCL device's source type-checks against the
real SYCL headers (no SYCL compiler in CI: the one check it gets before a device runs it)."""
from __future__ import annotations

import os
import re
import subprocess
import sysconfig
from pathlib import Path

import pytest

from gpu_util import EMU, METAL, ROOT, SYCL

CXX = os.environ.get("CXX", "g++")


def _readme_lists(path):
    """{key: names} from README lines '- **Key**: `name`, `name(n)`, ...' (continuation lines too)."""
    out, key = {}, None
    for line in path.read_text().splitlines():
        m = re.match(r"- \*\*(\w+)\*\*:(.*)", line)
        if m:
            key, line = m.group(1), m.group(2)
        elif not line.startswith("  "):
            key = None
        if key:
            out.setdefault(key, set()).update(re.findall(r"`([\w:]+)", line))
    return out


def _code(text):
    return re.sub(r"//.*", "", text)


def test_metal_sources_stay_in_documented_subset():
    """Every attribute and library call in the shaders is in metal/README.md's subset, and every
    listed function and type exists in the shim (so the shim covers exactly the documented set)."""
    lists = _readme_lists(METAL / "README.md")
    shim = (EMU / "metal_shim.hpp").read_text()
    for p in sorted(METAL.glob("*.metal")):
        text = _code(p.read_text())
        attrs = set(re.findall(r"\[\[\s*(\w+)", text)) | ({"threadgroup"} if "SW_THREADGROUP_ARG" in text else set())
        assert attrs <= lists["Attributes"], attrs - lists["Attributes"]
        own = set(re.findall(r"\b(?:inline|kernel)\s+[\w:<>]+\s+(\w+)\s*\(", text))
        calls = set(re.findall(r"(?<![.\w])([A-Za-z_]\w*)\s*\(", re.sub(r"\[\[.*?\]\]", "", text)))
        calls -= own | lists["Types"] | {"if", "for", "while", "return", "sizeof", "int", "float", "bool",
                                         "size_t", "SW_THREADGROUP_ARG"}
        assert calls <= lists["Functions"], (p.name, calls - lists["Functions"])
        assert set(re.findall(r"(\w+)::", text)) <= {"mem_flags"}, "namespace-qualified MSL (fast::, precise::)"
    for name in lists["Functions"] | lists["Types"] - {"char"}:
        assert re.search(rf"\b{name}\b", shim), f"{name} is documented but not in the shim"


def test_sycl_sources_stay_in_documented_subset():
    lists = _readme_lists(SYCL / "README.md")
    emu = (EMU / "sycl_emu.hpp").read_text()
    for p in sorted(SYCL.glob("*.hpp")):
        text = _code(p.read_text())
        assert set(re.findall(r"\bit\.(\w+)", text.split("#else")[0] if "SW_SYCL_EMU" in text else text)) <= lists["Item"]
        if p.name != "sw_sycl_common.hpp":
            assert "sycl::" not in text, f"{p.name}: kernels reach SYCL through swsycl:: only"
    for name in lists["Item"] | {n for n in lists["Traits"] if not n.startswith("sycl")}:
        assert re.search(rf"\b{name}\b", emu), f"{name} is documented but not emulated"


def _sycl_include():
    for cand in (os.environ.get("SAPWOOD_SYCL_INCLUDE"), Path(sysconfig.get_paths()["data"]) / "include"):
        if cand and (Path(cand) / "sycl" / "sycl.hpp").exists():
            return Path(cand)
    return None


@pytest.mark.skipif(_sycl_include() is None,
                    reason="SYCL headers not found: pip install --no-deps intel-sycl-rt==2026.2.0 (or set SAPWOOD_SYCL_INCLUDE)")
def test_sycl_device_type_checks_against_real_headers():
    """g++ -fsyntax-only of sycl/sycl_device.cpp, whose op table instantiates every kernel
    template with the real sycl::nd_item<1> inside parallel_for: the kernels and the queue code
    are valid SYCL 2020 as written."""
    cmd = [CXX, "-std=c++17", "-fsyntax-only", "-Wall", "-Werror", "-Wno-attributes",
           "-Wno-deprecated-declarations", "-DSYCL_DISABLE_FSYCL_SYCLHPP_WARNING",
           f"-isystem{_sycl_include()}", f"-I{SYCL}", f"-I{METAL}", f"-I{ROOT / 'csrc'}",
           str(SYCL / "sycl_device.cpp")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
