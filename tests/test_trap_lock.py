"""The trap lock of one GPU (sparkccl/dataplane/trap_lock.py): holders exclude each other
within a process and across processes, a dead holder frees it, and a file that cannot be
opened is an error kept for the caller (never an exception, never a wait). The fail-stop
handshake that uses it is tested in tests/test_cuda_dataplane.py (test_fail_stop_*)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from sparkccl.dataplane.trap_lock import TrapLock, lock_dir, lock_path


def test_holders_in_one_process_exclude_each_other(tmp_path):
    path = str(tmp_path / "gpu.lock")
    a, b = TrapLock(path), TrapLock(path)
    assert a.try_acquire() and a.held
    assert a.try_acquire()  # held: still true, no second lock
    assert not b.try_acquire() and not b.held and b.error is None
    a.release()
    assert not a.held
    assert b.try_acquire()
    assert not a.try_acquire()
    b.release()
    assert a.try_acquire()
    a.release()


def test_a_killed_holder_frees_the_lock(tmp_path):
    """flock is released by the kernel when the holding process dies (a survivor killed
    during its turn never blocks the others' traps)."""
    path = str(tmp_path / "gpu.lock")
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\n"
         "from sparkccl.dataplane.trap_lock import TrapLock\n"
         f"assert TrapLock({path!r}).try_acquire()\n"
         "print('held', flush=True)\n"
         "time.sleep(60)\n"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        mine = TrapLock(path)
        assert not mine.try_acquire()  # the other process's turn
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
        deadline = time.monotonic() + 5
        while not mine.try_acquire() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert mine.held
        mine.release()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)


def test_an_unusable_lock_file_is_a_kept_error(tmp_path):
    lock = TrapLock(str(tmp_path / "missing-dir" / "gpu.lock"))
    assert not lock.try_acquire()
    assert isinstance(lock.error, OSError)
    assert not lock.try_acquire()  # not retried: the caller goes on without the lock
    lock.release()


def test_lock_path_names_the_gpu():
    p = lock_path("GPU-1a2b/3c:4d e")
    assert os.path.dirname(p) == lock_dir()
    assert os.path.basename(p) == "sparkccl-trap-GPU-1a2b_3c_4d_e.lock"
