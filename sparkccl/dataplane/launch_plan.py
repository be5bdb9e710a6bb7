"""Launch plans: the eager fast path of the CUDA data plane (issue: host time per call).

A collective's kernels and their parameters depend on its shape (operation, bytes, strides,
dtype, engine, grid caps), on the data plane's tables, and on the caller's pointers; since
the sequence number, the slots and the ring indices live in device memory (docs/PROTOCOL.md
"Sequence state"), on nothing else. So the first call of a shape runs the planning code of
:mod:`.cuda` with the call's pointers marked (:class:`CallPtr`), and the launches it makes
are recorded; later calls of the same key replay the recording with their own pointers
patched in, in one native call (``_native.LaunchPlan.issue``: the launches, then the
completion event), with no Python planning.

What may be recorded is decided by the planning code: only kernel launches whose parameters
are constants or call pointers (the "fused" GPU-direct engine, the proxy path's kernel and
the finalize's). A kernel whose one parameter is a protocol.h ``kargs`` struct (the proxy
path's and the finalize's) is recorded as that struct's words (``by_value``), so a call
pointer's patch is the field's byte offset in the parameter buffer. Mode "ce" keeps its own kind of plan: its program (ce_engine.CeProgram),
whose values are constants, call pointers and terms of seq (:class:`Slotted` marks an
address in slot ``seq % n``), stored here by ``plannable(plan=...)`` and issued with the
call's seq, ring index, stream and pointers. Mode "split"'s stream joins and zero-copy
results are never planned.

A plan is stale when what its constants came from changes: the key is the collective's
shape, and the data plane drops every plan (``invalidate``, which bumps ``generation``) when
a setting its planning reads, its tables or its buffers change (a new value of a
``PlanSetting``, peer mappings, attach_rs, an outgrown scratch buffer, the first capture).
"""
from __future__ import annotations

import operator
from contextlib import contextmanager
from dataclasses import dataclass

from ..plan.geometry import PIECES

U64 = (1 << 64) - 1
MAX_ARGS = 6  # call pointers per plan (native/src/cuda_ops.cpp LaunchPlan::ARGS)


class CallPtr(int):
    """A launch parameter that is call argument ``arg`` (a pointer of the call) plus
    ``add``. Adding an int keeps the mark, so offsets computed from a call pointer are
    recorded as patches too."""

    def __new__(cls, value: int, arg: int, add: int = 0):
        p = super().__new__(cls, value)
        p.arg, p.add = arg, add
        return p

    def __add__(self, other):
        if type(other) is not int:
            return int(self) + int(other)  # (two call pointers added make no pointer)
        return CallPtr(int(self) + other, self.arg, self.add + other)

    __radd__ = __add__


class Slotted(int):
    """A host-side address in slot ``seq % mod`` of a region of ``mod`` slots ``stride``
    bytes apart: ``base + (seq % mod) * stride``, plus what is added to it later (``add``,
    kept as with CallPtr), so that a mode "ce" program takes it as a term of seq
    (ce_engine._sym) instead of one call's value."""

    def __new__(cls, base: int, mod: int, stride: int, seq: int, add: int = 0):
        p = super().__new__(cls, base + (seq % mod) * stride + add)
        p.base, p.mod, p.stride, p.seq, p.add = base, mod, stride, seq, add
        return p

    def __add__(self, other):
        if isinstance(other, (CallPtr, Slotted)):
            return int(self) + int(other)  # (no longer one slot's address)
        return Slotted(self.base, self.mod, self.stride, self.seq, self.add + operator.index(other))

    __radd__ = __add__


def plain(args) -> tuple:
    """Launch parameters without the marks (what the kernel launch takes)."""
    return tuple(int(a) if type(a) is CallPtr else a for a in args)


