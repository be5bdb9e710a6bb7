"""POSIX shared-memory segments under /dev/shm.

Names are ``sparkccl-<uid>-<token>-r<rank>-<kind>``: the token is random per communicator,
so two communicators on one host never collide. A segment is created with
``O_CREAT | O_EXCL`` and mode 0600, mapped by its owner and by the peers, and unlinked as
soon as every peer has mapped it (the mappings stay valid), so a process killed later
leaves nothing behind. Close and an atexit hook unlink whatever is still named.

Segments are reserved when created (``posix_fallocate``): tmpfs files are sparse, so without
it a /dev/shm that is too small (Docker's default is 64 MiB) lets creation succeed and kills
the process with SIGBUS at the first large collective. Reserved, the shortage is a
:class:`ShmSpaceError` at creation, saying how much is needed and how to get it.
"""
from __future__ import annotations

import atexit
import ctypes
import errno
import logging
import mmap
import os
import threading

import torch

from .errors import ShmSpaceError

SHM_DIR = "/dev/shm"
PREFIX = "sparkccl-"

log = logging.getLogger("sparkccl")

_live_lock = threading.Lock()
_live: set[str] = set()  # names this process created and has not unlinked yet


def segment_name(token: str, rank: int, kind: str, uid: int | None = None) -> str:
    uid = os.getuid() if uid is None else uid
    return f"{PREFIX}{uid}-{token}-r{rank}-{kind}"


def path_of(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def unlink_name(name: str) -> bool:
    """Remove ``name`` from /dev/shm if it is there; True if this call removed it."""
    with _live_lock:
        _live.discard(name)
    try:
        os.unlink(path_of(name))
        return True
    except FileNotFoundError:
        return False
    except OSError as e:  # pragma: no cover - permissions etc.
        log.warning("sparkccl: could not remove %s: %s", path_of(name), e)
        return False


def free_bytes() -> int | None:
    """Free space of /dev/shm for this process (None if it cannot be measured)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _reserve(fd: int, name: str, size: int) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise
        free = free_bytes()
        raise ShmSpaceError(
            f"cannot reserve {_mib(size)} for {path_of(name)}: {SHM_DIR} has "
            f"{'an unknown amount' if free is None else _mib(free)} free ({e.strerror})",
            needed=size, free=free) from None


def _forget_in_forked_child() -> None:
    global _live_lock
    _live_lock = threading.Lock()  # another thread may have held it at fork time
    _live.clear()  # the parent's names: not the child's to remove


os.register_at_fork(after_in_child=_forget_in_forked_child)


@atexit.register
def _unlink_all_at_exit() -> None:
    with _live_lock:
        names = list(_live)
    for n in names:
        unlink_name(n)


class Segment:
    """One mapped segment: ``addr`` (int) for the native side, ``tensor`` (uint8) for Python."""

    def __init__(self, name: str, size: int, mm: mmap.mmap, owner: bool):
        self.name = name
        self.size = size
        self.owner = owner
        self._mm = mm
        buf = ctypes.c_char.from_buffer(mm)
        self.addr = ctypes.addressof(buf)
        del buf  # release the export so the map can be closed later
        self._tensor = None

    @classmethod
    def create(cls, name: str, size: int) -> "Segment":
        path = path_of(name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        with _live_lock:
            _live.add(name)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, size)
            _reserve(fd, name, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            unlink_name(name)
            raise
        os.close(fd)
        return cls(name, size, mm, owner=True)

    @classmethod
    def attach(cls, name: str, size: int) -> "Segment":
        fd = os.open(path_of(name), os.O_RDWR)
        try:
            actual = os.fstat(fd).st_size
            if actual != size:
                raise ValueError(f"shared segment {name} has {actual} bytes, expected {size}")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(name, size, mm, owner=False)

    @property
    def tensor(self) -> torch.Tensor:
        """A uint8 tensor over the whole segment (shares the memory)."""
        if self._tensor is None:
            import warnings
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._tensor = torch.frombuffer(self._mm, dtype=torch.uint8, count=self.size)
        return self._tensor

    def unlink(self) -> None:
        if self.owner:
            unlink_name(self.name)

    def close(self) -> None:
        """Drop the mapping. If tensors handed out still use it, the map lives until they go."""
        self._tensor = None
        mm, self._mm = self._mm, None
        if mm is None:
            return
        try:
            mm.close()
        except BufferError:
            pass  # exported to a live tensor: unmapped when that tensor is collected
