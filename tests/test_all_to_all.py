"""The all-to-all (equal blocks; the reduce-scatter's wire with a copy for a sum): every
block arrives byte for byte, on every topology and transport, against an independent
reference (block i of rank j's result is rank i's block j); the same with the CPU twin's
fill / arrived (the send blocks written range by range into the send slot, each source's
bytes told as they land)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import sparkccl
from sparkccl.localrun import check, run_ranks
from sparkccl.reference import all_to_all_reference as reference
from sparkccl.reference import bits, make_input

from helpers import posted_bytes

MiB = 1 << 20
# (rows per block, row shape, dtype): odd sizes, one byte, a block over a small slot
CASES = [(1, (), torch.uint8), (3, (5,), torch.bfloat16), (7, (129,), torch.float32),
         (2, (3,), torch.int64), (1, (16,), torch.uint8), (100, (257,), torch.bfloat16),
         (5, (3, 3), torch.float16), (0, (4,), torch.float32)]
BIG = [(512, (1025,), torch.float32)]  # 2 MiB a block: several collectives on a small slot


def a2a_checks(comm, seed: int, cases) -> list[str]:
    W, r, bad = comm.world_size, comm.rank, []
    x = torch.zeros(W * 2, 3)
    for wrong, kw in (("overlaps", {"out": x}), ("must be a multiple", {})):
        try:  # refused before anything is sent: the next calls still match on every rank
            comm.all_to_all(x if kw else x[:W * 2 - 1], **kw)
            bad.append(f"world {W}: all_to_all took bad input ({wrong})")
        except ValueError as e:
            if wrong not in str(e):
                bad.append(f"world {W}: {e}")
    for m, row, dtype in cases:
        seed += 1
        xs = [make_input(seed, i, (W * m, *row), dtype) for i in range(W)]
        for out in (None, torch.empty_like(xs[r])):
            y = comm.all_to_all(xs[r], out=out)
            assert y.shape == xs[r].shape and y.dtype == dtype and (out is None or y is out)
            if not (bits(y) == reference(xs, r)).all():
                bad.append(f"world {W} {comm.topology} {dtype} [{W}*{m}, {row}] differs")
        bad += streamed_checks(comm, xs, dtype, f"world {W} {comm.topology} {dtype} "
                                              f"[{W}*{m}, {row}]")
        bad += sized_checks(comm, seed, (W * m, *row), dtype)
        # interleaved with the other collectives (slot parities move)
        g = comm.all_gather(xs[r][:1].contiguous()) if m else None
        if g is not None and not (bits(g) == np.concatenate([bits(x[:1]) for x in xs])).all():
            bad.append(f"world {W} {comm.topology}: all_gather after all_to_all differs")
    return bad


def sized_checks(comm, seed: int, shape, dtype) -> list[str]:
    """all_to_all(sized=True): every block's first 8 bytes say its length (random, from
    below 8 to past the block); each source's bytes up to that length (geometry.sized_bytes)
    arrive exact, and this rank's proxy posts exactly those bytes of its blocks for the
    peers, rounded up to 16 (the first collective of a split block only; the others whole):
    on a mesh each rank's own; on a ring, where relays cut each part at the length the
    origin's call entry says, every rank's together come to each block's bytes times its
    hops."""
    from sparkccl.plan.geometry import ALIGN, round_up, sized_bytes
    W, r, bad = comm.world_size, comm.rank, []
    xs = [make_input(seed + 50, i, shape, dtype) for i in range(W)]
    chunk = xs[0].nbytes // W
    try:  # refused before anything is sent
        comm.all_to_all(xs[r], sized=1)
        bad.append(f"world {W}: all_to_all took sized=1")
    except TypeError as e:
        if "sized must be a bool" not in str(e):
            bad.append(f"world {W}: {e}")
    if 0 < chunk < 8:
        try:
            comm.all_to_all(xs[r], sized=True)
            bad.append(f"world {W}: sized all_to_all took blocks of {chunk} bytes")
        except ValueError as e:
            if "at least 8 bytes" not in str(e):
                bad.append(f"world {W}: {e}")
        return bad
    if not chunk:
        return bad
    g = torch.Generator().manual_seed(seed)
    heads = torch.randint(0, chunk + 40, (W, W), generator=g)  # heads[i, j]: i's block for j
    heads[:, 0] = torch.tensor([0, 7, chunk, chunk + 39][:W] + [5] * max(0, W - 4))
    for i in range(W):
        b = xs[i].reshape(-1).view(torch.uint8).view(W, chunk)
        for j in range(W):
            b[j, :8] = torch.tensor([int(heads[i, j])], dtype=torch.int64).view(torch.uint8)
    first = min(chunk, comm.max_slice)  # (the bytes of a block in its first collective)
    before = posted_bytes(comm)
    y = comm.all_to_all(xs[r], sized=True)
    got = bits(y).reshape(-1).view(np.uint8).reshape(W, chunk)
    want = reference(xs, r).reshape(-1).view(np.uint8).reshape(W, chunk)
    for i in range(W):
        n = sized_bytes(int(heads[i, r]), first)
        if not ((got[i, :n] == want[i, :n]).all() and (got[i, first:] == want[i, first:]).all()):
            bad.append(f"world {W} {comm.topology} sized {dtype} {list(shape)}: source {i}'s "
                       f"first {n} bytes (head {int(heads[i, r])}) or bytes from {first} "
                       "differ")
    S = round_up(first, ALIGN)
    rest = (chunk - first) and sum(round_up(min(comm.max_slice, chunk - o), ALIGN)
                                   for o in range(first, chunk, comm.max_slice))
    sent = posted_bytes(comm) - before
    if comm.topology == "mesh":
        expect = sum(sized_bytes(int(heads[r, j]), S) + rest for j in range(W) if j != r)
        if sent != expect:
            bad.append(f"world {W} mesh sized {dtype} {list(shape)}: the proxy posted {sent} "
                       f"bytes, not the {expect} of the blocks' lengths")
        return bad
    every = comm.all_gather(torch.tensor([sent], dtype=torch.int64)).tolist()
    expect = sum((sized_bytes(int(heads[i, j]), S) + rest) * min((j - i) % W, (i - j) % W)
                 for i in range(W) for j in range(W) if j != i)
    if sum(every) != expect:
        bad.append(f"world {W} ring sized {dtype} {list(shape)}: the proxies posted "
                   f"{sum(every)} bytes ({every}), not the {expect} of the blocks' lengths "
                   "times their hops")
    return bad


def streamed_checks(comm, xs, dtype, name) -> list[str]:
    """all_to_all(None, out=, fill=, arrived=) (the CPU twin streams): fill writes x's bytes
    range by range into the send slot (ranges in order, each once, covering every block);
    arrived(source, hi) is told this rank's own block first, each source's hi grows to the
    whole block, and when told, bytes [0, hi) of that source's block are already in out."""
    import ctypes
    W, r, bad = comm.world_size, comm.rank, []
    x = xs[r]
    chunk = x.nbytes // W
    want = reference(xs, r).reshape(W, -1).view(np.uint8) if chunk else None
    out = torch.empty_like(x)
    ranges, told = [], []

    def fill(base, stride, lo, hi):
        ranges.append((lo, hi))
        for j in range(W):
            ctypes.memmove(base + j * stride + lo, x.data_ptr() + j * chunk + lo, hi - lo)

    def arrived(source, hi):
        told.append((source, hi))
        o = bits(out).reshape(W, -1).view(np.uint8)
        if not (o[source, :hi] == want[source, :hi]).all():
            bad.append(f"{name}: streamed: source {source}'s bytes [0, {hi}) not in out when told")

    y = comm.all_to_all(None, out=out, fill=fill, arrived=arrived)
    if y is not out or (chunk and not (bits(y) == reference(xs, r)).all()):
        bad.append(f"{name}: streamed all_to_all differs")
    if not chunk:
        return bad
    if [b for _, b in ranges] != sorted(b for _, b in ranges) or \
            sum(b - a for a, b in ranges) != chunk or ranges[0][0] != 0 or \
            any(a != b for (_, a), (b, _) in zip(ranges, ranges[1:])):
        bad.append(f"{name}: fill ranges {ranges[:4]}... do not cover [0, {chunk}) in order")
    if told[0][0] != r:
        bad.append(f"{name}: arrived told source {told[0][0]} first, not this rank")
    for s in range(W):
        his = [h for i, h in told if i == s]
        if his != sorted(his) or his[-1] != chunk:
            bad.append(f"{name}: arrived for source {s}: {his[:4]}... (block {chunk} bytes)")
    return bad


