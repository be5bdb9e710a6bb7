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
@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "sm_121"])
def test_kernels_compile(arch, tmp_path, monkeypatch):
    monkeypatch.setenv("SPARKCCL_CACHE_DIR", str(tmp_path))
    cubin = nvrtc.compile_cubin(arch)
    assert cubin[:4] == b"\x7fELF"  # a cubin is an ELF file
    for name in nvrtc.KERNEL_NAMES:
        assert name.encode() in cubin, name
    # Cached on disk under the key; a second call reads it back.
    files = list(tmp_path.glob(f"kernels-{arch}-*.cubin"))
    assert len(files) == 1 and files[0].read_bytes() == cubin
    assert nvrtc.compile_cubin(arch) == cubin


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


def test_kernel_constants_match_layout_and_geometry():
    """kernels.cu carries copies of a few layout / geometry constants: keep them in sync."""
    from sparkccl import layout as L
    from sparkccl.plan import geometry as G
    src = nvrtc.source()
    defines = {m.group(1): int(m.group(2), 0)
               for m in re.finditer(r"^#define (\w+) (0x[0-9A-Fa-f]+|\d+)(?:ull)?\s*$", src, re.M)}
    for name in ("RING_ENTRIES", "RING_ENTRY_BYTES", "ENT_TAG", "ENT_SEQ", "ENT_SLICE", "ENT_LO",
                 "ENT_HI", "ENT_OP", "ENT_PIECE", "ENT_CHUNK", "ENT_GRANULE", "ABORT_TIMEOUT",
                 "ABORT_PEER"):
        assert defines[name] == getattr(L, name), name
    assert defines["PIECES"] == G.PIECES
    assert defines["ALIGN"] == G.ALIGN
    assert defines["FLAG_STRIDE"] == G.FLAG_STRIDE



def test_cuda_dataplane_imports_without_cuda_python():
    """CPU users must not need cuda-python: importing the module is free of it."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['cuda'] = None; sys.modules['cuda.core'] = None; "
            "import sparkccl, sparkccl.dataplane.cuda as c; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ})
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr
