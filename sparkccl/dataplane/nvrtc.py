"""Run-time compilation of the data-plane kernels with NVRTC (through ``cuda.core``), and an
on-disk cache of the results.

The kernels are split by role under ``kernels/`` (``kernels.cu`` includes the rest, and
``common.cuh`` includes ``sparkccl/include/sparkccl/protocol.h``, the layout shared with the
native layer): :func:`source` inlines every quoted include into one text, with ``#line``
marks so NVRTC's messages name the right file. NVRTC then needs no include path, and the
cache key, a hash of that text, changes when any included file does.

The cache key is (source hash, options, architecture, NVRTC version); entries live under
``$SPARKCCL_CACHE_DIR`` or ``~/.cache/sparkccl`` as ``kernels-<key>.cubin`` and are written
atomically (temp file + rename), so concurrent ranks compiling the same kernels at once is
harmless.

Nothing here touches a GPU: :func:`compile_cubin` works on machines without one (CI uses it
to prove the kernels build for sm_80, sm_90 and sm_121). ``cuda.core`` is imported lazily:
CPU users never need cuda-python.
"""
from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path

from .. import config
from ..errors import CudaUnavailable  # noqa: F401 - raised here, defined with the others
from .timeline import kernel_source

KERNELS_DIR = Path(__file__).with_name("kernels")
KERNELS_CU = KERNELS_DIR / "kernels.cu"
INCLUDE_DIRS = (KERNELS_DIR, Path(__file__).parents[1] / "include")
"""Where quoted includes are looked up (after the including file's own folder)."""
KERNEL_NAMES = ("sccl_publish", "sccl_ag_wait", "sccl_rs_wait_bf16", "sccl_rs_wait_f16",
                "sccl_rs_wait_f32", "sccl_piece_bounds", "sccl_finalize", "sccl_finalize_direct",
                "sccl_ag_direct", "sccl_rs_direct_bf16", "sccl_rs_direct_f16",
                "sccl_rs_direct_f32", "sccl_wait_piece", "sccl_rs_sum_unit_bf16",
                "sccl_rs_sum_unit_f16", "sccl_rs_sum_unit_f32", "sccl_poison", "sccl_advance",
                "sccl_fail_guard", "sccl_clock_probe", "sccl_ag_proxy", "sccl_rs_proxy_bf16",
                "sccl_rs_proxy_f16", "sccl_rs_proxy_f32", "sccl_allreduce_bf16",
                "sccl_allreduce_f16", "sccl_allreduce_f32", "sccl_ar_fused_bf16",
                "sccl_ar_fused_f16", "sccl_ar_fused_f32")
MIN_ARCH = 80
INSTALL_HINT = ("pip install 'sparkccl[cuda]' (or: pip install cuda-core cuda-bindings "
                "nvidia-cuda-nvrtc, matching your CUDA major version)")


def import_cuda_core():
    try:
        import cuda.core as cc
    except ImportError as e:
        try:  # cuda.core < 0.4 kept the API under cuda.core.experimental
            import cuda.core.experimental as cc  # type: ignore[no-redef]
        except ImportError:
            raise CudaUnavailable(f"the CUDA data plane needs cuda-python's cuda.core: {e}; "
                                  f"install it with {INSTALL_HINT}") from e
    return cc


def nvrtc_version() -> tuple[int, int]:
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        try:
            from cuda import nvrtc  # type: ignore[no-redef]  (cuda-python < 12.6)
        except ImportError as e:
            raise CudaUnavailable(f"cuda.bindings is missing: {e}; install it with "
                                  f"{INSTALL_HINT}") from e
    try:
        err, major, minor = nvrtc.nvrtcVersion()
    except Exception as e:  # the shared library could not be found / loaded
        raise CudaUnavailable(f"NVRTC could not be loaded: {e}; install it with "
                              f"{INSTALL_HINT}") from e
    if int(err) != 0:
        raise CudaUnavailable(f"nvrtcVersion failed with {err}")
    return int(major), int(minor)


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')
_PRAGMA_ONCE = re.compile(r"^\s*#\s*pragma\s+once\s*$")


def _expand(path: Path, seen: set, out: list) -> None:
    """Append ``path``'s lines to ``out`` with its quoted includes inlined once each (the
    files say ``#pragma once``); an include not found here (``sccl_emu.h``, only under
    ``SCCL_EMU``) stays as it is."""
    seen.add(path)
    out.append(f'#line 1 "{path.name}"')
    for n, line in enumerate(path.read_text().splitlines(), 1):
        m = _INCLUDE.match(line)
        if m:
            for d in (path.parent, *INCLUDE_DIRS):
                inc = (d / m.group(1)).resolve()
                if inc.is_file():
                    if inc not in seen:
                        _expand(inc, seen, out)
                        out.append(f'#line {n + 1} "{path.name}"')
                    else:
                        out.append("")
                    break
            else:
                out.append(line)
        elif _PRAGMA_ONCE.match(line):
            out.append("")
        else:
            out.append(line)


