"""Issue 18: on the GPU a failed collective's output is never consumed as valid
(docs/CONTRACT.md "Failure behaviour").

Ranks are processes sharing one GPU (sparkccl.localrun.run_ranks). After a few checked
all-gathers the victim (the last rank) enqueues two more and is killed (SIGKILL) or stops
calling; every survivor has meanwhile enqueued a run of collectives without synchronizing
and then reads each output in order. Allowed outcomes, per output:

* mode ``stop`` (default): the exact result, or the read raises a CUDA error, and then
  stderr already holds ``sparkccl: CollectiveError: rank r: ...`` (the watchdog's report,
  printed before the trap); a call may also raise ``CollectiveError`` at once;
* mode ``poison``: the exact result, or every byte 0xFF (NaN) and then ``comm.check()``
  raises; later calls raise.

Anything else (different data that reads fine) is the silent wrong result the issue is
about, and fails the test. A trapped CUDA context is unusable, so every rank writes its
findings to a file and leaves with ``os._exit`` (test code; nothing in it is torn down).
A rank that hangs instead is killed after RUN_TIMEOUT_S; the failure message then holds
every rank's record and stderr tail, with its threads' stacks (faulthandler).

The CPU side of the same machinery (watchdog report, ack, trap, poison kernel) is tested
without a GPU in tests/test_cuda_dataplane.py (``test_fail_stop_*``, ``test_poison_*``);
:func:`test_check_on_cpu` here runs everywhere.
"""
from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time

import pytest
import torch
import torch.distributed as dist

import sparkccl
from sparkccl.dataplane import monitor
from sparkccl.localrun import check, run_ranks

# Multi-process, minutes on 2 cores: left out of the default run (README "Tests").
pytestmark = pytest.mark.slow

HAVE_GPU = torch.cuda.is_available()
TIMEOUT_S = 2.0
RUN = 8  # collectives each survivor queues without synchronizing
# A hang costs at most RUN_TIMEOUT_S (run_ranks kills the ranks); before that every rank
# dumps all its threads' stacks into its stderr file (DUMP_S, then every DUMP_S), and a
# read whose GPU work neither completes nor fails within READ_LIMIT_S is recorded as
# "stuck" (with the GPU failure record) instead of blocking in a synchronization.
RUN_TIMEOUT_S = 60
DUMP_S = 30
READ_LIMIT_S = 3 * TIMEOUT_S + 1.5 + 6  # the waits' timeouts, ACK_WAIT_NS, a margin
# Under "stop", ranks sharing one GPU trap one at a time (docs/CONTRACT.md "Failure
# behaviour": the GPU's trap lock), each holding it until its context is lost, at most
# monitor.TRAP_GRACE_S + TRAP_SETTLE_S: the last of W - 1 survivors may wait behind W - 2.
TRAP_TURN_S = monitor.TRAP_GRACE_S + monitor.TRAP_SETTLE_S


def _read_limit_s(world: int) -> float:
    stop = os.environ.get("SPARKCCL_ON_FAILURE", "stop") == "stop"
    return READ_LIMIT_S + (max(world - 2, 0) * TRAP_TURN_S if stop else 0.0)
# A CUDA error before this rank's report (its context lost by another process's trap under
# MPS): how long the rank waits for the watchdog's note (its CAUSE_WAIT_S and a margin).
LATE_NOTE_S = 3.0
CONTEXT_LOST = "the CUDA context of this process was lost before this rank's GPU wait"


SLOT_BYTES = 1 << 20


def _split_elems(world: int) -> int:
    """fp32 elements per rank of an "rs_split" chunk: 8 bytes over the largest slice one
    collective carries, so every call is two fused GPU-direct reduce-scatters (the big one
    and one of 8 bytes), the shape of the CUDA fault campaign's world-6 mesh case (call 4:
    SLOT_BYTES // world per rank, also 8 bytes over the slice)."""
    max_slice = SLOT_BYTES // world // 16 * 16
    return max_slice // 4 + 2


def _inputs(op: str, seed: int, rank: int, world: int, device):
    from sparkccl.reference import make_finalize_input, make_input
    if op == "ag":
        return make_input(seed, rank, (4096,), torch.float32).to(device)
    if op == "ar":  # 8 KiB bf16: the one-shot all-reduce (on CUDA: sccl_allreduce_*)
        return make_input(seed, rank, (4096,), torch.bfloat16).to(device)
    if op in ("rs", "ar2"):  # ar2: the two-step all-reduce (on CUDA: sccl_ar_fused_*)
        return make_input(seed, rank, (world * 1024,), torch.float32).to(device)
    if op == "rs_split":
        return make_input(seed, rank, (world * _split_elems(world),), torch.float32).to(device)
    inp = make_finalize_input(seed, rank, tokens=8 * world - 1, hidden=128, topk=4, experts_rows=9)
    return {k: (v.to(device) if v is not None else None) for k, v in inp.items()}


