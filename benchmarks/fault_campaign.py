"""Fault campaign: a rank killed, stalled or its link taken down, at a random collective and
a random moment inside it; every survivor must fail, fast, without ever returning wrong data.

Each case (drawn from ``--seed``): a transport (shm, tcp, verbs through the emulated RoCE
NIC of tests/emunic; on CUDA shm only), a topology (mesh, ring), a world of 2..6
(``--max-world``), a fault and a moment:

* faults: ``kill`` (the victim SIGKILLs itself), ``stop`` (SIGSTOP: a hung process),
  ``pyexit`` (the victim's script ends before collective ``call`` without ``close()``: the
  at-exit path delivers what it owes and leaves), ``linkdown`` (verbs: every port of the
  emulated host goes down, so every rank is hit; the bootstrap network stays up) and
  ``rootdown`` (verbs with SPARKCCL_ROOTS=2: root 0's ports down, root 1 up: sparkccl does
  not carry on over the other root, every rank fails naming the connection and root);
* slow but alive (a quarter of the extended draw), which must NOT fail and must stay exact:
  ``slowstop`` (SIGSTOP for ``hold_s``, under half the collective timeout on every
  transport: since issue 32 the liveness channel of tcp / verbs declares only exited
  processes and unreachable hosts dead, never a silent one, sparkccl/liveness.py) and
  ``starve`` (every thread of the victim in the idle scheduling class while two CPU burners
  per core run for ``hold_s``, 1-4 s; the ranks keep issuing small collectives until it is
  over);
* moments, in collective k (1..6) of a run of bursts: ``before-publish`` (the victim stops
  just before calling it, the others are waiting in it), ``mid-piece`` (a timer fires at a
  random time inside a large collective), ``relay`` (the same on a ring of 4 or more, where
  every rank relays for others), ``finalize`` (inside a fused MoE finalize);
* the collectives (the extended draw, mix "all"): all-gather, reduce-scatter, the zero-copy
  reduce-scatter, all-reduce, the fused finalize and expert-parallel dispatch + combine,
  small ones around a big one that the fault is drawn into (``--dry-run`` lists them);
  mix "v1" (the CUDA default draw and the records before issue 32's 500): all-gather,
  reduce-scatter and finalize.

Checks per case (slow cases: no rank raises, every result exact): every survivor raises
CollectiveError (at the call or, on CUDA, at the next synchronization -- or its process
dies of a CUDA error after its watchdog printed ``sparkccl: CollectiveError: rank R: ...``,
the report or, for a context another process's trap ended under MPS, the note with the
cause the host knew) within its bound (bound_s: the collective timeout + 1 s, a stop on
every transport included: a stopped process is reported by the timeout, not the liveness
channel) of the fault; no rank hangs; every result a survivor
got back is bit-exact (a wrong result returned as valid fails the case); no /dev/shm
segment of the communicator (nor of the one made afterwards) is left once the processes
exited; a new communicator among the survivors, in the same processes, works afterwards (on
CUDA, where fail-stop ends the survivors, in fresh processes).

Ranks are forked from a server that imported torch and sparkccl once (``warm_start``; no
CUDA in it), a few seconds less per rank than a fresh interpreter (``--spawn``); a forked
rank runs the atexit handlers at its end as a spawned one does at interpreter exit. Cases
run one at a time: a starve case's burners end with it.

Records after issue 32's liveness change (a stop on tcp / verbs is the timeout's):
benchmarks/fault_campaign_liveness_*_cpu.txt (--faults / --transports selections: 120
slow-but-alive cases over tcp / verbs, 0 false positives; a normal slice of seed 903).

Elsewhere (issue 32): tcp partitions on network namespaces (benchmarks/
partition_campaign.py), the emulated NIC refusing ibv_reg_mr (tests/test_regmr_enomem.py),
the store's host rank dying (tests/test_store_host_dies.py).

::

    python benchmarks/fault_campaign.py --cases 40 --seed 1 --out benchmarks/fault_campaign_cpu.txt
    nice -n 19 timeout 3000 python benchmarks/fault_campaign.py --cases 520 --seed 500 \
        --max-world 8 --out benchmarks/fault_campaign_500_cpu.txt   # issue 32's record
    python benchmarks/fault_campaign.py --device cuda --cases 12 --seed 1
    python benchmarks/fault_campaign.py --device cuda --extended --cases 40 --seed 32 \
        --max-world 4 --on-failure poison                          # issue 32 (GPU)
    python benchmarks/fault_campaign.py --dry-run --cases 40 --seed 32   # list, run none
    # only some faults: the first 60 slow-but-alive cases over tcp / verbs drawn from seed
    # 905 (the draw is the same; other cases are skipped, each keeps its --index)
    python benchmarks/fault_campaign.py --faults starve,slowstop --transports tcp,verbs \
        --cases 60 --seed 905
    # one case by its fields (the ops are those of case `--index` of `--seed`), e.g. the
    # world-6 mesh case that hung once on the H200 (seed 1, case 0):
    python benchmarks/fault_campaign.py --device cuda --seed 1 --index 0 \
        --case shm/mesh/6/kill/0/4/mid-piece/15.2

A rank that hangs is killed after ``--rank-timeout`` seconds; before that (from DUMP_S on,
every DUMP_S) it writes its threads' stacks and its GPU failure words to its stderr, whose
tail the FAIL line then shows.
"""
from __future__ import annotations

