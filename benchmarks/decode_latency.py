"""Decode-regime all-reduce latency beside its floors, measured in the same run (issue 30).

    python benchmarks/decode_latency.py --world 2            # one GPU shared under MPS
    python benchmarks/decode_latency.py --world 4 --iters 300

Runs the ranks once per path: GPU-direct (the default on one host: a one shot of up to
8 KiB / (world - 1) sends LL lines, which carry their own flags), GPU-direct with flag words
only (``SPARKCCL_ALLREDUCE_LL=0``, the way before LL), the proxy path
(``SPARKCCL_GPU_DIRECT=0``: GB10's, one GPU a box; flag words) and, with ``--paths
proxyll``, the proxy path with the LL lines posted by the proxy
(``SPARKCCL_ALLREDUCE_LL_PROXY=1``). Per run, every rank measures:

* ``flag rtt``: a GPU -> CPU -> GPU flag round trip (sccl_clock_probe: the host writes a
  word in pinned memory, the spinning kernel answers with a store the host sees), p50;
* ``write``, per size: what the proxy path adds to that round trip at the least, a host
  thread's copy of the vector between two pinned buffers (``ctypes.memmove``), p50;
* per size (bf16, bytes per rank): the one-shot all-reduce ``ar`` (CUDA: one kernel,
  sccl_allreduce_*) eager (host-synchronized after every call), eager back to back (``ar
  b2b``: ``--per-graph`` calls issued, then one sync, per call: how a decode loop without
  graphs issues them, and how nccl-tests times), and replayed in a CUDA graph
  (``--per-graph`` calls per replay, p50 per call), and the same regime as it was
  before, ``ag+sum``: an all-gather and torch adds in rank order (allreduce.rank_order_sum).

``--timeline`` (SPARKCCL_GPU_TIMELINE: kernels built with step stamps, so run it apart from
the figures above) adds, per size, where a replayed one-shot call's time goes on the GPU
clock (sparkccl/dataplane/timeline.py): launch gap, publish, hand-off, flag to the peer's
poller, poller to consumer, sum, exit (the LL way: launch gap, stores, lines to the reader,
sum, exit, and its hand-off block beside them); p50 and p90 over every rank's calls of one
replay.

The floor is the mechanism's: ``flag rtt`` (GPU-direct: the GPU stores into the peer's
memory and the peer's GPU sees it, a flag each way at the least) or ``flag rtt + write`` (the
proxy path: the GPU's entry seen by the host, the host's copy, its flag seen by the GPU); the
table prints each replayed all-reduce's ratio to it (issue bar: <= 2) and the before/after
ratio. The proxy path also gets ``piece`` (``piece_probe.cu``): the flag round trip with the
vector in it, measured as one: the GPU reads the vector from pinned memory (as a consumer
reads what the proxy stored), writes it to pinned memory with a system fence and a stamp (as
the publish fills the send slot), and the host copies it back (as the proxy does) -- each
crossing of the bus that any proxy-path design makes once per call where the host cannot
reach device memory, with no sum, launch or bookkeeping; ``graph/piece`` is the ratio to it
(vectors up to PIECE_MAX, where one block carries them in one trip each way; at world W a
rank sends its vector to W - 1 peers and reads theirs, so the probe is world 2's floor).
``--sm-share`` for worlds above 2 under MPS (see its help). Figures are the slowest rank's.
Every timed all-reduce's result is checked bit for bit against the rank-order reference
once, before timing.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

SIZES = [8 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 2 << 20]


def _flag_rtt(comm, rounds: int) -> float:
    """p50 seconds of a host -> GPU -> host flag round trip through pinned memory."""
    import numpy as np

    from sparkccl.dataplane.cuda_runtime import kernel_u64, u64_at
    gpu = comm.data_plane.gpu
    buf = np.zeros(2 * rounds, dtype=np.uint64)
    dev = gpu.register(buf.ctypes.data, buf.nbytes)
    go = [u64_at(buf.ctypes.data + 8 * k) for k in range(rounds)]
    stamp = [u64_at(buf.ctypes.data + 8 * (rounds + k)) for k in range(rounds)]
    ts, stream = gpu.probe_stream()
    gpu.launch_kernel(stream, "sccl_clock_probe", 1, 32, dev, dev + 8 * rounds,
                      kernel_u64(rounds), kernel_u64(10 * 10**9))
    try:
        return _probe_rounds("sccl_clock_probe", go, stamp)
    finally:
        ts.synchronize()
        gpu.unregister(buf.ctypes.data)


def _probe_rounds(name: str, go, stamp, after=None) -> float:
    """The host's side of a spinning probe kernel: round k writes go[k] and waits for
    stamp[k] (then calls ``after``, if given); p50 seconds per round, the first tenth left
    out (they warm up). Every go word is set on the way out, so the kernel ends."""
    rounds = len(go)
    time.sleep(0.05)  # (the probe is spinning on go[0])
    each = []
    deadline = time.monotonic() + 60
    try:
        for k in range(rounds):
            t0 = time.perf_counter_ns()
            go[k].value = 1
            while stamp[k].value == 0:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name}: no answer to round {k} in 60 s")
            if after is not None:
                after()
            each.append(time.perf_counter_ns() - t0)
    finally:
        for w in go:
            w.value = 1
    return statistics.median(each[rounds // 10:]) / 1e9


PIECE_MAX = 16 << 10
"""The largest vector the piece probe times: one block moves it in one trip each way (up to
two 16-byte loads a thread). Past that, one block is slower than the collective's many,
which pipeline the pieces: the probe is then no floor, and is not printed."""
PIECE_PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "piece_probe.cu")


def _piece_rtt(comm, nbytes: int, rounds: int) -> float:
    """p50 seconds of a GPU -> CPU -> GPU round trip that carries ``nbytes`` (piece_probe.cu):
    the host's go flag, the GPU's read of the piece from pinned memory, its write of the
    piece to pinned memory with a system fence and a stamp, the host's copy of the piece
    back. Every step the proxy path's one shot takes once, with nothing else: its floor
    with the data in it."""
    import ctypes

    import numpy as np
    import torch

    from sparkccl.dataplane import nvrtc
    from sparkccl.dataplane.cuda_runtime import kernel_u64, u64_at
    gpu = comm.data_plane.gpu
    cc = nvrtc.import_cuda_core()
    arch = nvrtc.arch_of(torch.cuda.get_device_capability(comm.device.index))
    obj = cc.ObjectCode.from_cubin(nvrtc.compile_cubin(arch, src=nvrtc.source(PIECE_PROBE)),
                                   name="piece_probe")
    kernel = obj.get_kernel("piece_probe")
    n = -(-nbytes // 16) * 16
    words = 2 * rounds
    buf = np.zeros(words + 2 * n // 8, dtype=np.uint64)
    base = buf.ctypes.data
    dev = gpu.register(base, buf.nbytes)
    go = [u64_at(base + 8 * k) for k in range(rounds)]
    stamp = [u64_at(base + 8 * (rounds + k)) for k in range(rounds)]
    src, dst = base + 8 * words, base + 8 * words + n  # (the kernel reads src, writes dst)
    ts, stream = gpu.probe_stream()
    cc.launch(stream, cc.LaunchConfig(grid=1, block=512), kernel, dev, dev + 8 * rounds,
              dev + 8 * words, dev + 8 * words + n, kernel_u64(n), kernel_u64(rounds),
              kernel_u64(10 * 10**9))
    try:
        return _probe_rounds("piece_probe", go, stamp, lambda: ctypes.memmove(src, dst, n))
    finally:
        ts.synchronize()
        gpu.unregister(base)


# proxy_stats() keys returned by _job (rank 0's are printed): consumed -> first post, the
# proxy's first write -> flag pushed per post, and (shm) each data flag's way through its
# connection's copy worker: pushed -> taken from the queue -> stored in the peer's word, and
# how often the workers blocked on their queues (a futex wake for the proxy, a wake-up for
# the worker). Over the whole run of the GPU communicator (every size, eager and replayed).
PROXY_KEYS = ("delay_p50_ns", "delay_p99_ns", "delay_samples",
              "write_flag_samples", "write_flag_p50_ns", "write_flag_p99_ns",
              "shm_flag_samples", "shm_flag_take_p50_ns", "shm_flag_take_p99_ns",
              "shm_flag_store_p50_ns", "shm_flag_store_p99_ns",
              "shm_flag_total_p50_ns", "shm_flag_total_p99_ns", "shm_worker_sleeps",
              "first_p50_ns", "first_p99_ns", "first_samples", "naps", "turns")


def _barrier(store, name: str, rank: int, world: int) -> None:
    """Every rank got here (through the Store, no collective: the bootstrap's barrier)."""
    from sparkccl.bootstrap import Rendezvous
    Rendezvous(store, "bench", rank, world, 120.0).barrier(name, f"finish the {name}")


def print_proxy_stats(proxy: dict) -> None:
    """Rank 0's proxy figures (``proxy_stats()``, keys PROXY_KEYS) as comment lines."""
    if proxy.get("delay_samples"):
        from sparkccl.bench import proxy_delay_line
        print("# " + proxy_delay_line(proxy))
    if proxy.get("first_samples"):
        print(f"# proxy (rank 0): GPU publish of a collective's piece 0 -> its first write "
              f"posted: p50 {proxy['first_p50_ns'] / 1e3:.1f} us, p99 "
              f"{proxy['first_p99_ns'] / 1e3:.1f} us over {proxy['first_samples']} "
              f"collectives (SPARKCCL_GPU_STAMPS); proxy naps {proxy['naps']} in "
              f"{proxy['turns']} turns")
    if proxy.get("write_flag_samples"):
        print(f"# proxy (rank 0): a post's first write pushed -> its flag pushed: p50 "
              f"{proxy['write_flag_p50_ns'] / 1e3:.1f} us, p99 "
              f"{proxy['write_flag_p99_ns'] / 1e3:.1f} us over {proxy['write_flag_samples']} "
              "posts")
    if proxy.get("shm_flag_samples"):
        def pq(k):
            return (f"{proxy[f'shm_flag_{k}_p50_ns'] / 1e3:.1f} / "
                    f"{proxy[f'shm_flag_{k}_p99_ns'] / 1e3:.1f}")
        print(f"# shm copy workers (rank 0), per data flag, p50 / p99 us (the last 1024 "
              f"per connection of {proxy['shm_flag_samples']}): pushed -> taken "
              f"{pq('take')}, taken -> stored {pq('store')}, pushed -> stored {pq('total')}"
              f"; the workers blocked {proxy['shm_worker_sleeps']} times")


def _host_write(nbytes: int, rounds: int, fresh: bool = False) -> float:
    """p50 seconds of a host thread's copy of nbytes between two pinned buffers. ``fresh``:
    the GPU writes the source before each copy (as the proxy's copies find it: bytes a GPU
    just published, not in the host's caches); else the same bytes copied again and again."""
    import ctypes

    import torch
    src = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    gpu = torch.full((nbytes,), 3, dtype=torch.uint8, device="cuda") if fresh else None
    a, b = dst.data_ptr(), src.data_ptr()
    each = []
    for _ in range(rounds):
        if fresh:
            src.copy_(gpu)
            torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        ctypes.memmove(a, b, nbytes)
        each.append(time.perf_counter_ns() - t0)
    return statistics.median(each[rounds // 10:]) / 1e9


def _job(rank, world, store, sizes, iters, per_graph, with_timeline=False):
    import torch
    import torch.distributed as dist

    import sparkccl
    from sparkccl import allreduce as A
    from sparkccl.reference import all_reduce_reference, bits, make_input
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    sync = torch.cuda.synchronize
    row0 = {}

    def p50(fn, n, sync_each=True):
        fn()
        sync()
        each = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            if sync_each:
                sync()
            each.append(time.perf_counter() - t0)
        return statistics.median(each)

    rows = []
    with sparkccl.Communicator(store=dist.PrefixStore("gpu", store), rank=rank,
                               world_size=world, device=dev, timeout_s=120) as comm:
        row0["flag rtt"] = _flag_rtt(comm, max(50, iters))
        # the probes first, every rank's before any collective: a probe's one block is not
        # scheduled while other ranks' spinning all-reduce kernels fill the GPU they share
        pieces = {size: _piece_rtt(comm, size, max(50, iters)) if size <= PIECE_MAX else None
                  for size in sizes}
        _barrier(store, "probes", rank, world)
        for size in sizes:
            n = size // 2
            xs = [make_input(size, r, (n,), torch.bfloat16) for r in range(world)]
            x = xs[rank].to(dev)
            out = torch.empty_like(x)
            want = all_reduce_reference(xs)

            def ar():
                comm.all_reduce(x, out=out, regime=A.ONE_SHOT)

            def before():  # the regime as it was: an all-gather, then torch adds
                g = comm.all_gather(x)
                A.rank_order_sum([g[r * n:(r + 1) * n] for r in range(world)], False, out)

            row = {"size": size, "write": _host_write(size, max(50, iters)),
                   "piece": pieces[size]}
            for name, fn in (("ar", ar), ("ag+sum", before)):
                out.view(torch.uint8).fill_(0xFF)  # (each check sees its own result)
                fn()
                sync()
                if not (bits(out.cpu()) == want).all():
                    raise AssertionError(f"rank {rank}: {name} {size} B differs from the "
                                         "rank-order reference")
                row[name] = p50(fn, iters)
                if name == "ar":  # eager back to back: the host enqueues, one sync at the end
                    row["ar b2b"] = statistics.median(
                        p50(lambda: [fn() for _ in range(per_graph)], 1) / per_graph
                        for _ in range(max(5, iters // per_graph)))
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for _ in range(per_graph):
                        fn()
                out.view(torch.uint8).fill_(0xFF)
                g.replay()
                sync()
                if not (bits(out.cpu()) == want).all():
                    raise AssertionError(f"rank {rank}: {name} {size} B replayed differs")
                row[name + " graph"] = p50(g.replay, max(5, iters // per_graph)) / per_graph
                if with_timeline and name == "ar":
                    from sparkccl.dataplane import timeline
                    g.replay()
                    sync()
                    row["timeline"] = timeline.last_rows(comm.data_plane, per_graph)
                del g
            rows.append(row)
        comm.synchronize()
        stats = comm.proxy_stats()
    return row0, rows, {k: stats.get(k) for k in PROXY_KEYS}


def main() -> None:
    from sparkccl.localrun import check, run_ranks
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--per-graph", type=int, default=20)
    ap.add_argument("--max-bytes", type=int, default=2 << 20)
    ap.add_argument("--paths", default="direct,flags,proxy",
                    help="a comma list of direct (GPU-direct, LL lines up to 8 KiB / "
                         "(world - 1)), flags (GPU-direct with flag words only: "
                         "SPARKCCL_ALLREDUCE_LL=0), proxy (flag words), proxyll (LL lines "
                         "through the proxy: SPARKCCL_ALLREDUCE_LL_PROXY=1)")
    ap.add_argument("--timeline", action="store_true",
                    help="also the GPU step timeline of the replayed one shot (SPARKCCL_GPU_TIMELINE)")
    ap.add_argument("--sm-share", type=int, default=None,
                    help="under MPS, each rank's percentage of the GPU's SMs "
                         "(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE). Ranks sharing one GPU spin in "
                         "their kernels while they wait: at world 4 from 256 KiB, three ranks' "
                         "spinning blocks left the fourth's publish no SM (a 120 s timeout, "
                         "fail-stop); 25 keeps every rank room. Not a case of one GPU a rank")
    a = ap.parse_args()
    sizes = [s for s in SIZES if s <= a.max_bytes]
    paths = {"direct": ("GPU-direct", {}),
             "flags": ("GPU-direct, flag words only", {"SPARKCCL_ALLREDUCE_LL": "0"}),
             "proxy": ("proxy path", {"SPARKCCL_GPU_DIRECT": "0"}),
             "proxyll": ("proxy path, LL lines", {"SPARKCCL_GPU_DIRECT": "0",
                                                  "SPARKCCL_ALLREDUCE_LL_PROXY": "1"})}
    for key in a.paths.split(","):
        path, env = paths[key]
        if a.timeline:  # (the proxy path: its publish -> post too, on the GPU's stamps)
            env = {**env, "SPARKCCL_GPU_TIMELINE": "1", "SPARKCCL_GPU_STAMPS": "1"}
        if a.sm_share:
            env = {**env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(a.sm_share)}
        res = check(run_ranks(_job, a.world, args=(sizes, a.iters, a.per_graph, a.timeline),
                              env=env, timeout_s=1200))
        rtt = max(r[0]["flag rtt"] for r in res)
        print(f"# decode all-reduce, cuda world {a.world} mesh, {path}, bf16; p50 per call "
              f"(us, slowest rank); {a.iters} eager calls, replays of {a.per_graph} calls")
        print(f"# floor: flag rtt {rtt * 1e6:.1f} us"
              + (" + the host's copy of the vector (write)" if key.startswith("proxy") else ""))
        if key.startswith("proxy"):
            print("# piece: the round trip GPU -> CPU -> GPU that carries the vector once "
                  "(piece_probe.cu: the host's flag, the GPU's read of the vector from pinned "
                  "memory, its write to pinned memory + system fence + stamp, the host's copy); "
                  f"up to {PIECE_MAX // 1024} KiB")
        keys = ["ar graph", "ar", "ar b2b", "ag+sum graph", "ag+sum"]
        print("bytes/rank " + " ".join(f"{k:>13}" for k in keys)
              + "  write  floor  graph/floor  before/after(graph)"
              + ("  piece  graph/piece" if key.startswith("proxy") else ""))
        for i, row in enumerate(res[0][1]):
            t = {k: max(r[1][i][k] for r in res) for k in [*keys, "write"]}
            piece = row["piece"] and max(r[1][i]["piece"] for r in res)
            floor = rtt + (t["write"] if key.startswith("proxy") else 0.0)
            print(f"{row['size']:>10} " + " ".join(f"{t[k] * 1e6:13.1f}" for k in keys)
                  + f"  {t['write'] * 1e6:5.1f}  {floor * 1e6:5.1f}  {t['ar graph'] / floor:11.2f}"
                  + f"  {t['ag+sum graph'] / t['ar graph']:19.2f}"
                  + (f"  {piece * 1e6:5.1f}  {t['ar graph'] / piece:11.2f}"
                     if key.startswith("proxy") and piece else ""))
        if a.timeline:
            from sparkccl.dataplane import timeline
            print("# GPU timeline of one replay (kernels with step stamps), us: p50 / p90 "
                  "over every rank's calls")
            for i, row in enumerate(res[0][1]):
                steps = timeline.summary([r[1][i]["timeline"] for r in res])
                print(f"{row['size']:>10}  " + "  ".join(f"{n} {p:.1f}/{q:.1f}"
                                                         for n, p, q, _ in steps))
        print_proxy_stats(res[0][2])
        print()


if __name__ == "__main__":
    main()