def a2a_job(rank, nprocs, store, configs, transport="auto"):
    import torch.distributed as dist
    bad = []
    for i, (world, topo, slot, big) in enumerate(configs):
        if rank >= world:
            continue
        st = dist.PrefixStore(f"a2a{i}", store)
        with sparkccl.Communicator(store=st, rank=rank, world_size=world, topology=topo,
                                   slot_bytes=slot, timeout_s=60, transport=transport) as comm:
            bad += a2a_checks(comm, 100 * i, CASES + (BIG if big else []))
    return [f"rank {rank}: {b}" for b in bad]


def _run(nprocs, configs, transport="auto", env=None):
    values = check(run_ranks(a2a_job, nprocs, args=(configs, transport), timeout_s=600, env=env))
    bad = [b for v in values for b in v]
    assert not bad, "\n".join(bad)


def test_all_to_all_world_2_3_4_mesh_and_ring_shm():
    _run(4, [(2, "mesh", None, True), (2, "ring", 64 << 10, True), (3, "mesh", None, False),
             (3, "ring", None, False), (4, "mesh", 64 << 10, True), (4, "ring", None, False)])


@pytest.mark.slow
@pytest.mark.extended  # the rings of worlds 2-4 above, at worlds 5-8
def test_all_to_all_rings_5_to_8():
    _run(8, [(w, "ring", 256 << 10, False) for w in (5, 6, 7, 8)] + [(8, "mesh", None, False)])


