"""Builds the test-only shared libraries (fake and emulated libibverbs) with the C++ compiler.

They are test infrastructure: compiled here, on first use, into a cache directory
(``build/testlibs`` of the checkout), never by the package
build and never installed. A library is rebuilt when its sources or flags change (the
file name carries a hash of both), so concurrent test runs never load a half-written file.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NATIVE_INCLUDE = os.path.join(ROOT, "native", "src")
INCLUDE_DIRS = (NATIVE_INCLUDE, HERE)  # verbs_api.h; verbs_names.h
FLAGS = ["-std=c++17", "-O2", "-shared", "-fPIC", "-Wall", "-Wextra", "-pthread"]


def cache_dir() -> str:
    return os.path.join(ROOT, "build", "testlibs")


def _headers(include_dirs) -> list[str]:
    out = []
    for d in include_dirs:
        out += sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".h"))
    return out


def build(name: str, sources: list[str], *, include_dirs: tuple[str, ...] = INCLUDE_DIRS,
          libs: tuple[str, ...] = ()) -> str:
    """Compile ``sources`` into ``lib<name>-<hash>.so``; return its path."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise RuntimeError("no C++ compiler (g++) to build the test library " + name)
    h = hashlib.sha256(" ".join(FLAGS + list(libs)).encode())
    for path in list(sources) + _headers(list(include_dirs) + [os.path.dirname(s) for s in sources]):
        with open(path, "rb") as f:
            h.update(path.encode() + b"\0" + f.read())
    out_dir = cache_dir()
    os.makedirs(out_dir, exist_ok=True)
    target = os.path.join(out_dir, f"lib{name}-{h.hexdigest()[:16]}.so")
    if os.path.exists(target):
        return target
    fd, tmp = tempfile.mkstemp(prefix=f".lib{name}-", suffix=".so", dir=out_dir)
    os.close(fd)
    cmd = [cxx, *FLAGS, *(f"-I{d}" for d in include_dirs), "-o", tmp, *sources, *libs]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        os.unlink(tmp)
        raise RuntimeError(f"building {name} failed:\n{' '.join(cmd)}\n{r.stderr[-6000:]}")
    os.replace(tmp, target)  # atomic: a concurrent build of the same hash is equally good
    return target
