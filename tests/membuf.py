"""Process-local memory for native-layer tests: an anonymous shared mapping, its numpy
view and its address (what the Communicator gets from /dev/shm segments)."""
from __future__ import annotations

import mmap

import numpy as np


class Buf:
    def __init__(self, nbytes: int):
        self.mm = mmap.mmap(-1, max(nbytes, 1))
        self.a = np.frombuffer(self.mm, dtype=np.uint8)
        self.addr = self.a.ctypes.data