@pytest.mark.slow
def test_all_to_all_tcp():
    _run(4, [(4, "ring", 64 << 10, True), (3, "mesh", None, False)], transport="tcp")


def test_all_to_all_verbs_through_emulated_nic(emunic_env):
    _run(4, [(2, "mesh", None, False), (4, "ring", 64 << 10, False), (3, "mesh", None, False)],
         transport="verbs", env=emunic_env)


def test_all_to_all_refuses_bad_input_before_sending():
    import torch.distributed as dist
    with sparkccl.Communicator(store=dist.HashStore(), rank=0, world_size=1) as comm:
        x = torch.zeros(4, 3)
        y = comm.all_to_all(x)
        assert (y == x).all() and y is not x
        with pytest.raises(ValueError, match="overlaps"):
            comm.all_to_all(x, out=x)
        with pytest.raises(ValueError, match="0-dim"):
            comm.all_to_all(torch.tensor(1.0))
        with pytest.raises(ValueError, match="out must have shape"):
            comm.all_to_all(x, out=torch.empty(3, 3))
        with pytest.raises(ValueError, match="contiguous"):
            comm.all_to_all(torch.zeros(3, 4).t())


def fill_raises_job(rank, nprocs, store):
    """Rank 0's fill raises on its second range; rank 1 makes the same call plainly."""
    import time

    from sparkccl.errors import CollectiveError
    with sparkccl.Communicator(store=store, rank=rank, world_size=2, timeout_s=60,
                               slot_bytes=256 << 10) as comm:
        out = torch.empty(2 * (128 << 10), dtype=torch.uint8)
        t0 = time.monotonic()
        try:
            if rank == 0:
                calls = []

                def fill(base, stride, lo, hi):
                    calls.append(lo)
                    if len(calls) == 2:
                        raise RuntimeError("no rows for this range")

                comm.all_to_all(None, out=out, fill=fill)
            else:
                comm.all_to_all(torch.ones_like(out), out=out)
        except (RuntimeError, CollectiveError) as e:
            return type(e).__name__, str(e), time.monotonic() - t0
        return None, "", time.monotonic() - t0


def test_all_to_all_fill_that_raises_fails_the_peers_at_once():
    """A caller's fill raising half way through: that rank gets its exception, after
    aborting the communicator, so the peer waiting for the rest of its block fails within
    seconds with that cause, not at its 60 s timeout."""
    (k0, m0, _), (k1, m1, t1) = check(run_ranks(fill_raises_job, 2, timeout_s=120))
    assert (k0, m0) == ("RuntimeError", "no rows for this range")
    assert k1 == "CollectiveError" and "the caller's fill raised RuntimeError: no rows" in m1, m1
    assert t1 < 30, t1
