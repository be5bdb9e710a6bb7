"""The GPU data-plane kernels compile with NVRTC for every architecture we ship for (no GPU
needed: CI runs this). Skipped, with the reason shown, only if cuda.core / NVRTC cannot be
imported; install the ``[cuda]`` (or ``[test]``) extra to run it."""
from __future__ import annotations

import os
import re

import pytest

from sparkccl.dataplane import nvrtc

try:
    nvrtc.import_cuda_core()
    NVRTC = nvrtc.nvrtc_version()
    WHY = ""
except nvrtc.CudaUnavailable as e:  # pragma: no cover - depends on the environment
    NVRTC, WHY = None, str(e)

needs_nvrtc = pytest.mark.skipif(NVRTC is None, reason=f"cuda.core / NVRTC unavailable: {WHY}")


@needs_nvrtc
def test_kernels_compile_for_gb10(tmp_path, monkeypatch):
    """GB10's sm_121 all the way to a cubin (ptxas included: it checks the inline PTX)."""
    monkeypatch.setenv("SPARKCCL_CACHE_DIR", str(tmp_path))
    cubin = nvrtc.compile_cubin("sm_121")
    assert cubin[:4] == b"\x7fELF"  # a cubin is an ELF file
    for name in nvrtc.KERNEL_NAMES:
        assert name.encode() in cubin, name
    # Cached on disk under the key; a second call reads it back.
    files = list(tmp_path.glob("kernels-sm_121-*.cubin"))
    assert len(files) == 1 and files[0].read_bytes() == cubin
    assert nvrtc.compile_cubin("sm_121") == cubin


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_kernels_pass_the_front_end_for_the_other_architectures(arch):
    """The other architectures we ship for, through NVRTC's front end with their
    __CUDA_ARCH__ (a cubin each took a minute on 2 cores; the inline PTX is the same text,
    checked by ptxas in the sm_121 compile above, and the H200 builds sm_90 at every GPU
    run)."""
    nvrtc.check_front_end(arch)


@needs_nvrtc
def test_front_end_check_reports_errors():
    src = ('template <class T> __device__ void f(T x) { x.nosuch(); }\n'
           'extern "C" __global__ void k(int a) { f(a); }\n')
    with pytest.raises(RuntimeError, match="(?s)front end rejected.*class type"):
        nvrtc.check_front_end("sm_90", src=src)


@needs_nvrtc
def test_ep_kernels_compile(tmp_path, monkeypatch):
    """The expert-parallel kernels (sparkccl/ep_kernels.cu: the finalize, the dispatch pack
    and unpack), one NVRTC text of their own: a cubin for sm_121, the front end for sm_90."""
    from sparkccl import ep_cuda
    monkeypatch.setenv("SPARKCCL_CACHE_DIR", str(tmp_path))
    cubin = ep_cuda.compile_cubin("sm_121")
    assert cubin[:4] == b"\x7fELF"
    for name in ep_cuda.KERNELS:
        assert name.encode() in cubin, name
    nvrtc.check_front_end("sm_90", src=ep_cuda.source())


@needs_nvrtc
def test_kernels_compile_with_the_timeline(monkeypatch):
    """SPARKCCL_GPU_TIMELINE's build (the step stamps compiled in) passes the front end and
    has its own cache key."""
    from sparkccl.dataplane import timeline
    monkeypatch.setenv("SPARKCCL_GPU_TIMELINE", "1")
    src = timeline.kernel_source(nvrtc.source())
    assert src.startswith(timeline.DEFINE)
    nvrtc.check_front_end("sm_90", src=src)
    assert nvrtc.cache_key("sm_90", src) != nvrtc.cache_key("sm_90")


def test_timeline_steps_of_each_kind_of_kernel():
    """timeline.steps picks the step table from the points a call stamped: the one shot's
    (a sum: released, summed), its LL way (no poller: no seen) and a GPU-direct gather /
    all-to-all (a poller, no sum); peers' steps from the latest peer."""
    from sparkccl.dataplane import timeline as T
    gather = [{7: {"enter": 100, "stored": 150, "written": 151, "handed": 153, "seen": 170,
                   "exit": 181}},
              {7: {"enter": 104, "stored": 149, "written": 152, "handed": 160, "seen": 172,
                   "exit": 180}}]
    got = {k: v for k, v in T.steps(gather).items() if v}
    assert set(got) == {name for name, _, _ in T.STEPS_GATHER} - {"launch gap"}
    assert got["publish"] == [50, 45] and got["flag to poller"] == [170 - 160, 172 - 153]
    assert got["poller to exit"] == [11, 8]
    one_shot = [{3: {"enter": 1, "stored": 2, "written": 3, "handed": 4, "seen": 5,
                     "released": 6, "summed": 8, "exit": 9}}] * 2
    assert {k for k, v in T.steps(one_shot).items() if v} == {
        name for name, _, _ in T.STEPS} - {"launch gap"}
    ll = [{3: {"enter": 1, "stored": 2, "released": 4, "summed": 5, "exit": 6, "handed": 3,
               "written": 2}}] * 2
    assert {k for k, v in T.steps(ll).items() if v} == {
        name for name, _, _ in T.STEPS_LL} - {"launch gap"}


@needs_nvrtc
def test_cache_key_depends_on_source_and_arch():
    k90 = nvrtc.cache_key("sm_90")
    assert k90 == nvrtc.cache_key("sm_90")
    assert k90 != nvrtc.cache_key("sm_121")
    assert k90 != nvrtc.cache_key("sm_90", nvrtc.source() + "\n// changed\n")