def _expected(op: str, seed: int, rank: int, world: int) -> bytes:
    from sparkccl.reference import (all_reduce_reference, moe_finalize_reference,
                                    reduce_scatter_reference)
    xs = [_inputs(op, seed, r, world, "cpu") for r in range(world)]
    if op in ("ar", "ar2"):
        return all_reduce_reference(xs, "sum").tobytes()
    if op == "ag":
        return torch.cat(xs).view(torch.uint8).numpy().tobytes()
    if op in ("rs", "rs_split"):
        return reduce_scatter_reference(xs, rank).tobytes()
    return moe_finalize_reference(xs, rank, 8 * world - 1, 8 * world).tobytes()


def _call(comm, op: str, x):
    if op == "ag":
        return comm.all_gather(x)
    if op == "ar":
        return comm.all_reduce(x)
    if op == "ar2":  # (forced: the size alone would take the one shot)
        return comm.all_reduce(x, regime="two_step")
    if op in ("rs", "rs_split"):
        return comm.reduce_scatter(x)
    W = comm.world_size
    return comm.moe_finalize_reduce_scatter(x["y"], x["pos"], x["weights"], x["shared"],
                                            num_tokens=8 * W - 1, padded_tokens=8 * W,
                                            y_scales=x["y_scales"])


def failstop_job(rank, world, store, topology, scenario, op, outdir, device="cuda"):
    """One rank of a fail-stop scenario; writes outdir/rank{r}.json, then os._exit."""
    err_path = os.path.join(outdir, f"rank{rank}.err")
    fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    faulthandler.dump_traceback_later(DUMP_S, repeat=True, file=sys.stderr, exit=False)
    rec = {"rank": rank, "outputs": [], "raised_at": None, "error": None}

    def finish():
        faulthandler.cancel_dump_traceback_later()
        with open(err_path) as f:
            rec["stderr"] = f.read()
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
            json.dump(rec, f)
        os._exit(0)

    try:
        if device == "cuda":
            torch.cuda.set_device(0)
        comm = sparkccl.Communicator(store=dist.PrefixStore("fs", store), rank=rank,
                                     world_size=world, device=device, topology=topology,
                                     slot_bytes=SLOT_BYTES, timeout_s=TIMEOUT_S,
                                     bootstrap_timeout_s=120)
        victim = world - 1
        # Call k uses inputs of seed k (every rank the same k): stale data of an earlier
        # call never equals the expected result.
        xs = [_inputs(op, k, rank, world, device) for k in range(3 + RUN)]
        wants = [_expected(op, k, rank, world) for k in range(3 + RUN)]
        for k in range(3):  # healthy and checked
            if _call(comm, op, xs[k]).view(torch.uint8).cpu().numpy().tobytes() != wants[k]:
                rec["error"] = "a healthy collective was wrong"
                finish()
        if rank == victim:
            for k in range(3, 5):  # in the middle of the run: two more queued, not synchronized
                _call(comm, op, xs[k])
            if scenario == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(TIMEOUT_S + 2.5)  # stalled: the survivors give up meanwhile
            rec["stalled"] = True
            finish()
        outs, dones = [], []
        t0 = time.monotonic()
        try:
            for k in range(3, 3 + RUN):
                y = _call(comm, op, xs[k])
                if device == "cuda":
                    try:
                        done = torch.cuda.Event()
                        done.record()
                    except RuntimeError as e:  # the trap came between the call and this
                        rec["raised_at"], rec["error"] = "sync", f"{type(e).__name__}: {e}"
                        _stderr_at_error(rec, err_path, rank)
                        break
                    dones.append(done)
                outs.append(y)
        except sparkccl.CollectiveError as e:
            rec["raised_at"], rec["error"] = "call", f"{type(e).__name__}: {e}"
        rec["queued"] = len(outs)
        for i, (y, want) in enumerate(zip(outs, wants[3:])):
            try:
                if device == "cuda" and not _completes(dones[i], time.monotonic() + _read_limit_s(world)):
                    rec["outputs"].append("stuck")
                    rec["stuck"] = _gpu_words(comm)
                    break
                got = y.view(torch.uint8).cpu().numpy().tobytes()
            except Exception as e:  # noqa: BLE001 - a CUDA error after the fail-stop trap
                rec["outputs"].append("raised")
                if rec["raised_at"] is None:
                    rec["raised_at"], rec["error"] = "sync", f"{type(e).__name__}: {e}"
                _stderr_at_error(rec, err_path, rank)
                break
            rec["outputs"].append("exact" if got == want else
                                  "poison" if got == b"\xff" * len(got) else "WRONG")
            if rec["outputs"][-1] == "WRONG":  # what kind of wrong: the judge's evidence
                same = sum(a == b for a, b in zip(got, want))
                ff = got.count(0xFF)
                rec.setdefault("wrong", []).append(
                    f"output {i}: {same} of {len(got)} bytes exact, {ff} bytes 0xFF, first "
                    f"difference at byte {next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)}")
        rec["elapsed_s"] = time.monotonic() - t0
        if os.environ.get("SPARKCCL_ON_FAILURE") == "poison":
            if device == "cuda":
                torch.cuda.synchronize()
            try:
                comm.check()
                rec["check"] = None
            except sparkccl.CollectiveError as e:
                rec["check"] = str(e)
            try:
                _call(comm, op, xs[0])
                rec["later"] = None
            except sparkccl.CollectiveError as e:
                rec["later"] = str(e)
    except BaseException as e:  # noqa: BLE001 - everything goes to the record
        rec["error"] = rec["error"] or f"{type(e).__name__}: {e}"
        rec["unexpected"] = True
    finish()