import argparse
import faulthandler
import os
import random
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

TIMEOUT_S = 4.0  # the collective timeout of every case
# Creation waits this long for every rank: rank processes of a world of 8 start seconds
# apart on a loaded 2-core machine (the default, timeout_s, failed one case's creation).
BOOTSTRAP_S = 120.0
SLOT_BYTES = 4 << 20
MOMENTS = ("before-publish", "mid-piece", "relay", "finalize")
# kill: SIGKILL; stop: SIGSTOP past the timeout; pyexit: the script ends without close()
# (SystemExit before collective `call`: the at-exit path); linkdown: every port of the
# emulated host down (verbs); rootdown: one root of two down (verbs, SPARKCCL_ROOTS=2).
FAILING_FAULTS = ("kill", "stop", "pyexit", "linkdown", "rootdown")
# slowstop: SIGSTOP for under half the collective timeout (every transport: the liveness
# channel does not count silence, sparkccl/liveness.py); starve: the victim in the idle
# scheduling class while CPU burners hold every core.
SLOW_FAULTS = ("slowstop", "starve")
FAULTS = FAILING_FAULTS + SLOW_FAULTS
LIVENESS_S = 1.5  # SPARKCCL_LIVENESS_S's default (tcp, verbs): exited or unreachable only
MIXES = ("v1", "all")
# Mix "all": the big collective at the fault is one of these (or the finalize, for the
# finalize moment); EP shapes are (tokens per rank, hidden, topk, e4m3).
BIG_KINDS = ("ag", "rs", "rsz", "ar", "ep")
BIG_EP = (256, 512, 4, False)
SMALL_EP = ((8, 128, 2, False), (6, 256, 2, True))
COLLECTIVE_NAMES = {"ag": "all-gather", "rs": "reduce-scatter", "rsz": "zero-copy rs",
                    "ar": "all-reduce", "fin": "finalize", "ep": "EP dispatch+combine"}
ROOT0_DEVICES = ("rocep1s0f0", "rocep1s0f1")  # the emulated GB10's PCI domain 0000: root 0
DUMP_S = 30  # a rank still running then is hung: stacks and GPU words to its stderr
ERR_TAIL = 4000  # characters of a hung rank's stderr in its FAIL line


@dataclass(frozen=True)
class Case:
    transport: str
    topology: str
    world: int
    fault: str
    moment: str
    victim: int  # -1: every rank (a link down on the shared emulated host)
    call: int
    delay_ms: float
    seed: int
    hold_s: float = 0.0  # slowstop: how long the victim stays stopped; starve: how long
    # the collectives drawn around the fault (_ops): "v1" all-gather, reduce-scatter and
    # finalize (the records before issue 32's 500); "all" every collective (MIXES)
    mix: str = "v1"

    @property
    def slow(self) -> bool:
        """Slow but alive: nothing may fail, every result must be exact."""
        return self.fault in SLOW_FAULTS

    def label(self) -> str:
        who = "all ranks" if self.victim < 0 else f"rank {self.victim}"
        return (f"{self.transport}/{self.topology} w{self.world} {self.fault} {who} at call "
                f"{self.call} {self.moment}" + (f" +{self.delay_ms:.1f} ms" if self.moment !=
                                                "before-publish" else "")
                + (f" for {self.hold_s:.2f} s" if self.slow else ""))

    def spec(self) -> str:
        """The --case text that replays this case (with --seed / --index)."""
        return (f"{self.transport}/{self.topology}/{self.world}/{self.fault}/{self.victim}/"
                f"{self.call}/{self.moment}/{self.delay_ms:.1f}/{self.hold_s:.2f}"
                + ("" if self.mix == "v1" else f"/{self.mix}"))