@needs_nvrtc
def test_compile_error_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARKCCL_CACHE_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="NVRTC failed"):
        nvrtc.compile_cubin("sm_90", src="this is not C++")


def test_arch_names():
    assert nvrtc.arch_of(90) == "sm_90"
    assert nvrtc.arch_of((12, 1)) == "sm_121"
    assert nvrtc.arch_of("sm_90a") == "sm_90"
    with pytest.raises(nvrtc.CudaUnavailable, match="8.0"):
        nvrtc.arch_of((7, 5))


def test_kernel_source_includes_every_file_once():
    """NVRTC compiles one text: kernels.cu with each quoted include (the role files, the
    shared protocol.h) inlined once, so the cache key changes with any of them."""
    src = nvrtc.source()
    files = nvrtc.source_files()
    names = {p.name for p in files}
    assert {"kernels.cu", "common.cuh", "publish.cu", "wait.cu", "reduce_scatter.cu",
            "direct.cu", "finalize.cu", "allreduce.cu", "protocol.h"} <= names
    for p in files:
        assert src.count(f'#line 1 "{p.name}"') == 1, p
    assert not re.search(r'^\s*#\s*include\s+"(?!sccl_emu\.h)', src, re.M)


def test_kernels_define_no_protocol_value_again():
    """The values shared with the host come from protocol.h only: no kernel file #defines
    one of its names."""
    from sparkccl import layout as L
    names = set(L.protocol_constants())
    for p in nvrtc.source_files():
        defined = set(re.findall(r"^\s*#\s*define\s+(\w+)", p.read_text(), re.M))
        assert not defined & names, (p.name, defined & names)


def test_python_constants_equal_the_compiled_header():
    """sparkccl.layout reads protocol.h's text; the native module compiled the same header:
    both give every constant the same value (and geometry / the CUDA plane use them)."""
    import sparkccl._native as N
    from sparkccl import layout as L
    from sparkccl.dataplane import cuda as C
    from sparkccl.plan import geometry as G
    assert N.protocol() == L.protocol_constants()
    assert (G.PIECES, G.ALIGN, G.FLAG_STRIDE) == (N.protocol()["PIECES"], N.protocol()["ALIGN"],
                                                 N.protocol()["FLAG_STRIDE"])
    from sparkccl.dataplane import direct_tables as D
    from sparkccl.dataplane import monitor as M
    from sparkccl.dataplane import ce_engine as E
    from sparkccl.dataplane import engines as EN
    for name in ("COUNTER_SETS", "FIN_SET"):
        assert getattr(C, name) == N.protocol()[name], name
    assert EN.ONE_HANDOFF_SLICE == N.protocol()["ONE_HANDOFF_SLICE"]
    assert E.PROG_STRIDE == N.protocol()["PROG_STRIDE"]
    for name in ("NO_WORD", "NO_SOURCE"):  # (the failure record's: monitor.py reads it)
        assert getattr(M, name) == N.protocol()[name], name
    assert D.MAX_DIRECT == N.protocol()["MAX_DIRECT"]


def test_protocol_reader_refuses_what_it_cannot_read(tmp_path, monkeypatch):
    from sparkccl import layout as L
    bad = tmp_path / "protocol.h"
    bad.write_text("constexpr int A = 1;\nconstexpr int B = foo(A);\n")
    monkeypatch.setattr(L, "PROTOCOL_H", bad)
    L.protocol_constants.cache_clear()
    try:
        with pytest.raises(ValueError, match="cannot read B"):
            L.protocol_constants()
    finally:
        monkeypatch.undo()
        L.protocol_constants.cache_clear()
    assert L.protocol_constants()["PIECES"] == 8


def test_cuda_dataplane_imports_without_cuda_python():
    """CPU users must not need cuda-python: importing the module is free of it."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['cuda'] = None; sys.modules['cuda.core'] = None; "
            "import sparkccl, sparkccl.dataplane.cuda as c; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ})
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_every_launched_kernel_is_loaded_and_emulated():
    """Each kernel name the CUDA data plane launches is in KERNEL_NAMES (loaded by name from
    the cubin) and has a case in the CPU emulation (tests/cuda_emu/emu.cpp)."""
    import re
    from pathlib import Path
    pkg = Path(nvrtc.__file__).parent
    src = "".join((pkg / f).read_text() for f in ("cuda.py", "engines.py", "ce_engine.py",
                                                   "allreduce_engine.py"))
    launched = set(re.findall(r'"(sccl_[a-z0-9_]+)"', src))
    assert "sccl_advance" in launched and "sccl_publish" in launched
    assert launched <= set(nvrtc.KERNEL_NAMES), launched - set(nvrtc.KERNEL_NAMES)
    emu = (Path(__file__).parent / "cuda_emu" / "emu.cpp").read_text()
    missing = [n for n in nvrtc.KERNEL_NAMES if n not in emu]
    assert not missing, missing


def test_protocol_header_keeps_nvrtc_13_0_builtins_out():
    """NVRTC 13.0 (torch cu130's, the GPU machine's) has no ``__builtin_offsetof``: the
    header's offset checks go through SCCL_OFFSET_IS, which NVRTC compiles as ``true``
    (its first use outside the macro failed every kernel compile there; this machine's NVRTC
    13.5 accepted it)."""
    text = (nvrtc.INCLUDE_DIRS[1] / "sparkccl" / "protocol.h").read_text()
    uses = [ln for ln in text.splitlines() if "__builtin_offsetof" in ln
            and not ln.startswith(("#define SCCL_OFFSET_IS", "//"))]
    assert uses == [], uses