@dataclass(frozen=True)
class Recording:
    """The launches of one call: rows (kernel name, grid, block, parameter words as ints,
    by_value) and patches (launch, byte offset in its parameter words, call argument, addend
    mod 2**64). ``by_value``: the words are the bytes of the kernel's one parameter, a
    protocol.h ``kargs`` struct (a patch then sets the field at that offset); else each word
    is a parameter (offset 8 * its index)."""

    rows: tuple
    patches: tuple

    @staticmethod
    def of(launches: list) -> "Recording":
        rows, patches = [], []
        for i, (name, grid, block, args, by_value) in enumerate(launches):
            for j, a in enumerate(args):
                if type(a) is CallPtr:
                    if not 0 <= a.arg < MAX_ARGS:
                        raise ValueError(f"launch plan: call argument {a.arg} of {name}")
                    patches.append((i, 8 * j, a.arg, a.add & U64))
            rows.append((name, int(grid), int(block), tuple(int(a) for a in args), by_value))
        return Recording(tuple(rows), tuple(patches))

    def launches_for(self, args: tuple) -> list:
        """(name, grid, block, parameter words) with ``args`` patched in (the CPU
        emulation's replay, and tests)."""
        out = [list(row[3]) for row in self.rows]
        for i, at, arg, add in self.patches:
            out[i][at // 8] = (args[arg] + add) & U64
        return [(row[0], row[1], row[2], out[i]) for i, row in enumerate(self.rows)]


class PlanCache:
    """Plans by key, with the counts a benchmark or test reads (``stats``). ``limit`` bounds
    the shapes kept: when full, every plan is dropped (shapes of a serving engine are few)."""

    def __init__(self, limit: int = 128):
        self.limit = limit
        self.plans: dict = {}
        self.generation = 0
        self.stats = {"hits": 0, "misses": 0, "invalidations": 0}
        self._recording: list | None = None
        self._entries: int | None = None  # ring entries of the collective being planned
        self._direct = False  # ... and whether it is a GPU-direct launch (direct_launches)
        self._ready = None  # ... or the plan its planning made itself (mode "ce")
        self._call = 0  # ... and its ring entries' call word (peer_check.py)

    def invalidate(self) -> None:
        """What the plans' constants came from changed: drop them all."""
        self.generation += 1
        if self.plans:
            self.plans.clear()
            self.stats["invalidations"] += 1

    def recording(self) -> bool:
        return self._recording is not None

    def record(self, name: str, grid: int, block: int, args: tuple,
               by_value: bool = False) -> None:
        """A launch of the call being planned (``by_value``: see :class:`Recording`)."""
        if self._recording is not None:
            self._recording.append((name, grid, block, args, by_value))

    def called(self, word: int) -> None:
        """The call word of the collective being planned (its peers' check compares it
        at every replay)."""
        self._call = word

    def plannable(self, entries: int = PIECES, direct: bool = False, plan=None) -> None:
        """Called by the planning code on a path whose launches may be replayed; entries:
        the publish-ring entries the collective takes (the host's account of the ring);
        direct: a GPU-direct engine's launch (the data plane counts those); plan: the plan
        to keep instead of the recorded launches (mode "ce"'s program)."""
        self._entries, self._direct, self._ready = entries, direct, plan

    @contextmanager
    def planning(self, key, make):
        """Record the launches of the block; if it declared itself plannable and ended
        without an exception, store ``(make(Recording), ring entries, direct, call word)``
        under ``key``.
        ``key`` None records nothing."""
        if key is None or self._recording is not None:
            yield
            return
        self.stats["misses"] += 1
        generation = self.generation
        self._recording, self._entries, self._ready = [], None, None
        try:
            yield
            launches, entries, direct, ready, call = (self._recording, self._entries,
                                                      self._direct, self._ready, self._call)
        finally:
            self._recording, self._entries, self._ready = None, None, None
        if entries is not None and (launches or ready is not None) \
                and generation == self.generation:
            # (a plan whose constants changed while it was made is not kept: e.g. a scratch
            # buffer outgrown by this very call)
            plan = ready if ready is not None else make(Recording.of(launches))
            if len(self.plans) >= self.limit:
                self.plans.clear()
            self.plans[key] = (plan, entries, direct, call)


class PlanSetting:
    """A setting of the CUDA data plane the launch plans are made from (a descriptor;
    benchmarks and tests change some): a new value drops the plans (the owner's ``plans``,
    a :class:`PlanCache`), so that a plan's key is the collective's shape alone and a call
    does not read every setting to build it."""

    def __set_name__(self, owner, name):
        self.name, self.slot = name, "_setting_" + name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        try:
            return obj.__dict__[self.slot]
        except KeyError:
            raise AttributeError(f"{type(obj).__name__!r} object has no attribute "
                                 f"{self.name!r}") from None

    def __set__(self, obj, value):
        d = obj.__dict__
        if self.slot in d and d[self.slot] == value:
            return
        d[self.slot] = value
        plans = d.get("plans")
        if plans is not None:
            plans.invalidate()