def _stderr_at_error(rec: dict, err_path: str, rank: int) -> None:
    """Read stderr now: was the report printed before this CUDA error reached the caller?
    If not, read it again once the watchdog had LATE_NOTE_S to print its note for a context
    lost before this rank reported (under MPS another process's trap ends every context;
    CudaDataPlane._say_context_lost): the judge accepts that note in place of the report."""
    with open(err_path) as f:
        rec["stderr_at_error"] = f.read()
    if f"sparkccl: CollectiveError: rank {rank}" in rec["stderr_at_error"]:
        return
    deadline = time.monotonic() + LATE_NOTE_S
    while time.monotonic() < deadline:
        time.sleep(0.05)
        with open(err_path) as f:
            text = f.read()
        if f"sparkccl: CollectiveError: rank {rank}" in text:
            break
    rec["stderr_after_error"] = text


def _completes(event, deadline: float) -> bool:
    """Poll instead of synchronizing (a CUDA error after the trap raises here): False if
    the GPU work neither completed nor failed by the deadline."""
    while not event.query():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _gpu_words(comm) -> dict:
    """The fail-stop words of this rank's data plane, for a stuck read's record."""
    from sparkccl import layout
    from sparkccl.dataplane.cuda_runtime import u64_at
    dp = comm._dp
    words = {name: int(u64_at(dp.ctl + getattr(layout, name)).value)
             for name in ("CTL_GPU_STATUS", "CTL_GPU_DETAIL", "CTL_GPU_SEQ", "CTL_GPU_ACK",
                          "CTL_GPU_MODE", "CTL_ABORT")}
    words["report"] = dp.monitor.failure_report
    t = dp.monitor._thread
    words["watchdog_alive"] = bool(t and t.is_alive())
    return words


