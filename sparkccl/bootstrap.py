"""Bootstrap over a torch.distributed Store: a unique id, an exchange, barriers, validation.

Every communicator gets a random token from rank 0; all its keys live under
``sparkccl/<token>/`` so communicators sharing a store (or a host) never collide. The
token itself is found under ``sparkccl/token/<n>``, where n counts the communicators each
rank has built on this store (a counter kept in the store, per rank, so it agrees across
ranks that build communicators in the same order, even if they recreate Store objects).
"""
from __future__ import annotations

import contextlib
import json
import secrets
import socket
import time
from typing import Any, Callable

from . import config
from .errors import CollectiveError, SparkcclError

POLL_MIN_S = 0.002
POLL_MAX_S = 0.05


def resolve_group(group, store, rank, world_size):
    """-> (store, rank, world_size, description). Explicit store wins over a group."""
    if store is not None:
        if group is not None:
            raise ValueError("pass either group= or store= (with rank= and world_size=), not both")
        if rank is None or world_size is None:
            raise ValueError("store= needs rank= and world_size= too")
        for name, v in (("rank", rank), ("world_size", world_size)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in 0..world_size-1 = 0..{world_size - 1}, got {rank}")
        if not hasattr(store, "set") or not hasattr(store, "get"):
            raise TypeError(f"store must be a torch.distributed.Store, got {type(store).__name__}")
        return store, rank, world_size, "store"
    import torch.distributed as dist
    if rank is not None or world_size is not None:
        raise ValueError("rank= and world_size= go with store=; with a process group they "
                         "come from the group")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("no process group: call torch.distributed.init_process_group() first, "
                         "or pass store=, rank= and world_size=")
    from torch.distributed import distributed_c10d as c10d
    if group is None:
        group = dist.group.WORLD
    try:
        pg_store = c10d._get_process_group_store(group)
    except Exception:
        if group is not dist.group.WORLD:
            raise ValueError("cannot find the store of this process group") from None
        pg_store = c10d._get_default_store()
    r, w = dist.get_rank(group), dist.get_world_size(group)
    if r < 0:
        raise ValueError("this process is not a member of the given process group")
    return pg_store, r, w, "group"


def _poll(cond: Callable[[], bool], deadline: float, abort_check: Callable[[], None] | None):
    delay = POLL_MIN_S
    while True:
        if cond():
            return True
        if abort_check is not None:
            abort_check()
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, POLL_MAX_S)


class Rendezvous:
    """Keyed exchange among the ranks of one communicator."""

    def __init__(self, store, prefix: str, rank: int, world: int, timeout_s: float,
                 setting: str = "timeout_s"):
        self.store = store
        self.prefix = prefix
        self.rank = rank
        self.world = world
        self.timeout_s = timeout_s
        self.setting = setting  # names the limit in a timeout error (where to raise it)

    def key(self, *parts) -> str:
        return "/".join([self.prefix, *map(str, parts)])

    def _wait_all(self, name: str, what: str, abort_check=None, timeout_s=None,
                  setting=None) -> None:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        setting = self.setting if setting is None else setting
        keys = [self.key(name, r) for r in range(self.world)]
        deadline = time.monotonic() + timeout_s
        if _poll(lambda: self.store.check(keys), deadline, abort_check):
            return
        missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
        raise CollectiveError(
            f"rank {self.rank}: timed out after {timeout_s:g} s ({setting}) waiting for "
            f"rank(s) {', '.join(map(str, missing))} to {what} (did they crash, or not "
            "create the communicator / call the same collectives?)",
            rank=self.rank, peer=missing[0] if missing else None)

    def post(self, name: str, value: Any) -> None:
        """Publish this rank's ``value`` without waiting for the others."""
        self.store.set(self.key(name, self.rank), json.dumps(value))

    def exchange(self, name: str, value: Any, what: str = "join", abort_check=None,
                 timeout_s=None, setting=None) -> list:
        """Publish ``value`` (JSON) and return every rank's value, in rank order."""
        with self._store_failure(what):
            self.store.set(self.key(name, self.rank), json.dumps(value))
            self._wait_all(name, what, abort_check, timeout_s, setting)
            return [self._load(name, r) for r in range(self.world)]

    @contextlib.contextmanager
    def _store_failure(self, what: str):
        """The store itself failing (its host process died: torch's DistNetworkError and
        the like, RuntimeErrors) is a CollectiveError naming the store, as a rank that never
        arrives is; sparkccl's own errors pass unchanged."""
        try:
            yield
        except SparkcclError:
            raise
        except RuntimeError as e:
            raise CollectiveError(
                f"rank {self.rank}: the bootstrap store failed while waiting for every rank to "
                f"{what}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} (did "
                "the process hosting the store exit? with torchrun that is rank 0's)",
                rank=self.rank, cause=f"store: {e}") from e

    def _load(self, name: str, r: int) -> Any:
        raw = self.store.get(self.key(name, r))
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:  # (JSONDecodeError is a ValueError)
            raise ValueError(
                f"sparkccl: rank {self.rank}: rank {r}'s {name!r} message in the store is not "
                f"one this sparkccl can read ({len(raw)} bytes, {e}): truncated, or written "
                "by another program or sparkccl version sharing the store's keys") from None

    def barrier(self, name: str, what: str, abort_check=None, timeout_s=None,
                setting=None) -> None:
        with self._store_failure(what):
            self.store.set(self.key(name, self.rank), "1")
            self._wait_all(name, what, abort_check, timeout_s, setting)


