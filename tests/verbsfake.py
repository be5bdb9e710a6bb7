"""The recording fake libibverbs (tests/verbsfake/verbs_fake.cpp), driven from Python.

:func:`install` builds the library (tests/testlibs.py), points ``SPARKCCL_IBVERBS_LIB`` at it
so the verbs transport of this process loads it instead of libibverbs, and resets the fake
fabric to ``devices``; :func:`uninstall` restores the variable. The other functions are the
harness: the call log, injected completion errors and async events, failing calls, pause
and PCIe-reorder modes, QP states.
"""
from __future__ import annotations

import ctypes
import json
import os

import testlibs

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "verbsfake", "verbs_fake.cpp")
ENV = "SPARKCCL_IBVERBS_LIB"

_lib = None
_saved_env: list = []


def library_path() -> str:
    return testlibs.build("sparkccl_verbsfake", [SOURCE])


def _load():
    global _lib
    if _lib is None:
        lib = ctypes.CDLL(library_path())
        lib.fakeverbs_add_device.argtypes = [ctypes.c_char_p] + [ctypes.c_int] * 6 + [
            ctypes.c_char_p, ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        lib.fakeverbs_inject.argtypes = [ctypes.c_uint32, ctypes.c_int, ctypes.c_uint32,
                                         ctypes.c_uint64]
        lib.fakeverbs_async.argtypes = [ctypes.c_uint32, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.fakeverbs_pause.argtypes = [ctypes.c_int]
        lib.fakeverbs_reorder.argtypes = [ctypes.c_double]
        lib.fakeverbs_fail_next.argtypes = [ctypes.c_char_p, ctypes.c_int]
        lib.fakeverbs_cq_overflows.restype = ctypes.c_uint64
        lib.fakeverbs_gid.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p]
        lib.fakeverbs_log.argtypes = [ctypes.c_int]
        lib.fakeverbs_log.restype = ctypes.c_char_p
        lib.fakeverbs_qps.restype = ctypes.c_char_p
        _lib = lib
    return _lib


def install(devices: list[dict]) -> None:
    """Route this process's verbs calls to a fresh fake fabric with ``devices``: dicts with
    ``name`` and optionally port, state, active_mtu, link_layer, lid, max_inline, and gids
    (16 raw bytes each, or b"" for an unused slot)."""
    lib = _load()
    for d in devices:
        gids = list(d.get("gids", []))
        if any(len(g) not in (0, 16) for g in gids):
            raise ValueError("gids are 16 bytes (or empty)")
        blob = b"".join(g.ljust(16, b"\0") for g in gids)
        lens = (ctypes.c_int * max(1, len(gids)))(*[len(g) for g in gids])
        lib.fakeverbs_add_device(d["name"].encode(), d.get("port", 1), d.get("state", 4),
                                 d.get("active_mtu", 5), d.get("link_layer", 2), d.get("lid", 0),
                                 d.get("max_inline", 64), blob, lens, len(gids))
    lib.fakeverbs_install()
    if not _saved_env:
        _saved_env.append(os.environ.get(ENV))
    os.environ[ENV] = library_path()


def uninstall() -> None:
    if _lib is not None:
        _lib.fakeverbs_uninstall()
    if _saved_env:
        old = _saved_env.pop()
        if old is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old


_BOOLS = ("signaled", "inline", "open")


def _records(text: bytes) -> list[dict]:
    out = json.loads(text)
    for d in out:
        for k in _BOOLS:
            if k in d:
                d[k] = bool(d[k])
        if "dgid" in d:
            d["dgid"] = bytes.fromhex(d["dgid"])
    return out


def log(clear: bool = True) -> list[dict]:
    """Every recorded call since the last clearing (``kind`` and the fields of that kind)."""
    return _records(_load().fakeverbs_log(int(clear)))


def qps() -> list[dict]:
    return _records(_load().fakeverbs_qps())


def inject(qpn: int, status: int, vendor_err: int = 0, after: int = 0) -> bool:
    """The (after + 1)-th WR executed from now on QP ``qpn`` completes with ``status``."""
    return bool(_load().fakeverbs_inject(qpn, status, vendor_err, after))


def async_event(qpn: int = 0, ctx: int = 0, type: int = 0, port: int = 1) -> bool:
    """Queue an async event on QP ``qpn``, or (qpn 0) on context ``ctx`` (port events)."""
    return bool(_load().fakeverbs_async(qpn, ctx, type, port))


def pause(on: bool) -> None:
    _load().fakeverbs_pause(int(on))


def reorder(delay_s: float) -> None:
    _load().fakeverbs_reorder(delay_s)


def fail_next(call: str, err: int) -> None:
    _load().fakeverbs_fail_next(call.encode(), err)


def cq_overflows() -> int:
    return int(_load().fakeverbs_cq_overflows())


def gid(ctx: int, index: int) -> bytes:
    buf = ctypes.create_string_buffer(16)
    n = _load().fakeverbs_gid(ctx, index, buf)
    return buf.raw[:n]
