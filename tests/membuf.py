"""Shared by the native-layer tests: process-local memory (an anonymous shared mapping, its
numpy view and its address: what the Communicator gets from /dev/shm segments), and a poll
for a control block's abort word."""
from __future__ import annotations

import mmap
import time

import numpy as np

import sparkccl._native as N


class Buf:
    def __init__(self, nbytes: int):
        self.mm = mmap.mmap(-1, max(nbytes, 1))
        self.a = np.frombuffer(self.mm, dtype=np.uint8)
        self.addr = self.a.ctypes.data


def wait_abort(ctl_addr: int, timeout: float) -> tuple[int, str]:
    """Poll the abort word of the control block at ``ctl_addr`` until it is set or
    ``timeout`` seconds pass; returns (abort code, error text), (0, "") if never set."""
    deadline = time.monotonic() + timeout
    while N.abort_code(ctl_addr) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    return N.abort_code(ctl_addr), N.error_text(ctl_addr)
