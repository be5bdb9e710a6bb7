"""Run a function on W local ranks (processes), each with a shared torch Store.

``sparkccl demo`` and ``sparkccl bench`` start their ranks with it (so do the tests)::

    from sparkccl.localrun import check, run_ranks

    def job(rank, world, store, size):
        with sparkccl.Communicator(store=store, rank=rank, world_size=world) as comm:
            return comm.all_gather(torch.full((size,), rank)).tolist()

    results = run_ranks(job, world=4, args=(8,))     # list of RankResult, in rank order
    values = check(results)                          # raises RanksFailed if any rank failed

``fn`` must be importable by a fresh interpreter (a module-level function): ranks are
started with the ``spawn`` method, or (``start_method="forkserver"``) forked from a server
process that imported what :func:`warm_start` names once -- seconds less per rank where
many short runs start many ranks (benchmarks/fault_campaign.py); it must not have touched
CUDA (a forked CUDA context is unusable), which importing torch and sparkccl does not.
The store is a ``TCPStore`` served by the calling process, so a rank that dies does not
take the store down. Each rank runs with one torch
thread (the ranks share the host's cores).
"""
from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

KILLED = "killed"
STOP_GRACE_S = 5.0  # how long stopped ranks get to leave before SIGKILL


@dataclass
class RankResult:
    rank: int
    value: Any = None
    error: BaseException | None = None
    error_type: str | None = None  # class name, also when the exception could not be pickled
    message: str | None = None
    traceback: str | None = None
    exitcode: int | None = None
    elapsed_s: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error_type is None and self.exitcode == 0

    @property
    def killed(self) -> bool:
        return self.exitcode is not None and self.exitcode < 0


class RanksFailed(RuntimeError):
    def __init__(self, results: list[RankResult]):
        self.results = results
        lines = []
        for r in results:
            if r.ok:
                continue
            if r.error_type:
                lines.append(f"rank {r.rank}: {r.error_type}: {r.message}\n{r.traceback or ''}")
            else:
                lines.append(f"rank {r.rank}: exit code {r.exitcode} without a result")
        super().__init__("some ranks failed:\n" + "\n".join(lines))


def check(results: list[RankResult]) -> list[Any]:
    """Values in rank order; raises :class:`RanksFailed` if any rank failed."""
    if not all(r.ok for r in results):
        raise RanksFailed(results)
    return [r.value for r in results]


# Set in a rank process started by run_ranks: where report_progress sends its items.
_progress_queue = None
_progress_rank = -1


def report_progress(item) -> None:
    """From inside a rank: hand ``item`` to the ``progress`` callback of :func:`run_ranks`
    in the parent (nothing happens outside run_ranks)."""
    if _progress_queue is not None:
        _progress_queue.put(("progress", _progress_rank, item, 0.0))


def _stop_on_sigterm(signum, frame):
    # Once: a second signal must not interrupt the clean-up the first one started.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt(f"stopped by the parent (signal {signum})")


def _rank_main(fn, rank, world, host, port, args, kwargs, env, q, torch_threads,
               forked=False):
    global _progress_queue, _progress_rank
    # Ctrl-C is the parent's to handle (it stops the ranks with SIGTERM): a rank ignores
    # it. It was blocked since before this process started (run_ranks), so none is lost
    # half-way through the interpreter's start.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    _progress_queue, _progress_rank = q, rank
    os.environ.update(env or {})
    t0 = time.monotonic()
    try:
        import torch
        import torch.distributed as dist
        if torch.cuda._is_in_bad_fork():  # forkserver: CUDA was initialised before the fork
            raise RuntimeError("this rank was forked from a process that had initialised "
                               "CUDA: run it with start_method='spawn'")
        torch.set_num_threads(torch_threads)
        store = dist.TCPStore(host, port, world_size=None, is_master=False,
                              timeout=timedelta(seconds=300))
        value = fn(rank, world, store, *args, **kwargs)
        q.put(("ok", rank, value, time.monotonic() - t0))
    except BaseException as e:  # noqa: BLE001 - report everything to the parent
        q.put(("err", rank, failure_record(e), time.monotonic() - t0))
    finally:
        if forked:
            # A forked process leaves by os._exit, which skips the atexit handlers a spawned
            # one runs at interpreter exit -- among them sparkccl's, which delivers what an
            # open communicator still owes its peers (sparkccl.lifetime): run them here.
            atexit._run_exitfuncs()


def failure_record(e: BaseException) -> tuple:
    """What a rank process reports of its exception (call it in the ``except`` block): the
    exception itself if it pickles (else None), its type name, its text, the traceback."""
    import pickle
    tb = traceback.format_exc()
    try:
        pickle.dumps(e)
        err = e
    except Exception:
        err = None
    return err, type(e).__name__, str(e), tb