def parse_case(spec: str, seed: int, index: int = 0) -> Case:
    """A case from ``transport/topology/world/fault/victim/call/moment/delay_ms``, with the
    seed of case ``index`` of ``seed`` (the seed picks the collectives, see _ops)."""
    try:
        parts = spec.split("/")
        t, topo, world, fault, victim, call, moment, delay = parts[:8]
        hold = float(parts[8]) if len(parts) > 8 else 0.0
        mix = parts[9] if len(parts) > 9 else "v1"
        case = Case(t, topo, int(world), fault, moment, int(victim), int(call), float(delay),
                    seed=seed * 1000 + index, hold_s=hold, mix=mix)
    except ValueError:
        raise SystemExit(f"--case {spec!r}: expected transport/topology/world/fault/victim/"
                         "call/moment/delay_ms[/hold_s[/mix]], e.g. "
                         "shm/mesh/6/kill/0/4/mid-piece/15.2") from None
    if moment not in MOMENTS or fault not in FAULTS or mix not in MIXES:
        raise SystemExit(f"--case {spec!r}: moment one of {MOMENTS}, fault one of {FAULTS}, "
                         f"mix one of {MIXES}")
    return case


def draw_cases(n: int, seed: int, device: str = "cpu", max_world: int = 6,
               extended: bool | None = None) -> list[Case]:
    """``n`` cases of ``seed``. ``extended`` (default on CPU): every fault of FAULTS, a
    quarter of them slow but alive; else (the CUDA campaign, and the records drawn before
    issue 32) kill / stop / linkdown only, drawn exactly as then."""
    if extended is None:
        extended = not device.startswith("cuda")
    if extended:
        return _draw_extended(n, seed, device, max_world)
    rnd = random.Random(seed)
    transports = ("shm",) if device.startswith("cuda") else ("shm", "tcp", "verbs")
    cases = []
    for i in range(n):
        transport = transports[i % len(transports)]
        topology = rnd.choice(("mesh", "ring"))
        world = rnd.randint(2, 6)
        faults = ("kill", "stop", "linkdown") if transport == "verbs" else ("kill", "stop")
        fault = rnd.choice(faults)
        moments = [m for m in MOMENTS if m != "relay" or (topology == "ring" and world >= 4)]
        moment = rnd.choice(moments)
        victim = -1 if fault == "linkdown" else rnd.randrange(world)
        cases.append(Case(transport, topology, world, fault, moment, victim,
                          call=rnd.randint(1, 6), delay_ms=rnd.uniform(0, 20),
                          seed=seed * 1000 + i))
    return cases


def _draw_extended(n: int, seed: int, device: str, max_world: int) -> list[Case]:
    rnd = random.Random(f"extended/{seed}")
    transports = ("shm",) if device.startswith("cuda") else ("shm", "tcp", "verbs")
    cases = []
    for i in range(n):
        transport = transports[i % len(transports)]
        topology = rnd.choice(("mesh", "ring"))
        world = rnd.randint(2, max_world)
        if rnd.random() < 0.25:  # slow but alive: must not fail
            fault = rnd.choice(SLOW_FAULTS)
        else:
            faults = ["kill", "stop", "pyexit"] + (["linkdown", "rootdown"]
                                                   if transport == "verbs" else [])
            fault = rnd.choice(faults)
        moments = [m for m in MOMENTS if m != "relay" or (topology == "ring" and world >= 4)]
        moment = "before-publish" if fault == "pyexit" else rnd.choice(moments)
        victim = -1 if fault in ("linkdown", "rootdown") else rnd.randrange(world)
        hold = rnd.uniform(0.2, TIMEOUT_S / 2) if fault == "slowstop" else \
            rnd.uniform(1.0, 4.0) if fault == "starve" else 0.0
        cases.append(Case(transport, topology, world, fault, moment, victim,
                          call=rnd.randint(1, 6), delay_ms=rnd.uniform(0, 20),
                          seed=seed * 1000 + i, hold_s=round(hold, 2), mix="all"))
    return cases


# ---- inside a rank -----------------------------------------------------------------------