SCENARIOS = [  # (on_failure, topology, world, scenario, op, extra environment): on the GPU
    ("stop", "mesh", 2, "kill", "ag", {}),
    ("stop", "mesh", 2, "stall", "ag", {}),
    ("stop", "ring", 4, "stall", "ag", {}),
    ("stop", "ring", 4, "kill", "ag", {}),
    ("stop", "mesh", 2, "kill", "rs", {}),
    ("stop", "mesh", 2, "stall", "fin", {}),
    ("stop", "mesh", 2, "stall", "ag", {"SPARKCCL_DIRECT_MODE": "ce"}),
    ("stop", "mesh", 2, "kill", "ag", {"SPARKCCL_GPU_DIRECT": "0"}),
    ("poison", "mesh", 2, "kill", "ag", {}),
    ("poison", "ring", 4, "stall", "ag", {}),
    ("poison", "mesh", 2, "stall", "rs", {}),
    ("poison", "mesh", 2, "kill", "ag", {"SPARKCCL_DIRECT_MODE": "ce"}),
    # The fault campaign's hung case (world 6 mesh, a kill inside a run of fused GPU-direct
    # reduce-scatters split in two per call), at the smallest world with two survivors.
    ("stop", "mesh", 3, "kill", "rs_split", {}),
    ("poison", "mesh", 3, "kill", "rs_split", {}),
    # The same with the copy engines: stream value waits, which watch no abort word.
    ("stop", "mesh", 3, "kill", "rs_split", {"SPARKCCL_DIRECT_MODE": "ce"}),
    # The one-shot all-reduce (one kernel: publish, wait, sum), GPU-direct and proxy path.
    ("stop", "mesh", 2, "kill", "ar", {}),
    ("stop", "mesh", 2, "kill", "ar", {"SPARKCCL_GPU_DIRECT": "0"}),
    ("poison", "mesh", 2, "kill", "ar", {}),
    ("poison", "ring", 4, "stall", "ar", {}),
    ("stop", "ring", 4, "stall", "ar", {"SPARKCCL_GPU_DIRECT": "0"}),
    # The two-step all-reduce (one fused kernel: the reduce-scatter and all-gather parts).
    ("stop", "mesh", 2, "kill", "ar2", {}),
    ("stop", "mesh", 2, "kill", "ar2", {"SPARKCCL_GPU_DIRECT": "0"}),
    ("poison", "ring", 4, "stall", "ar2", {}),
]


def _id(s):
    mode, topo, world, scenario, op, env = s
    extra = "-".join(f"{k.split('_', 1)[1].lower()}={v}" for k, v in env.items())
    return "-".join(filter(None, [mode, f"{topo}{world}", scenario, op, extra]))


@pytest.mark.parametrize("mode,topology,world,scenario,op,env", SCENARIOS, ids=map(_id, SCENARIOS))
@pytest.mark.cuda
@pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA GPU: torch.cuda.is_available() is False")
def test_failed_collective_is_never_consumed_as_valid(mode, topology, world, scenario, op, env,
                                                      tmp_path):
    _run_scenario(mode, topology, world, scenario, op, env, tmp_path, "cuda")


@pytest.mark.parametrize("mode,world,scenario,op", [("stop", 2, "kill", "ag"),
                                                     ("poison", 2, "stall", "ag"),
                                                     ("stop", 2, "kill", "ar"),
                                                     # (killed: ar's; ar2 stalled below)
                                                     pytest.param("stop", 2, "kill", "ar2",
                                                                  marks=pytest.mark.extended),
                                                     ("poison", 3, "stall", "ar2"),
                                                     ("stop", 3, "kill", "rs_split")])
def test_the_same_scenarios_on_cpu_raise_at_the_call(mode, world, scenario, op, tmp_path):
    """The harness on the CPU data plane, where the failing call itself raises (and checks
    the harness without a GPU)."""
    _run_scenario(mode, "mesh", world, scenario, op, {}, tmp_path, "cpu")


def _run_scenario(mode, topology, world, scenario, op, env, tmp_path, device):
    label = _id((mode, topology, world, scenario, op, env)) + ("" if device == "cuda" else "-cpu")
    env = dict(env, SPARKCCL_ON_FAILURE=mode)
    t0 = time.monotonic()
    results = run_ranks(failstop_job, world,
                        args=(topology, scenario, op, str(tmp_path), device),
                        env=env, timeout_s=RUN_TIMEOUT_S)
    victim = world - 1
    lines = [f"{label}: {time.monotonic() - t0:.1f} s"]
    problems = []
    for r in range(world):
        path = tmp_path / f"rank{r}.json"
        if r == victim:
            continue
        if not path.exists():
            problems.append(f"rank {r}: no record (hung or died)")
            continue
        rec = json.loads(path.read_text())
        lines.append(f"  rank {r}: outputs {rec['outputs']} raised at {rec['raised_at']}: "
                     f"{(rec['error'] or '')[:300]}")
        if rec.get("unexpected"):
            problems.append(f"rank {r}: unexpected {rec['error']}")
        if "stuck" in rec["outputs"]:
            problems.append(f"rank {r}: an output neither completed nor failed on the GPU "
                            f"within its read limit ({READ_LIMIT_S:g} s, + {TRAP_TURN_S:g} s "
                            f"per survivor ahead in the trap queue under stop); fail-stop "
                            f"words: {rec.get('stuck')}")
        if "WRONG" in rec["outputs"]:
            problems.append(f"rank {r}: wrong data read silently: {rec['outputs']} {rec.get('wrong')}")
        if rec["raised_at"] is None and "poison" not in rec["outputs"]:
            problems.append(f"rank {r}: nothing raised and nothing poisoned: {rec['outputs']}")
        if device == "cpu" and rec["raised_at"] != "call":
            problems.append(f"rank {r}: on the CPU the failing call must raise")
        if mode == "stop":
            if "poison" in rec["outputs"]:
                problems.append(f"rank {r}: poisoned output in mode stop")
            if rec["raised_at"] == "sync":
                found, report = _sync_report_problems(rec, r, world, victim)
                problems += found
                lines.append(f"  rank {r} stderr: {report.strip()[:400]}")
        else:
            if "raised" in rec["outputs"]:
                problems.append(f"rank {r}: a CUDA error in mode poison")
            if not rec.get("check"):
                problems.append(f"rank {r}: comm.check() did not raise after the failure")
            if not rec.get("later"):
                problems.append(f"rank {r}: a later call did not raise")
            seen = rec["outputs"]
            if "poison" in seen and "exact" in seen[seen.index("poison"):]:
                problems.append(f"rank {r}: an exact output after a poisoned one: {seen}")
    if problems:
        lines += _every_rank(tmp_path, world, results)
    print("\n".join(lines))
    assert not problems, "\n".join(problems + lines)