def source_files() -> list[Path]:
    """Every file the kernels' source is made of (sorted)."""
    seen: set = set()
    _expand(KERNELS_CU.resolve(), seen, [])
    return sorted(seen, key=lambda p: str(p))


def source(path: Path = KERNELS_CU) -> str:
    """The kernels of ``path`` (default: the data plane's) as the one text NVRTC compiles
    (every quoted include inlined once)."""
    out: list = []
    _expand(Path(path).resolve(), set(), out)
    return "\n".join(out) + "\n"


def cache_dir() -> Path:
    d = config.get("SPARKCCL_CACHE_DIR")
    return Path(d) if d else Path.home() / ".cache" / "sparkccl"


def arch_of(cc: int | str | tuple) -> str:
    """``90`` / ``"sm_90"`` / ``(9, 0)`` -> ``"sm_90"``; rejects anything below sm_80."""
    if isinstance(cc, tuple):
        n = cc[0] * 10 + cc[1]
    elif isinstance(cc, str):
        n = int(cc.lower().removeprefix("sm_").removeprefix("compute_").rstrip("af"))
    else:
        n = int(cc)
    if n < MIN_ARCH:
        raise CudaUnavailable(f"sparkccl's CUDA data plane needs compute capability 8.0 or "
                              f"newer (sm_80+), this GPU is sm_{n}")
    return f"sm_{n}"


def _options(arch: str, cc):
    return cc.ProgramOptions(arch=arch, std="c++17", name="sparkccl_kernels", ftz=False,
                             prec_div=True, prec_sqrt=True, fma=False, lineinfo=True)


def cache_key(arch: str, src: str | None = None) -> str:
    src = source() if src is None else src
    major, minor = nvrtc_version()
    h = hashlib.sha256()
    for part in (src, arch, f"nvrtc {major}.{minor}", "std=c++17 ftz=0 fma=0 lineinfo cubin v1"):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def compile_cubin(arch, *, use_cache: bool = True, src: str | None = None) -> bytes:
    """The kernels compiled for ``arch`` (e.g. ``"sm_90"``) as cubin bytes, from the cache
    when present. Raises :class:`CudaUnavailable` if cuda.core / NVRTC is missing and
    ``RuntimeError`` with NVRTC's log if compilation fails."""
    arch = arch_of(arch)
    cc = import_cuda_core()
    src = source() if src is None else src
    key = cache_key(arch, src)
    path = cache_dir() / f"kernels-{arch}-{key}.cubin"
    if use_cache:
        try:
            data = path.read_bytes()
            if data:
                return data
        except OSError:
            pass
    prog = cc.Program(src, code_type="c++", options=_options(arch, cc))
    try:
        obj = prog.compile("cubin")
    except Exception as e:
        raise RuntimeError(f"sparkccl: NVRTC failed to compile the data-plane kernels for {arch}: "
                           f"{e}") from e
    finally:
        try:
            prog.close()
        except Exception:
            pass
    data = bytes(obj.code)
    if use_cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".kernels-", suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only home is fine: compile again next time
    return data


def check_front_end(arch, src: str | None = None) -> None:
    """Run NVRTC's front end alone on ``src`` (default: the data-plane kernels) for ``arch``,
    with the options :func:`compile_cubin` uses: parsing, templates instantiated, the
    ``__CUDA_ARCH__`` branches of that architecture. No code generation (a fraction of a
    second, where a cubin takes a minute on 2 cores), so no ptxas: inline PTX is checked only
    by a real compile. Raises ``RuntimeError`` with NVRTC's log if the text does not compile.
    For the tests of the architectures we ship for but do not build a cubin for in CI."""
    arch = arch_of(arch)
    cc = import_cuda_core()
    from cuda.bindings import nvrtc as N
    src = source() if src is None else src
    opts = [o for o in _options(arch, cc).as_bytes("nvrtc") if not o.startswith(b"-arch")]
    opts += [f"-arch=compute_{arch[3:]}".encode(), b"-fdevice-syntax-only"]
    err, prog = N.nvrtcCreateProgram(src.encode(), b"sparkccl_kernels.cu", 0, [], [])
    if err != N.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"sparkccl: nvrtcCreateProgram failed with {err}")
    try:
        (err,) = N.nvrtcCompileProgram(prog, len(opts), opts)
        if err != N.nvrtcResult.NVRTC_SUCCESS:
            _, size = N.nvrtcGetProgramLogSize(prog)
            log = b" " * size
            N.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"sparkccl: NVRTC's front end rejected the kernels for {arch}:\n"
                               + log.decode(errors="replace"))
    finally:
        N.nvrtcDestroyProgram(prog)


def load_kernels(arch) -> dict:
    """{name: cuda.core Kernel} for the current device (call ``Device(i).set_current()``
    first)."""
    cc = import_cuda_core()
    data = compile_cubin(arch, src=kernel_source(source()))
    obj = cc.ObjectCode.from_cubin(data, name="sparkccl_kernels")
    return {n: obj.get_kernel(n) for n in KERNEL_NAMES}