def new_token(store, rank: int, world: int, timeout_s: float,
              setting: str = "bootstrap_timeout_s") -> str:
    """A random id shared by the ranks of the communicator being built."""
    n = store.add(f"sparkccl/count/r{rank}", 1)
    key = f"sparkccl/token/{n}"
    if rank == 0:
        token = secrets.token_hex(6)
        store.set(key, token)
        return token
    deadline = time.monotonic() + timeout_s
    if not _poll(lambda: store.check([key]), deadline, None):
        raise CollectiveError(
            f"rank {rank}: timed out after {timeout_s:g} s ({setting}) waiting for rank 0 to create "
            f"communicator #{n} on this store (all {world} ranks must construct it)",
            rank=rank, peer=0)
    return store.get(key).decode()


def describe_disagreement(field: str, values: list) -> str | None:
    """``None`` if all equal, else "field: 'a' on ranks 0, 1; 'b' on rank 2"."""
    groups: dict[str, list[int]] = {}
    for r, v in enumerate(values):
        groups.setdefault(repr(v), []).append(r)
    if len(groups) == 1:
        return None
    parts = []
    for v, ranks in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1])):
        label = "rank" if len(ranks) == 1 else "ranks"
        parts.append(f"{v} on {label} {', '.join(map(str, ranks))}")
    return f"{field}: " + "; ".join(parts)


def host_id() -> tuple[str, str | None]:
    """(host name, boot id) of this process's host, for the join record: the boot id is the
    same for every process of one running host and tells hosts apart even when they share
    a host name (None where the kernel does not say)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = None
    return socket.gethostname(), boot


def validate(infos: list[dict], fields: tuple[str, ...]) -> None:
    """Raise one ValueError naming every field the ranks disagree on (same on every rank)."""
    problems = [p for f in fields
                if (p := describe_disagreement(f, [i.get(f) for i in infos])) is not None]
    if problems:
        raise ValueError("sparkccl.Communicator: ranks disagree on its settings; pass the same "
                         "values on every rank:\n  " + "\n  ".join(problems))


def timeout(bootstrap_timeout_s=None, timeout_s=None) -> tuple[float, str]:
    """(seconds, where they came from): ``bootstrap_timeout_s``, else
    ``SPARKCCL_BOOTSTRAP_TIMEOUT_S``, else the collective timeout (``timeout_s``, else
    ``SPARKCCL_TIMEOUT_S``, else 120 s). No hidden floor: what is asked for is used."""
    if bootstrap_timeout_s is not None:
        t = config.check_seconds(bootstrap_timeout_s, "bootstrap_timeout_s")
        return t, f"bootstrap_timeout_s={t:g}"
    t, src = config.lookup("SPARKCCL_BOOTSTRAP_TIMEOUT_S")
    if src != "default":
        return float(t), f"SPARKCCL_BOOTSTRAP_TIMEOUT_S={t:g}"
    if timeout_s is not None:
        t = config.check_seconds(timeout_s, "timeout_s")
        return t, f"bootstrap_timeout_s defaults to timeout_s={t:g}"
    t, src = config.lookup("SPARKCCL_TIMEOUT_S")
    origin = "SPARKCCL_TIMEOUT_S" if src != "default" else "the default timeout"
    return float(t), f"bootstrap_timeout_s defaults to {origin}={t:g}"