def _sync_report_problems(rec: dict, r: int, world: int, victim: int) -> tuple[list, str]:
    """Mode stop, a CUDA error at a read: (problems, the stderr judged). The report must
    be on stderr before the error reached the caller -- or, for a context lost from outside
    before this rank reported (MPS), the watchdog's CollectiveError note for it, with the
    host's cause, within LATE_NOTE_S; a lost context with no cause known, or nothing at all,
    is a failure."""
    problems = []
    report = rec.get("stderr_at_error", "")
    if f"sparkccl: CollectiveError: rank {r}" not in report:
        late = rec.get("stderr_after_error", "")
        note = [x for x in late.splitlines()
                if x.startswith(f"sparkccl: CollectiveError: rank {r}:") and CONTEXT_LOST in x]
        if not note:
            problems.append(f"rank {r}: the CUDA error came without the report first (nor a "
                            f"cause for a lost context within {LATE_NOTE_S:g} s); stderr: "
                            f"{(late or report)[-500:]!r}")
        report = late
    if world == 2 and not (f"rank {victim}" in report or f"peer {victim}" in report):
        problems.append(f"rank {r}: the report does not name the peer: {report!r}")
    return problems, report


def test_a_cuda_error_needs_the_report_or_the_context_lost_note():
    """The judge of a survivor's CUDA error (mode stop): the report printed first passes; a
    context lost from outside passes only with the watchdog's CollectiveError note naming
    the host's cause; a silent survivor, or one whose note says no cause is known, fails."""
    report = ("sparkccl: CollectiveError: rank 0: timed out after 2 s waiting for all_gather "
              "seq 4 piece 0 from rank 1 (connection: ...)\n")
    note = ("sparkccl: CollectiveError: rank 0: communicator aborted: rank 0: peer 1 (pid 7) "
            f"exited; {CONTEXT_LOST} reported anything (under MPS ...)\n")
    unknown = (f"sparkccl: rank 0: {CONTEXT_LOST} reported anything (...), and no failure of "
               "this communicator is known to the host\n")
    judge = lambda rec: _sync_report_problems(rec, 0, 2, 1)[0]  # noqa: E731
    assert judge({"stderr_at_error": report}) == []
    assert judge({"stderr_at_error": "", "stderr_after_error": note}) == []
    assert judge({"stderr_at_error": "", "stderr_after_error": ""})
    assert judge({"stderr_at_error": "", "stderr_after_error": unknown})
    assert judge({"stderr_at_error": "", "stderr_after_error": report.replace("rank 1", "x")})


def _every_rank(tmp_path, world: int, results) -> list[str]:
    """On failure: each rank's (the victim's too) exit, record and stderr tail (where a
    hung rank's stack dumps are)."""
    out = []
    for r in range(world):
        res = results[r]
        out.append(f"---- rank {r}: {res.error_type or 'exited'} {res.message or ''} "
                   f"(exit code {res.exitcode})")
        path = tmp_path / f"rank{r}.json"
        if path.exists():
            rec = json.loads(path.read_text())
            rec.pop("stderr", None)
            rec.pop("stderr_at_error", None)
            out.append(f"  record: {json.dumps(rec)[:1500]}")
        else:
            out.append("  no record")
        err = tmp_path / f"rank{r}.err"
        tail = err.read_text(errors="replace")[-6000:] if err.exists() else "(no stderr file)"
        out.append("  stderr tail:\n" + "\n".join("    " + x for x in tail.splitlines()))
    return out