def _ops(case: Case, world: int) -> list[tuple]:
    """The same list on every rank (soak.issue's ops): small collectives, and at
    ``case.call`` the big one the fault lands in (a finalize for the finalize moment).
    Enough after it that a survivor whose call completed still meets the missing rank."""
    if case.mix == "all":
        return _ops_all(case, world)
    from soak import FINALIZE_SHAPES
    rnd = random.Random(case.seed)
    ops = []
    for i in range(case.call + 40):
        s = case.seed * 1000 + i
        if i == case.call:
            if case.moment == "finalize":
                ops.append(("fin", s, (200, 64, 1024, 8, False), "bfloat16"))
            else:
                per_rank = SLOT_BYTES // world
                kind = rnd.choice(("ag", "rs"))
                ops.append((kind, s, per_rank // 4, "float32"))
        else:
            u = rnd.random()
            if u < 0.1:
                ops.append(("fin", s, FINALIZE_SHAPES[0], "bfloat16"))
            else:
                kind = "ag" if u < 0.55 else "rs"
                dname = rnd.choice(("bfloat16", "float32", "float16"))
                ops.append((kind, s, rnd.choice((1, 64, 1000, 4099)), dname))
    return ops


def _ops_all(case: Case, world: int) -> list[tuple]:
    """Mix "all": every collective, small ones around the big one at ``case.call``."""
    rnd = random.Random(f"ops/{case.seed}")
    ops = []
    for i in range(case.call + 40):
        s = case.seed * 1000 + i
        if i == case.call:
            kind = "fin" if case.moment == "finalize" else rnd.choice(BIG_KINDS)
            if kind == "fin":
                ops.append(("fin", s, (200, 64, 1024, 8, False), "bfloat16"))
            elif kind == "ep":
                ops.append(("ep", s, BIG_EP, "bfloat16"))
            else:  # the slot's worth of fp32 per rank
                ops.append((kind, s, SLOT_BYTES // world // 4, "float32"))
            continue
        ops.append(_small_op(rnd, s))
    return ops


def _small_op(rnd: random.Random, s: int) -> tuple:
    """One small collective of mix "all" (soak.issue's op), drawn from ``rnd``."""
    from soak import FINALIZE_SHAPES
    u = rnd.random()
    if u < 0.08:
        return ("fin", s, rnd.choice(FINALIZE_SHAPES), "bfloat16")
    if u < 0.16:
        return ("ep", s, rnd.choice(SMALL_EP), "bfloat16")
    kind = rnd.choice(("ag", "rs", "rsz", "ar"))
    dname = rnd.choice(("bfloat16", "float32", "float16"))
    return (kind, s, rnd.choice((1, 64, 1000, 4099)), dname)


def fault_collective(case: Case) -> str:
    """The collective the fault is drawn into (the op at ``case.call``)."""
    return COLLECTIVE_NAMES[_ops(case, case.world)[case.call][0]]


class _ScriptEnds(Exception):
    """pyexit: the victim's script ends here, without close()."""


def _ports(case: Case, emunic_root, active: bool) -> None:
    import emunic
    from fakesysfs import GB10
    for dev in (ROOT0_DEVICES if case.fault == "rootdown" else GB10):
        emunic.set_port_state(emunic_root, dev, active=active)


def _fault(case: Case, store, emunic_root):
    import subprocess
    store.set("t_fault", repr(time.time()))
    if case.fault in ("linkdown", "rootdown"):
        _ports(case, emunic_root, active=False)
        return
    store.set("victim_pid", str(os.getpid()))
    if case.fault == "pyexit":
        raise _ScriptEnds()
    if case.fault == "slowstop":  # a helper wakes it: it cannot wake itself
        subprocess.Popen(["sh", "-c", f"sleep {case.hold_s}; kill -CONT {os.getpid()}"])
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    if case.fault == "starve":  # burners on every core for hold_s, this rank idle-class
        for _ in range(2 * (os.cpu_count() or 2)):  # first: they must not inherit the class
            _BURNERS.append(subprocess.Popen(["timeout", str(case.hold_s), "sh", "-c",
                                              "while :; do :; done"]))
        _demote_process()
        return
    os.kill(os.getpid(), signal.SIGKILL if case.fault == "kill" else signal.SIGSTOP)


_BURNERS: list = []  # starve: the victim's CPU burners
MAX_EXTRA_BURSTS = 500


def _bursts(case: Case, ops: list, rank: int, store):
    """(index of the first op, the ops) of each burst: ``ops`` four at a time; in a starve
    case then more bursts of small collectives for as long as the starvation lasts, so that
    the starved rank has collectives to keep up with all along (rank 0 decides each round
    and the store carries its word, so every rank issues the same)."""
    for k in range(0, len(ops), 4):
        yield k, ops[k:k + 4]
    if case.fault != "starve":
        return
    for k in range(MAX_EXTRA_BURSTS):
        if rank == 0:
            over = float(store.get("t_fault").decode()) + case.hold_s
            store.set(f"more{k}", "1" if time.time() < over else "0")
        if store.get(f"more{k}") != b"1":
            return
        rnd = random.Random(f"more/{case.seed}/{k}")
        yield len(ops) + 4 * k, [_small_op(rnd, case.seed * 1000 + 100 + 4 * k + n)
                                 for n in range(4)]


def _demote_process() -> None:
    """Every thread of this process (the proxy's, the liveness channel's too; Linux
    schedules threads, and threads made later inherit their maker's class) to SCHED_IDLE:
    it runs only in what the burners and the other ranks leave over -- below nice 19, which
    the whole campaign may already run at."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
        except ProcessLookupError:
            pass  # a thread that ended meanwhile


def _end_burners(case: Case) -> None:
    """A starve victim's burners end with its case (they must not slow the next one)."""
    for p in _BURNERS:
        try:
            p.wait(timeout=case.hold_s + 5)
        except Exception:  # noqa: BLE001 - still burning: stop it
            p.kill()
            p.wait()
    _BURNERS.clear()


def _hang_report(comm_box: list, every_s: float) -> None:
    """From DUMP_S on, every ``every_s``: this rank's thread stacks and (CUDA) the GPU
    failure words of its data plane, on stderr (a daemon thread; os.write: no io locks)."""
    def words() -> str:
        comm = comm_box[0] if comm_box else None
        dp = getattr(comm, "_dp", None)
        if dp is None or not hasattr(dp, "monitor"):
            return "no CUDA data plane"
        from sparkccl import layout
        from sparkccl.dataplane.cuda_runtime import u64_at
        w = {n: int(u64_at(dp.ctl + getattr(layout, n)).value)
             for n in ("CTL_ABORT", "CTL_GPU_STATUS", "CTL_GPU_DETAIL", "CTL_GPU_SEQ",
                       "CTL_GPU_ACK", "CTL_GPU_MODE")}
        t = dp.monitor._thread
        return (f"{w} last seq {dp.last_seq} report "
                f"{dp.monitor.failure_report!r} watchdog alive "
                f"{bool(t and t.is_alive())} stuck {dp.monitor.stuck}")

    def loop():
        time.sleep(DUMP_S)
        while True:
            try:
                text = words()
            except Exception as e:  # noqa: BLE001 - a report must not kill the thread
                text = f"(words unreadable: {e!r})"
            os.write(2, f"\n== still running after {time.monotonic() - t0:.0f} s; GPU words: "
                        f"{text}\n".encode())
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            time.sleep(every_s)
    t0 = time.monotonic()
    threading.Thread(target=loop, daemon=True, name="campaign-hang-report").start()


def campaign_job(rank, world, store, case: Case, device, log_dir, emunic_root):
    # This rank's stderr to a file: a survivor killed by a CUDA error leaves its text there.
    fd = os.open(os.path.join(log_dir, f"rank{rank}.err"), os.O_WRONLY | os.O_CREAT, 0o644)
    os.dup2(fd, 2)
    comm_box: list = []
    _hang_report(comm_box, DUMP_S)
    import torch
    import sparkccl
    from sparkccl.errors import CollectiveError
    from sparkccl.reference import bits
    from soak import issue, reference
    dev = torch.device(device)
    ops = _ops(case, world)
    injector = case.victim == rank or (case.victim < 0 and rank == 0)
    wrong, returned, token = [], 0, None

    def to(t):
        return t.to(dev)

    # Every expected result first, while no communicator waits on this rank: checking a
    # burst must not keep a rank from its next collective (the big finalize's numpy
    # reference takes seconds on a loaded machine, and a peer already waiting in the next
    # collective would time out on the harness, not on sparkccl). The starve case's extra
    # small collectives are checked as they come (milliseconds).
    wants = [reference(op, rank, world) for op in ops]
    comm = sparkccl.Communicator(store=store, rank=rank, world_size=world,
                                 topology=case.topology, transport=case.transport,
                                 device=device, slot_bytes=SLOT_BYTES, timeout_s=TIMEOUT_S,
                                 bootstrap_timeout_s=BOOTSTRAP_S)
    comm_box.append(comm)
    token = comm.token
    store.set(f"token{rank}", token)
    error = None
    ends = False
    state: dict = {}  # soak.issue's, for this communicator
    try:
        for first, burst_ops in _bursts(case, ops, rank, store):
            burst = []
            for i, op in enumerate(burst_ops, first):
                if injector and i == case.call:
                    if case.moment == "before-publish":
                        _fault(case, store, emunic_root)
                    else:
                        threading.Timer(case.delay_ms / 1000, _fault,
                                        (case, store, emunic_root)).start()
                burst.append((op, issue(comm, op, rank, world, to, state)))
            comm.synchronize()  # CUDA: the host ran ahead; a failure shows here at the latest
            for n, (bop, y) in enumerate(burst, first):
                returned += 1
                want = wants[n] if n < len(wants) else reference(bop, rank, world)
                got = bits(y.cpu())
                if got.size != want.size or not (got == want).all():
                    wrong.append(f"{bop[0]} seed {bop[1]}")
    except CollectiveError as e:
        error = str(e)
        t_err = time.time()
    except _ScriptEnds:
        ends = True
    finally:
        if ends:
            pass  # left open: the process ends without close() (sparkccl.lifetime)
        elif error is None:
            comm.close()
        else:
            comm.__exit__(CollectiveError, None, None)
    _end_burners(case)
    if ends:
        raise SystemExit(0)
    after = None
    if error is None:
        dt = None
    else:
        dt = t_err - float(store.get("t_fault").decode())
        if case.fault == "stop":  # a stopped victim never exits by itself
            try:
                os.kill(int(store.get("victim_pid").decode()), signal.SIGKILL)
            except ProcessLookupError:
                pass
    if case.fault in ("linkdown", "rootdown"):
        if rank == 0:
            _ports(case, emunic_root, active=True)
            store.set("ports_up", "1")
        store.wait(["ports_up"])
    # A new communicator among the survivors, in the same processes, works.
    survivors = [r for r in range(world) if r != case.victim or case.slow]
    after_token = None
    try:
        import torch.distributed as dist
        with sparkccl.Communicator(store=dist.PrefixStore("after", store),
                                   rank=survivors.index(rank), world_size=len(survivors),
                                   topology=case.topology, transport=case.transport,
                                   device=device, timeout_s=30) as c2:
            after_token = getattr(c2, "token", None)  # world 1: no shared memory, no token
            n = len(survivors)
            y = c2.all_gather(torch.full((1000,), float(c2.rank), device=dev))
            if y.view(n, -1)[:, 0].tolist() != [float(q) for q in range(n)]:
                after = f"wrong all-gather {y.view(n, -1)[:, 0].tolist()}"
    except Exception as e:  # noqa: BLE001 - reported by the driver
        after = f"{type(e).__name__}: {e}"
    return dict(error=error, dt=dt, wrong=wrong, returned=returned, token=token, after=after,
                after_token=after_token)


def fresh_job(rank, world, store, transport, device):
    import torch
    import sparkccl
    with sparkccl.Communicator(store=store, rank=rank, world_size=world, transport=transport,
                               device=device, timeout_s=60) as comm:
        y = comm.all_gather(torch.full((1000,), float(rank), device=device))
        return y.view(world, -1)[:, 0].tolist() == [float(q) for q in range(world)]


# ---- the driver --------------------------------------------------------------------------

def bound_s(case: Case) -> float:
    """How soon after the fault every survivor must have raised: within the collective
    timeout + 1 s, whatever the fault. (Before issue 32's fix a stop on tcp / verbs had
    SPARKCCL_LIVENESS_S + 1 s: the liveness channel declared a silent peer dead; it now
    declares only exited processes and unreachable hosts dead, and a stopped process is
    the timeout's, as on shm.)"""
    return TIMEOUT_S + 1


def run_case(case: Case, device: str = "cpu", rank_timeout_s: float = 120,
             start_method: str = "spawn",
             on_failure: str | None = None) -> tuple[bool, str, float | None]:
    """(passed, why not / summary, slowest survivor's seconds from fault to error).
    ``start_method="forkserver"``: ranks forked from a warm server (main: warm_start);
    ``on_failure``: SPARKCCL_ON_FAILURE in the ranks (CUDA: stop or poison)."""
    from sparkccl.localrun import run_ranks
    from bench_record import Verdict
    with tempfile.TemporaryDirectory(prefix="fault-") as tmp:
        env = {}
        root = os.path.join(tmp, "emunic")
        if case.transport == "verbs":
            import emunic
            env = emunic.host_env(root)
            if case.fault == "rootdown":
                env["SPARKCCL_ROOTS"] = "2"
        if on_failure:
            env["SPARKCCL_ON_FAILURE"] = on_failure

        res = run_ranks(campaign_job, case.world, args=(case, device, tmp, root), env=env,
                        timeout_s=rank_timeout_s, start_method=start_method)
        verdict = Verdict(bound_s(case))
        for r in res:
            if r.rank == case.victim and not case.slow:
                if case.fault == "kill" and not r.killed:
                    verdict.problem(f"victim rank {r.rank} was not killed ({r.error_type})")
                if case.fault == "pyexit" and r.error_type != "SystemExit":
                    verdict.problem(f"victim rank {r.rank} did not end its script "
                                    f"({r.error_type}: {r.message})")
                continue
            if r.error_type == "Timeout":
                path = os.path.join(tmp, f"rank{r.rank}.err")
                tail = "(no stderr file)"
                if os.path.exists(path):
                    with open(path, errors="replace") as f:
                        tail = f.read()[-ERR_TAIL:]
                verdict.problem(f"rank {r.rank} hung; its stderr ends:\n" +
                                "\n".join("    | " + x for x in tail.splitlines()))
                continue
            if not r.ok:
                with open(os.path.join(tmp, f"rank{r.rank}.err"), errors="replace") as f:
                    err = f.read()
                # Fail-stop: died of the CUDA error after its watchdog printed the cause --
                # the report, or (the context lost by another process's trap under MPS)
                # the note with the cause the host knew; a note that knows no cause is not
                # one (CudaDataPlane._say_context_lost).
                if device.startswith("cuda") and f"sparkccl: CollectiveError: rank {r.rank}:" in err:
                    continue
                verdict.rank_failed(r)
                continue
            v = r.value
            if v["after"] is not None:
                verdict.problem(f"rank {r.rank}: a new communicator afterwards failed: "
                                f"{v['after'][:300]}")
            verdict.survivor(r.rank, v, v["dt"], must_fail=not case.slow)
            if v["after_token"] is not None:
                verdict.also_check(v["after_token"])
        verdict.check_leftovers()
        if device.startswith("cuda"):  # fail-stop survivors died: fresh processes then
            fresh = run_ranks(fresh_job, 2, args=(case.transport, device), timeout_s=120,
                              env=env, start_method=start_method)
            if not all(r.ok and r.value for r in fresh):
                verdict.problem("a new communicator afterwards failed: " +
                                "; ".join(f"rank {r.rank}: {r.error_type}: {r.message}"
                                          for r in fresh if not (r.ok and r.value)))
    return verdict.result()


def _count(results, key) -> str:
    c: dict = {}
    for r in results:
        c[key(r)] = c.get(key(r), 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(c.items()))


def table(results, device, seed: int | None = None) -> str:
    """results: (case, passed, why, slowest survivor, seconds the case took); ``seed``:
    the draw's, to name each case's --seed / --index."""
    groups: dict[tuple, list] = {}
    for case, ok, _, dt, _ in results:
        groups.setdefault((case.transport, case.fault), []).append((ok, dt, case))
    lines = [f"fault campaign, device {device}: collective timeout {TIMEOUT_S:g} s, liveness "
             f"{LIVENESS_S:g} s (exited processes, unreachable hosts); a pass = every survivor "
             "raised within its bound (timeout + 1 s), no hang, no wrong result returned, "
             "no /dev/shm left, a new communicator works; slow but alive: no rank raised, "
             "every result exact",
             f"{'transport':9} {'fault':9} {'tried':>5} {'passed':>6} {'slowest raise (s)':>18} "
             f"{'bound (s)':>9}  worlds"]
    for (t, f), rows in sorted(groups.items()):
        dts = [dt for ok, dt, _ in rows if dt is not None]
        worlds = sorted({c.world for _, _, c in rows})
        lines.append(f"{t:9} {f:9} {len(rows):>5} {sum(ok for ok, _, _ in rows):>6} "
                     f"{max(dts) if dts else 0:>18.2f} {bound_s(rows[0][2]):>9g}  "
                     f"{worlds[0]}-{worlds[-1]}")
    lines.append(f"{'total':19} {len(results):>5} {sum(r[1] for r in results):>6}")
    slow = [r for r in results if r[0].slow]
    why = [r[2] for r in results]
    lines.append(f"slow but alive (slowstop, starve): {len(slow)} cases, "
                 f"{sum(1 for r in slow if 'FALSE POSITIVE' in r[2])} with a false positive")
    lines.append(f"wrong results returned as valid: {sum('wrong data' in w for w in why)}; "
                 f"hung ranks: {sum(' hung;' in w for w in why)}; cases with /dev/shm left: "
                 f"{sum('/dev/shm left' in w for w in why)}")
    over = max((r[3] or 0) / bound_s(r[0]) for r in results) if results else 0
    lines.append(f"slowest survivor against its bound: {over:.0%} of it at most")
    lines.append("faults by the collective they were drawn into: "
                 + _count(results, lambda r: COLLECTIVE_NAMES[_ops(r[0], r[0].world)[r[0].call][0]]
                          if r[0].mix == "all" else "v1 mix"))
    lines.append("moments: " + _count(results, lambda r: r[0].moment))
    lines.append("topologies: " + _count(results, lambda r: r[0].topology)
                 + "; worlds: " + _count(results, lambda r: r[0].world))
    secs = sorted(r[4] for r in results)
    if secs:
        lines.append(f"seconds per case: mean {sum(secs) / len(secs):.1f}, median "
                     f"{secs[len(secs) // 2]:.1f}, max {secs[-1]:.1f}")
    lines.append("")
    lines.append("cases:")
    for case, ok, why, dt, sec in results:
        lines.append(f"  {'PASS' if ok else 'FAIL'} {case.label()}  (slowest survivor "
                     f"{dt or 0:.2f} s; {sec:.1f} s; --case {case.spec()}"
                     + ("" if seed is None else f" --seed {seed} --index {case.seed - seed * 1000}")
                     + f"){': ' + why if why else ''}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=24)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None, help="also write the table here")
    ap.add_argument("--case", action="append", default=[],
                    help="run this case (transport/topology/world/fault/victim/call/moment/"
                         "delay_ms[/hold_s[/mix]]) instead of drawn ones; repeatable")
    ap.add_argument("--index", type=int, default=0,
                    help="with --case: take the collectives of case INDEX of --seed")
    ap.add_argument("--max-world", type=int, default=6)
    ap.add_argument("--extended", action="store_true",
                    help="on CUDA too: every fault of FAULTS (the default on CPU)")
    ap.add_argument("--first", type=int, default=0, help="skip the first N drawn cases")
    ap.add_argument("--rank-timeout", type=float, default=120,
                    help="seconds before a rank counts as hung (it is then killed)")
    ap.add_argument("--spawn", action="store_true",
                    help="start every rank as a fresh interpreter (importing torch afresh), "
                         "as before issue 32's 500; default: forked from a warm server")
    ap.add_argument("--on-failure", choices=("stop", "poison"), default=None,
                    help="SPARKCCL_ON_FAILURE in the ranks (CUDA; default: the setting's)")
    ap.add_argument("--faults", default=None,
                    help="comma-separated faults (of FAULTS): run only drawn cases of these; "
                         "--cases then counts those (the draw itself is unchanged, each case "
                         "keeps its --index)")
    ap.add_argument("--transports", default=None,
                    help="comma-separated transports: as --faults, only drawn cases over these")
    ap.add_argument("--dry-run", action="store_true",
                    help="list the cases (label, collective, replay spec) and run none")
    a = ap.parse_args(argv)
    from bench_record import case_line, emit
    if a.case:
        indexed = [(a.index, parse_case(c, a.seed, a.index)) for c in a.case]
    else:
        want = set(a.faults.split(",")) if a.faults else set(FAULTS)
        if not want <= set(FAULTS):
            raise SystemExit(f"--faults {a.faults!r}: each one of {FAULTS}")
        over = set(a.transports.split(",")) if a.transports else {"shm", "tcp", "verbs"}
        # Seeds name cases seed * 1000 + index: at most 1000 indices per seed.
        drawn = draw_cases(max(1000, a.first + a.cases), a.seed, a.device, a.max_world, True if a.extended else None)
        indexed = [(i, c) for i, c in enumerate(drawn) if i >= a.first and c.fault in want
                   and c.transport in over]
        indexed = indexed[:a.cases]
    cases = [c for _, c in indexed]
    if a.dry_run:
        for (index, case) in indexed:
            print(f"{index:4} {case.label()} [{fault_collective(case)}]  --case {case.spec()} "
                  f"--seed {a.seed} --index {index}")
        return 0
    start_method = "spawn" if a.spawn else "forkserver"
    if not a.spawn:
        from sparkccl.localrun import warm_start
        warm_start()
    header = ("command: python benchmarks/fault_campaign.py " + " ".join(argv or sys.argv[1:])
              + f"\n(ranks started by {start_method}; SPARKCCL_ON_FAILURE "
              f"{a.on_failure or os.environ.get('SPARKCCL_ON_FAILURE', 'default')}; load {os.getloadavg()[0]:.1f} on "
              f"{os.cpu_count()} cores at the start)\n")
    seed = None if a.case else a.seed  # replayed cases: their --index is the one given
    results = []
    for case in cases:
        t0 = time.monotonic()
        ok, why, dt = run_case(case, a.device, a.rank_timeout, start_method, a.on_failure)
        results.append((case, ok, why, dt, time.monotonic() - t0))
        print(case_line(ok, case.label(), time.monotonic() - t0, "" if ok else why), flush=True)
        emit(header + table(results, a.device, seed), a.out, quiet=True)  # as it goes
    emit(header + table(results, a.device, seed), a.out)
    return 0 if all(r[1] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
