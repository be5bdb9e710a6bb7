"""The CUDA data plane's failure monitor: what turns a failed GPU wait into a
:class:`CollectiveError` and makes sure no GPU work outlives a failure unbounded.

* the watchdog thread (:meth:`FailureMonitor._run`): polls the GPU failure record
  (``layout.CTL_GPU_STATUS``), reports it (the error, which also sets the abort word so the
  proxy tells the peers; printed on stderr in mode "stop") and answers the failing kernel's
  handshake (``CTL_GPU_ACK``);
* the fail-stop trap lock (:mod:`.trap_lock`): in mode "stop" the kernel is held
  (ACK_HOLD) until this process's turn of the GPU's trap lock, then told to trap (ACK_GO);
* poison (mode "poison"): the kernels overwrite the outputs themselves; the monitor only
  answers ACK_GO;
* the host release of stuck waits (:meth:`FailureMonitor._release_waits_once`): once the
  communicator failed and the GPU work has not ended STOP_GRACE_S later, the progress and
  dead words are written from the host, so that waits that watch no abort word (mode
  "ce"'s stream value waits) move on; :meth:`FailureMonitor.wait_last` raises after
  RELEASE_GRACE_S more and marks the plane ``stuck``.

The contract with the plane (and through it the engines): the plane hands the monitor the
event after its latest collective (``latest_event``), its failure record and abort word
(``check_status``, ``check_abort``, ``ctl``, ``nat``), its state words
(``state``) and its device seam (``gpu``: event queries, the release of waits); the
engines never see the monitor: every collective they issue ends in the plane's event.
"""
from __future__ import annotations

import ctypes
import os
import threading
import time

from .. import layout
from ..errors import CollectiveError
from ..plan.model import decode_flag_word
from .base import OP_NAMES
from .cuda_runtime import u64_at as _u64
from .trap_lock import TrapLock

_P = layout.protocol_constants()
_GPU_STATUS_WORD = layout.CTL_GPU_STATUS // 8
NO_SOURCE, NO_WORD = _P["NO_SOURCE"], _P["NO_WORD"]  # GPU record: no source, no flag word
CTL_GPU_ACK = layout.CTL_GPU_ACK
WATCHDOG_POLL_S = 0.002  # the kernel waits ACK_WAIT_NS (1.5 s) for the report, then traps
# Mode stop, after the report: the watchdog writes ACK_HOLD, which keeps the failing kernel
# waiting (up to HOLD_WAIT_NS from the start of its wait) until this process's turn of the
# GPU's trap lock (.trap_lock: two processes time-slicing a GPU that trap at once can wedge
# the driver); then ACK_GO, and the kernel traps. The watchdog tries the lock for at most
# TRAP_LOCK_WAIT_S (then GO anyway, said on stderr), so GO comes before the kernel's own bound,
# and keeps it until its context is lost, TRAP_SETTLE_S more (the driver's handling of the
# trap done before the next process's trap), or TRAP_GRACE_S after GO.
ACK_GO, ACK_HOLD = _P["ACK_GO"], _P["ACK_HOLD"]
HOLD_WAIT_S = _P["HOLD_WAIT_NS"] / 1e9
TRAP_LOCK_WAIT_S = HOLD_WAIT_S - 5.0
TRAP_SETTLE_S = 0.2
TRAP_WAIT_SAID_S = 0.01  # a wait for the lock this long is said on stderr
# After the GO, how long the watchdog waits for the trap to end this process's GPU work
# before it says on stderr that the GPU is wedged (see _run, _say_trap_wedged).
TRAP_GRACE_S = _P["ACK_WAIT_NS"] / 1e9 + 8.0
# The context was lost before this data plane reported anything (another process's trap
# under MPS): how long the watchdog waits for the cause (the abort word the proxy sets when
# a peer failed) before it prints what the host knows (_say_context_lost).
CAUSE_WAIT_S = 0.5
PROG_FAILED = _P["FAILED"]  # progress word: seq * PROG_STRIDE + PROG_FAILED = that seq failed
# Once the communicator failed, a failing wait traps (stop) or returns (poison) within
# ACK_WAIT_NS, and every wait queued after it gives up as it starts: the GPU work of this
# data plane ends within STOP_GRACE_S of the failure, or something waits that never looks
# at the abort word (see wait_last). While the fail-stop handshake holds the kernel for its
# turn to trap (ACK_HOLD, at most HOLD_WAIT_S), the grace counts from the GO instead.
STOP_GRACE_S = _P["ACK_WAIT_NS"] / 1e9 + 1.0
# After _release_waits, before the host gives up on the GPU: what a released kernel may take
# to fail (in mode stop it too waits up to ACK_WAIT_NS for the report before it traps; a
# hold extends this one as well).
RELEASE_GRACE_S = _P["ACK_WAIT_NS"] / 1e9 + 0.5
# What _release_waits writes to the progress word: above seq * PROG_STRIDE + PROG_FAILED of
# any seq, so every waiter of every collective sees FAILED (the host does not know the
# device's seq once graphs replay).
RELEASED_PROGRESS = 1 << 62