# ---------------------------------------------------------------- poison-mode recovery

def recovery_job(rank, world, store, device):
    """Mode poison (set by the caller): a failure, then a new communicator in the same
    process, on the same GPU context, bit-exact (docs/CONTRACT.md "Failure behaviour": what a
    caller must do in that mode)."""
    if device == "cuda":
        torch.cuda.set_device(0)
    rec = {}

    def make(prefix):
        return sparkccl.Communicator(store=dist.PrefixStore(prefix, store), rank=rank,
                                     world_size=world, device=device, slot_bytes=SLOT_BYTES,
                                     timeout_s=TIMEOUT_S, bootstrap_timeout_s=120)

    def gather(comm, k):
        x = _inputs("ag", k, rank, world, device)
        return comm.all_gather(x).view(torch.uint8).cpu().numpy().tobytes() == \
            _expected("ag", k, rank, world)

    comm = make("rec1")
    rec["healthy"] = gather(comm, 0)
    if rank == world - 1:
        time.sleep(TIMEOUT_S + 2.5)  # stalls: the others' next all-gather fails meanwhile
    else:
        try:
            y = comm.all_gather(_inputs("ag", 1, rank, world, device))
            if device == "cuda":
                torch.cuda.synchronize()  # what the caller does first in this mode ...
            rec["poisoned"] = y.view(torch.uint8).cpu().numpy().tobytes() == \
                b"\xff" * y.numel() * 4
        except sparkccl.CollectiveError:  # the CPU data plane raises at the call
            rec["poisoned"] = None
        try:
            comm.check()  # ... then this, before any output leaves the program
            rec["check"] = None
        except sparkccl.CollectiveError as e:
            rec["check"] = str(e)
    comm.close()  # the failed communicator: released, its outputs dropped
    comm = make("rec2")
    rec["after"] = [gather(comm, k) for k in (2, 3, 4)]
    comm.close()
    return rec


@pytest.mark.parametrize("device", [
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not HAVE_GPU, reason="needs a CUDA GPU: torch.cuda.is_available() is False")]),
    "cpu"])
def test_poison_mode_recovers_with_a_new_communicator(device):
    """On the GPU the failed all-gather returns and its output reads NaN; on the CPU (the
    harness check) it raises at the call. Either way check() raises and a new communicator
    in the same processes is exact."""
    values = check(run_ranks(recovery_job, 2, args=(device,), timeout_s=RUN_TIMEOUT_S + 30,
                             env={"SPARKCCL_ON_FAILURE": "poison"}))
    assert all(v["healthy"] for v in values), values
    assert values[0]["check"] and "rank 0" in values[0]["check"], values
    assert values[0]["poisoned"] is (True if device == "cuda" else None), values
    assert values[0]["after"] == [True] * 3 and values[1]["after"] == [True] * 3, values


# ---------------------------------------------------------------- check() on the CPU

def check_job(rank, world, store):
    comm = sparkccl.Communicator(store=dist.PrefixStore("chk", store), rank=rank,
                                 world_size=world, timeout_s=1.0, bootstrap_timeout_s=60,
                                 slot_bytes=1 << 16)
    comm.check()  # healthy: returns
    out = {"healthy": comm.all_gather(torch.arange(3)).tolist()}
    comm.check()
    if rank == 1:
        comm.close()  # rank 1 leaves; rank 0's next collective times out
        return out
    try:
        comm.all_gather(torch.arange(3))
        out["call"] = None
    except sparkccl.CollectiveError as e:
        out["call"] = str(e)
    try:
        comm.check()
        out["check"] = None
    except sparkccl.CollectiveError as e:
        out["check"] = str(e)
    comm.close()
    with pytest.raises(ValueError, match="closed"):
        comm.check()
    return out


def test_check_on_cpu():
    values = check(run_ranks(check_job, 2, timeout_s=120))
    assert values[0]["healthy"] == values[1]["healthy"] == [0, 1, 2, 0, 1, 2]
    assert values[0]["call"] and values[0]["check"], values[0]
    assert "failed earlier" in values[0]["check"] and "rank 0" in values[0]["check"]