def run_ranks(fn: Callable, world: int, *, args: tuple = (), kwargs: dict | None = None,
              timeout_s: float = 300.0, env: dict | None = None,
              rank_env: dict[int, dict] | None = None, torch_threads: int = 1,
              raise_on_error: bool = False,
              progress: Callable[[int, Any], None] | None = None,
              start_method: str = "spawn") -> list[RankResult]:
    """Start ``world`` processes running ``fn(rank, world, store, *args, **kwargs)``.

    Returns one :class:`RankResult` per rank (value or error, exit code, time). A rank that
    has not finished after ``timeout_s`` is killed (SIGKILL) and reported with
    ``error_type == "Timeout"``. ``env`` is applied in every rank, ``rank_env[r]`` in rank r.
    ``progress(rank, item)`` receives what ranks pass to :func:`report_progress`.
    ``start_method``: "spawn" (a fresh interpreter per rank) or "forkserver" (see
    :func:`warm_start`).

    Ctrl-C (SIGINT) reaches only this process: ranks ignore it. When this function is left
    by an exception (KeyboardInterrupt included) the ranks still running get SIGTERM, which
    raises in them so that their communicators are left and their shared memory unlinked,
    and SIGKILL after :data:`STOP_GRACE_S`.
    """
    import torch.distributed as dist
    if start_method not in ("spawn", "forkserver"):
        raise ValueError(f"start_method must be 'spawn' or 'forkserver', got {start_method!r}")
    ctx = mp.get_context(start_method)
    server = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True,
                           timeout=timedelta(seconds=300), wait_for_workers=False)
    q = ctx.Queue()
    procs = []
    finished = False
    try:
        # Started with SIGINT blocked (inherited): a Ctrl-C while a rank's interpreter
        # starts stays pending there until _rank_main ignores it, and is delivered here
        # when the mask is restored.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            for r in range(world):
                e = dict(env or {})
                e.update((rank_env or {}).get(r, {}))
                p = ctx.Process(target=_rank_main, name=f"sparkccl-rank{r}",
                                args=(fn, r, world, "127.0.0.1", server.port, args,
                                      kwargs or {}, e, q, torch_threads,
                                      start_method != "spawn"),
                                daemon=True)
                p.start()
                procs.append(p)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        results = [RankResult(rank=r) for r in range(world)]
        pending = set(range(world))
        deadline = time.monotonic() + timeout_s
        dead_since: dict[int, float] = {}
        while pending and time.monotonic() < deadline:
            try:
                kind, rank, payload, elapsed = q.get(timeout=0.1)
                if kind == "progress":
                    if progress is not None:
                        progress(rank, payload)
                    continue
                _record(results, kind, rank, payload, elapsed)
                pending.discard(rank)
                continue
            except queue_mod.Empty:
                pass
            now = time.monotonic()
            for r in list(pending):
                if procs[r].exitcode is None:
                    continue
                # Dead without a result (yet): allow its last message a moment to arrive.
                if now - dead_since.setdefault(r, now) > 1.0:
                    pending.discard(r)
                    code = procs[r].exitcode
                    results[r].error_type = KILLED if code < 0 else "Exited"
                    results[r].message = f"exit code {code}"
        for r in pending:
            results[r].error_type = "Timeout"
            results[r].message = f"no result after {timeout_s:g} s"
        for r, p in enumerate(procs):
            # A rank that already answered may still be closing (close() waits for every
            # rank); on an oversubscribed host that can take a while.
            p.join(timeout=60 if r not in pending else 0.1)
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join(timeout=5)
            results[r].exitcode = p.exitcode
        finished = True
    finally:
        if not finished:
            _stop(procs)
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join(timeout=5)
        q.close()
        del server
    if raise_on_error:
        check(results)
    return results


WARM_MODULES = ("torch", "torch.distributed", "numpy", "sparkccl.comm",
                "sparkccl.expert_parallel", "sparkccl.reference")


def warm_start(modules=WARM_MODULES) -> None:
    """Have ``run_ranks(..., start_method="forkserver")`` fork its ranks from one server
    process that imported ``modules`` (and the main script) once, instead of each rank
    importing torch afresh. Call it before the first such run_ranks. None of ``modules`` may
    initialise CUDA at import (a rank forked after CUDA was initialised refuses to run)."""
    mp.set_forkserver_preload(["__main__", *modules])


def _stop(procs) -> None:
    """Leaving run_ranks early (an exception, Ctrl-C): SIGTERM to the ranks still running,
    and a moment to leave their communicators (the caller SIGKILLs what remains)."""
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        try:
            os.kill(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + STOP_GRACE_S
    try:
        for p in alive:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
    except KeyboardInterrupt:  # a second Ctrl-C: no more waiting
        pass


def _record(results, kind, rank, payload, elapsed):
    res = results[rank]
    res.elapsed_s = elapsed
    if kind == "ok":
        res.value = payload
    else:
        err, tname, msg, tb = payload
        res.error, res.error_type, res.message, res.traceback = err, tname, msg, tb
