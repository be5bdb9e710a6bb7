"""The trap lock of one GPU: processes sharing a GPU take their fail-stop traps one at a time.

On a GPU time-sliced by several processes (no MPS), two device traps at about the same time
can leave the driver wedged: on an H200 each warp sat halted just past its trap, the context
was never lost and the host's synchronization waited forever; one trap at a time ends its
context cleanly. So the watchdog of a data plane whose kernel is held before its trap
(``CTL_GPU_ACK`` = ``ACK_HOLD``, kernels/wait.cu ``stop_after_report``) takes this lock,
writes ``ACK_GO`` and keeps the lock until its own context is lost
(:mod:`sparkccl.dataplane.monitor`, the watchdog; docs/CONTRACT.md "Failure
behaviour").

``fcntl.flock`` on a file named after the GPU: only ever tried without blocking (the
watchdog bounds its own wait), released by the kernel when the process dies, and held per
open file description, so two data planes of one process exclude each other too. The file
is never removed (removing a lock file races with another process opening it).
"""
from __future__ import annotations

import fcntl
import os
import re
import tempfile


def lock_dir() -> str:
    """/dev/shm where it is writable (memory, local to the host like the GPU), else the
    temporary directory."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK):
        return "/dev/shm"
    return tempfile.gettempdir()


def lock_path(gpu_key: str) -> str:
    """The lock file of the GPU named ``gpu_key`` (its UUID: the same in every process,
    whatever CUDA_VISIBLE_DEVICES renumbers)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", gpu_key)
    return os.path.join(lock_dir(), f"sparkccl-trap-{name}.lock")


def gpu_key(device) -> str:
    """A name of torch CUDA ``device`` shared by every process on the host: the UUID,
    else the PCI address, else (old torch) the index as this process numbers it."""
    import torch
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    if uuid:
        return f"GPU-{uuid}"
    pci = [getattr(props, f"pci_{k}_id", None) for k in ("domain", "bus", "device")]
    if None not in pci:
        return "pci-{:04x}-{:02x}-{:02x}".format(*pci)
    return f"cuda{torch.device(device).index}-visible-{os.environ.get('CUDA_VISIBLE_DEVICES', 'all')}"


class TrapLock:
    """One process's hold on a GPU's trap lock (:func:`lock_path`)."""

    def __init__(self, path: str):
        self.path = path
        self.error: OSError | None = None  # why the file could not be opened (then never held)
        self.held = False
        self._fd: int | None = None

    def try_acquire(self) -> bool:
        """Take the lock if it is free; never blocks. True while held."""
        if self.held:
            return True
        if self._fd is None and self.error is None:
            self._fd = self._open()
        if self._fd is None:
            return False
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # another process's turn
        except OSError as e:
            self.error = e
            return False
        self.held = True
        return True

    def _open(self) -> int | None:
        # Read-only is enough for flock; an existing file first, because O_CREAT on another
        # user's file in a sticky directory is refused where fs.protected_regular is set.
        for flags in (os.O_RDONLY, os.O_RDONLY | os.O_CREAT):
            try:
                return os.open(self.path, flags | os.O_CLOEXEC, 0o666)
            except FileNotFoundError:
                continue
            except OSError as e:
                self.error = e
                return None
        self.error = FileNotFoundError(f"{self.path} could not be created")
        return None

    def release(self) -> None:
        """Give the lock up (closing the file does: flock is per open file description)."""
        fd, self._fd, self.held = self._fd, None, False
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
