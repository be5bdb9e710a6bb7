"""Communicators alive in this process, and what happens to them at fork and at exit.

After ``fork()`` the proxy threads and the segments belong to the parent: the child's
copies are marked closed and never torn down (stopping a proxy would join a thread that
does not exist there, and unlinking names is the parent's business). At interpreter exit
every open communicator first delivers what it still owes its peers (its proxy's pending
writes and relays of the collectives it issued, bounded by its timeout; at once when it has
failed), then is torn down without waiting for the peers to close
(``Communicator.release_at_exit``, ``Wiring.depart``): a script that ends without
``close()`` does not fail a peer still receiving its last collective.
"""
from __future__ import annotations

import atexit
import os
import threading
import weakref

_live: "weakref.WeakSet" = weakref.WeakSet()
_lock = threading.Lock()


def track(comm) -> None:
    with _lock:
        _live.add(comm)


def untrack(comm) -> None:
    with _lock:
        _live.discard(comm)


def _forget_in_forked_child() -> None:
    global _lock
    _lock = threading.Lock()  # another thread may have held it at fork time
    comms = list(_live)
    _live.clear()
    for c in comms:
        c.forget_after_fork()


def _close_all_at_exit() -> None:
    with _lock:
        comms = list(_live)
    for c in comms:
        try:
            c.release_at_exit()
        except Exception:
            pass


atexit.register(_close_all_at_exit)
os.register_at_fork(after_in_child=_forget_in_forked_child)