def write_stderr(line: str) -> None:
    """From the watchdog thread: straight to fd 2, never through sys.stderr (its buffer lock
    may be held by a thread that is itself waiting for the GPU)."""
    try:
        os.write(2, line.encode("utf-8", "replace"))
    except OSError:
        pass

class FailureMonitor:
    """One per CUDA data plane (``plane.monitor``); see the module docstring. Attributes a
    test or a caller reads: ``failure_report`` (what the watchdog printed), ``stuck`` (the
    GPU work did not end after a failure), ``trap_wedged`` (the GPU still busy after the
    trap), the fail-stop handshake's ``trap_held_at`` / ``trap_go_at`` (monotonic s), and
    the bounds ``trap_grace_s`` / ``trap_lock_wait_s`` (tunable in tests)."""

    def __init__(self, plane, trap_lock_path: str | None):
        self.plane = plane
        self.failure_report: str | None = None
        self.stuck = False
        self.trap_grace_s = TRAP_GRACE_S
        self.trap_wedged = False
        self.trap_lock_path = trap_lock_path
        self.trap_lock_wait_s = TRAP_LOCK_WAIT_S
        self.trap_held_at: float | None = None
        self.trap_go_at: float | None = None
        self._trap_lock: TrapLock | None = None
        self._watch_stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._released, self._release_lock = False, threading.Lock()  # _release_waits_once
        # The control block's words: the GPU record's code word, read in place by the
        # watchdog (x86 and arm64 loads of aligned words are atomic).
        self._words = memoryview((ctypes.c_uint8 * layout.CTL_BYTES).from_address(
            plane.ctl)).cast("B").cast("Q")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"sparkccl-gpu-watchdog-{self.plane.rank}")
        self._thread.start()

    def _release_waits_once(self) -> None:
        """release_waits, once per data plane (the watchdog and wait_last both may)."""
        with self._release_lock:
            if self._released:
                return
            self._released = True
            try:
                self._release_waits()
            except RuntimeError:
                pass  # best effort: wait_last raises after RELEASE_GRACE_S either way

    def _release_waits(self) -> None:
        """Write what every wait of this data plane waits for: the dead word, then the
        progress word at RELEASED_PROGRESS (above FAILED of any seq, also of replays the host
        did not count), so that stream value waits (mode "ce") and consumer blocks move on
        and every kernel after them fails at once. From the host, on a stream of its own: the
        caller's streams are the ones that are stuck."""
        self.plane.gpu.release_waits(self.plane.state, 1, RELEASED_PROGRESS)

    def wait_last(self) -> None:
        """Wait until the GPU passed the latest collective. While the communicator is
        healthy that takes as long as it takes (the caller's own work queued before it
        counts too; every sparkccl wait has its own GPU-clock timeout). Once it failed
        (abort word or GPU record), the GPU has STOP_GRACE_S to get there; past that,
        something waits that does not watch the abort word (a stream value wait, whose
        releasing kernel never ran): _release_waits, RELEASE_GRACE_S more, then raise
        CollectiveError (a survivor never blocks without bound) and mark the data plane
        stuck, so that close() leaves the pinned memory the GPU may still use alone."""
        ev = self.plane.latest_event(keep=True)
        if ev is None:
            if self.plane.captured:  # nothing eager to find the stream by: the whole device
                self.plane.gpu.synchronize()
            return
        deadline, released, spins = None, False, 0
        while not self.plane.gpu.event_done(ev):
            now = time.monotonic()
            if self.stuck:  # it was released already: no second grace
                raise self._stuck_error()
            if deadline is None:
                if self.failure_known():
                    deadline = now + STOP_GRACE_S
            elif self._trap_held(now):  # the grace counts from the GO (see STOP_GRACE_S)
                deadline = max(deadline, now + (RELEASE_GRACE_S if released else STOP_GRACE_S))
            elif now > deadline:
                if released:
                    self.stuck = True
                    raise self._stuck_error()
                self._release_waits_once()  # (or the watchdog did, a moment ago)
                released, deadline = True, now + RELEASE_GRACE_S
            # Yield at first (a collective's last microseconds), then naps of at most
            # 200 us: what a synchronization may lose to the polling.
            spins += 1
            time.sleep(0 if spins < 64 else min(20e-6 * (spins - 63), 200e-6))

    def _trap_held(self, now: float) -> bool:
        """Is the failing kernel held for its turn to trap (ACK_HOLD written, no GO yet)?
        Bounded by the kernel's own HOLD_WAIT_NS, so a watchdog that stopped does not
        stretch the host's bounds for longer than the kernel waits."""
        held = self.trap_held_at
        return held is not None and self.trap_go_at is None and now < held + HOLD_WAIT_S

    def failure_known(self) -> bool:
        return bool(self.plane.nat.abort_code(self.plane.ctl) or self._words[_GPU_STATUS_WORD])

    def gpu_record(self) -> tuple[int, int, int, int, int]:
        """(code, source, flag word, piece, seq) of the GPU failure record (code 0: none)."""
        code = self._words[_GPU_STATUS_WORD]
        if not code:
            return 0, 0, 0, 0, 0
        ctl = self.plane.ctl
        detail = _u64(ctl + layout.CTL_GPU_DETAIL).value
        seq = _u64(ctl + layout.CTL_GPU_SEQ).value
        return int(code), detail >> 32, (detail >> 8) & 0xFFFF, detail & 0xFF, int(seq)

    def raise_record(self) -> None:
        """Raise the failure a kernel recorded in the GPU record as the
        :class:`CollectiveError` naming rank, seq, piece, peer and connection (also setting
        the abort word, so the proxy tells the peers)."""
        p = self.plane
        code, source, word, piece, seq = self.gpu_record()
        if not code:
            return
        name = p.name_of(seq)
        what = f"{name} seq {seq}" if name is not None else f"collective seq {seq}"
        if code != layout.ABORT_TIMEOUT or source == NO_SOURCE:
            if p.nat.abort_code(p.ctl):
                waited = ("" if source == NO_SOURCE
                          else f" (waiting for piece {piece} from rank {source})")
                p.raise_recorded(p.nat.abort_code(p.ctl), what + waited)
            if source == NO_SOURCE:
                p.fail(f"rank {p.rank}: {what}: a GPU wait gave up (the communicator had "
                       "already failed, or the wait ran past its timeout: for a peer's "
                       "flag, or for space in the publish ring)", int(code))
            p.fail(f"rank {p.rank}: {what} piece {piece}: the GPU wait saw abort code "
                   f"{code}", int(code))
        p.check_sizes()  # a peer that made another call (of another op) is the cause
        if word == NO_WORD or name is None:
            p.fail(f"rank {p.rank}: timed out after {p.timeout_s:g} s waiting for {what} "
                   f"piece {piece} from rank {source}", layout.ABORT_TIMEOUT, peer=source)
        note = "; GPU wait"
        if name == "all_reduce":  # (one collective of two ops: the flag word says which part)
            note += f" of its {OP_NAMES[decode_flag_word(p.world, word)[0]]} part"
        p.timed_out(what, piece, word, note)

    def _stuck_error(self) -> CollectiveError:
        code, source, word, piece, seq = self.gpu_record()
        cause = self.plane.nat.error_text(self.plane.ctl) or (f"GPU wait of seq {seq} failed (code {code})"
                                                  if code else "aborted")
        record = (f"GPU failure record: code {code}, seq {seq}, piece {piece}, source {source}, "
                  f"flag word {word}" if code else "no GPU failure record")
        return CollectiveError(
            f"rank {self.plane.rank}: the communicator failed ({cause}), and its GPU work (up to seq "
            f"{self.plane.last_seq}{', and graph replays after it' if self.plane.captured else ''}) still "
            f"had not ended {STOP_GRACE_S + RELEASE_GRACE_S:g} s later, "
            f"also after the host released its waits ({record}); the GPU is stuck: restart "
            "the process", rank=self.plane.rank, cause=cause)

    def busy(self) -> bool:
        ev = self.plane.latest_event()  # (the watchdog, after a failure)
        return ev is not None and not self.plane.gpu.event_done(ev)

    def _run(self) -> None:
        """A daemon thread per data plane: polls the GPU failure record; once a kernel wrote
        one, builds the :class:`CollectiveError` (which also sets the abort word, so the
        proxy tells the peers at once), prints it on stderr in mode "stop" (the kernel is
        about to trap, and the caller will only see a generic CUDA error), then answers the
        kernel: ACK_GO in mode "poison"; in mode "stop" ACK_HOLD, then ACK_GO once this
        process holds the GPU's trap lock (:meth:`_trap_turn`). Once the communicator
        failed, it also releases the GPU's waits if the GPU work has not ended STOP_GRACE_S
        later (from the GO, if the kernel was held); if the context is lost before anything
        was reported, it says so with the cause the host knows (:meth:`_say_context_lost`).
        It ends when the failure was reported, the trap's turn is over and nothing of this
        data plane runs any more."""
        words = self._words
        reported, failed_at = False, None
        try:
            while not self._watch_stop.wait(WATCHDOG_POLL_S):
                if not reported and words[_GPU_STATUS_WORD]:
                    self._report_gpu_failure()
                    reported = True
                now = time.monotonic()
                if self.trap_held_at is not None and self.trap_go_at is None:
                    self._trap_turn(now)
                # Then the host's bound (see _wait_last), from here too: the caller may be
                # blocked in a synchronization of its own (.cpu(), a stream or event wait),
                # which only ends when the GPU work does.
                if failed_at is None:
                    if self.failure_known():
                        failed_at = now
                    continue
                lost = False
                try:
                    busy = self.busy()
                except RuntimeError:
                    busy, lost = False, True  # the context is lost: nothing of it runs any more
                if lost and not reported:
                    self._say_context_lost()
                    reported = True
                if not busy:
                    if self._trap_lock is not None and self._trap_lock.held:
                        self._watch_stop.wait(TRAP_SETTLE_S)  # the driver done with the trap
                        self._trap_lock.release()
                    if reported and (self.trap_held_at is None or self.trap_go_at is not None
                                     or lost):
                        return
                    continue
                if self._trap_held(now):
                    failed_at = now  # (STOP_GRACE_S from the GO)
                elif not self._released and now > failed_at + STOP_GRACE_S:
                    self._release_waits_once()
                if (self.plane.on_failure == "stop" and self.trap_go_at is not None
                        and not self.trap_wedged and now > self.trap_go_at + self.trap_grace_s):
                    self._say_trap_wedged()
                    if self._trap_lock is not None:
                        self._trap_lock.release()  # holding it helps no other process now
            # Stopped (close()): no kernel is left held for a turn that will not come, and a
            # lost context is still explained.
            if self.trap_held_at is not None and self.trap_go_at is None:
                self._give_go()
            if not reported:
                try:
                    self.busy()
                except RuntimeError:
                    self._say_context_lost()
        finally:
            if self._trap_lock is not None:
                self._trap_lock.release()

    def _trap_turn(self, now: float) -> None:
        """Mode "stop", the kernel held (ACK_HOLD): ACK_GO once this process holds the GPU's
        trap lock (processes sharing the GPU trap one at a time), or, said on stderr, once
        trap_lock_wait_s passed or the lock cannot be used (a hang then is still not
        silent: _say_trap_wedged)."""
        if self._trap_lock is None:
            if self.trap_lock_path is None:  # no GPU to share (a backend without one)
                self._give_go()
                return
            self._trap_lock = TrapLock(self.trap_lock_path)
        lock = self._trap_lock
        if lock.try_acquire():
            waited = now - self.trap_held_at
            if waited >= TRAP_WAIT_SAID_S:  # (the serialization shows in the ranks' stderr)
                write_stderr(f"sparkccl: rank {self.plane.rank}: fail-stop: trapping after "
                             f"{waited:.2f} s waiting for the GPU's trap lock (another "
                             "process of this GPU trapped first)\n")
            self._give_go()
            return
        if lock.error is None and now < self.trap_held_at + self.trap_lock_wait_s:
            return
        why = (f"it cannot be used ({lock.error})" if lock.error is not None else
               f"another process of this GPU held it for {self.trap_lock_wait_s:g} s")
        write_stderr(f"sparkccl: rank {self.plane.rank}: fail-stop: trapping without the GPU's trap "
                     f"lock {lock.path}: {why}\n")
        self._give_go()

    def _give_go(self) -> None:
        self.trap_go_at = time.monotonic()
        _u64(self.plane.ctl + CTL_GPU_ACK).value = ACK_GO

    def _say_context_lost(self) -> None:
        """The CUDA context is lost and this data plane reported nothing: under MPS (one
        context server for every process of the GPU) another process's fail-stop trap ends
        every client's context, often before this rank's own wait failed. The caller only
        sees a generic CUDA error; say on stderr what the host knows: the communicator's
        failure (abort word, error text; waited for CAUSE_WAIT_S, as the proxy may be
        telling it right now) as a CollectiveError, or that none is known."""
        deadline = time.monotonic() + CAUSE_WAIT_S
        while not self.failure_known() and time.monotonic() < deadline:
            time.sleep(WATCHDOG_POLL_S)
        lost = ("the CUDA context of this process was lost before this rank's GPU wait "
                "reported anything (under MPS another process's fail-stop trap on the same GPU "
                "ends every process's context)")
        cause = None
        if self.failure_known():
            try:
                self.plane.check_status()
                self.plane.check_abort()
            except CollectiveError as e:
                cause = str(e)
            except Exception as e:  # the note must not die: say what failed
                cause = f"rank {self.plane.rank}: the communicator failed ({e!r})"
        if cause is not None:
            text = f"{cause}; {lost}"
            line = (f"sparkccl: CollectiveError: {text}\nsparkccl: rank {self.plane.rank}: every CUDA "
                    "synchronization in this process raises a CUDA error; restart the process\n")
        else:
            text = (f"rank {self.plane.rank}: {lost}, and no failure of this communicator is known to "
                    "the host (no abort, no GPU failure record): the cause is outside its "
                    "collectives")
            line = f"sparkccl: {text}\n"
        self.failure_report = text
        write_stderr(line)

    def _say_trap_wedged(self) -> None:
        """Mode "stop": the GPU is still busy trap_grace_s after the GO, so the trap was
        not acted on -- seen on one GPU time-sliced by several processes without MPS, when
        ranks of two processes trapped at about the same time (what the trap lock is for:
        _trap_turn): each warp sat halted just past its trap and the caller's next
        synchronization waited forever inside the CUDA driver. Nothing in this process can
        end that wait (library code never kills the process), so say so on stderr, next to
        the CollectiveError already printed."""
        line = (f"sparkccl: rank {self.plane.rank}: the GPU did not stop within "
                f"{self.trap_grace_s:g} s of the fail-stop trap: this process's CUDA "
                "work is wedged and every synchronization will wait forever; kill the "
                "process. (Seen when several processes time-slice one GPU without MPS "
                "and two of them trap at once; run one rank per GPU, use MPS, or "
                "SPARKCCL_ON_FAILURE=poison; docs/CONTRACT.md \"Failure behaviour\".)\n")
        write_stderr(line)
        self.trap_wedged = True

    def _report_gpu_failure(self) -> None:
        # The kernel spins for the ack (at most ACK_WAIT_NS) before it traps: nothing here
        # may wait on the main thread. So no Python io object (sys.stderr's buffer lock may
        # be held by a thread that is itself waiting), and the ack in `finally`, whatever
        # the report did: HOLD in mode stop (the trap waits for this process's turn of the
        # GPU, _trap_turn), GO otherwise.
        try:
            try:
                self.plane.check_status()
                text = f"rank {self.plane.rank}: a GPU wait failed"
            except CollectiveError as e:
                text = str(e)
            except Exception as e:  # the report must not die before the ack
                text = f"rank {self.plane.rank}: a GPU wait failed ({e!r})"
            self.failure_report = text
            if self.plane.on_failure == "stop":
                line = (f"sparkccl: CollectiveError: {text}\nsparkccl: rank {self.plane.rank}: stopping "
                        "the GPU (device trap, SPARKCCL_ON_FAILURE=stop): the next CUDA "
                        "synchronization in this process raises a CUDA error; restart the "
                        "process\n")
                write_stderr(line)
        finally:
            if self.plane.on_failure == "stop":
                self.trap_held_at = time.monotonic()
                _u64(self.plane.ctl + CTL_GPU_ACK).value = ACK_HOLD
            else:
                self._give_go()

    def stop(self) -> None:
        """Before the control segment may be unmapped: the thread reads it."""
        stop = getattr(self, "_watch_stop", None)
        if stop is not None:
            stop.set()
        t = getattr(self, "_thread", None)
        if t is not None and t is not threading.current_thread():
            # Bounded: at interpreter shutdown a daemon thread may never run again.
            t.join(timeout=1.0)
