"""Setup of the ``tcp`` transport: listen, publish, connect, authenticate, hand over.

The native transport (``native/src/tcp_transport.cpp``) only moves frames over sockets
that are already connected; everything else happens here, in Python, once per
communicator:

1. Every rank listens on one socket per (channel, root) that peers connect to, bound to
   the address configured for that port and root (below), and publishes (host, port)
   through the store. Rank 0 adds a random per-communicator secret.
2. Every rank connects one socket per connection of its plan (peer, channel, root) to the
   peer's listener for the matching arrival channel and root, from the local address of
   (channel, root), and sends a hello: magic, secret, its rank, channel and root. The
   acceptor checks the secret and that this rank is expected on that listener (a plan
   connection towards it, not yet connected), then acknowledges; anything else is closed.
3. Every rank publishes whether all of its connections worked; if any failed, every rank
   raises the same :class:`CollectiveError` listing each failure (peer, address, cause).

Addresses (docs/CONTRACT.md §6: arguments, then ``SPARKCCL_*``, then defaults), one per root,
comma-separated (one address alone is used for every root):

| variable | used for |
| --- | --- |
| ``SPARKCCL_TCP_ADDRS`` | mesh: this rank's address on root 0, root 1 (e.g. ``10.0.0.1,10.0.1.1``) |
| ``SPARKCCL_TCP_PREV_ADDRS`` | ring: the port facing prev (channel 0), per root |
| ``SPARKCCL_TCP_NEXT_ADDRS`` | ring: the port facing next (channel 1), per root |
| ``SPARKCCL_TCP_CONNECT_TIMEOUT_S`` | one connection attempt (default 10 s) |
| ``SPARKCCL_TCP_BUF_BYTES`` | SO_SNDBUF / SO_RCVBUF (default 4 MiB where ``net.core.[rw]mem_max`` allows it, else kernel autotuning; 0 = always autotuning) |

Default address: ``127.0.0.1`` (a ring without PREV/NEXT falls back to
``SPARKCCL_TCP_ADDRS``). A ring only connects to its neighbours, so it works on a cabled
ring without routes between non-neighbours; mesh on such a fabric fails with an error
naming the unreachable peer and address.
"""
from __future__ import annotations

import errno
import hmac
import logging
import os
import secrets
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass

from .. import config
from ..buffers import LABELS
from ..errors import CollectiveError, ConfigError
from ..plan.model import arrival
from .base import Transport

log = logging.getLogger("sparkccl")

ENV_ADDRS = "SPARKCCL_TCP_ADDRS"
ENV_PREV = "SPARKCCL_TCP_PREV_ADDRS"
ENV_NEXT = "SPARKCCL_TCP_NEXT_ADDRS"
ENV_CONNECT_TIMEOUT = "SPARKCCL_TCP_CONNECT_TIMEOUT_S"
ENV_BUF = "SPARKCCL_TCP_BUF_BYTES"
DEFAULT_ADDR = "127.0.0.1"

MAGIC = b"SPRKTCP1"
HELLO = struct.Struct("<8s32siiii")  # magic, secret, rank, world, channel (sender's), root
ACK = b"SPRKACK1"
SECRET_BYTES = 32
CHANNEL_NAMES = {("mesh", 0): "mesh", ("ring", 0): "prev", ("ring", 1): "next"}


@dataclass(frozen=True)
class Endpoint:
    addr: str
    source: str  # the variable (or default) it came from, for error messages


def _per_root(var: str, items: tuple[str, ...], roots: int) -> list[str]:
    if len(items) == 1:
        return list(items) * roots
    if len(items) != roots:
        raise ConfigError(f"{var}={','.join(items)!r}: {len(items)} addresses for {roots} "
                          f"root(s); give one address per root (SPARKCCL_ROOTS={roots}), or "
                          "one for all")
    return list(items)


def local_endpoints(topology: str, roots: int, env=None) -> dict[tuple[int, int], Endpoint]:
    """(channel, root) -> this rank's address there, from the declared settings."""
    out = {}
    base = config.get(ENV_ADDRS, env)
    base_list = _per_root(ENV_ADDRS, base, roots) if base else [DEFAULT_ADDR] * roots
    base_src = ENV_ADDRS if base else f"default {DEFAULT_ADDR}"
    if topology == "mesh":
        for k in range(roots):
            out[(0, k)] = Endpoint(base_list[k], base_src)
        return out
    for ch, var in ((0, ENV_PREV), (1, ENV_NEXT)):
        v = config.get(var, env)
        lst = _per_root(var, v, roots) if v else base_list
        for k in range(roots):
            out[(ch, k)] = Endpoint(lst[k], var if v else base_src)
    return out


def _family(addr: str) -> int:
    return socket.AF_INET6 if ":" in addr else socket.AF_INET


def _port_name(topology: str, ch: int) -> str:
    return CHANNEL_NAMES.get((topology, ch), f"channel {ch}")


def _sysctl_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _tune(sock: socket.socket, buf_bytes: int, user_timeout_s: float) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if buf_bytes > 0:
        # A fixed size turns the kernel's autotuning off and is capped at net.core.*mem_max:
        # ask only where the cap allows the whole request (else autotuning does better).
        for opt, cap in ((socket.SO_SNDBUF, "/proc/sys/net/core/wmem_max"),
                         (socket.SO_RCVBUF, "/proc/sys/net/core/rmem_max")):
            limit = _sysctl_int(cap)
            if limit is not None and limit < buf_bytes:
                continue
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, buf_bytes)
            except OSError:
                pass
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        # Unacknowledged data older than this fails the connection (a dead link is then a
        # transport error naming the connection, not only a collective timeout).
        ms = int(min(max(user_timeout_s, 1.0), 3600.0) * 1000)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, ms)
        except OSError:
            pass


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            break
        buf += chunk
    return bytes(buf)


class _Acceptor(threading.Thread):
    """Accepts and authenticates the expected incoming connections on the listeners."""

    def __init__(self, rank, world, listeners, expected, secret, handshake_timeout_s):
        super().__init__(name=f"sparkccl-tcp-accept-r{rank}", daemon=True)
        self.rank, self.world = rank, world
        self.listeners = listeners  # (arrival channel, root) -> socket
        self.expected = expected    # (sender, sender channel, root) -> (arrival channel, root)
        self.secret = secret
        self.handshake_timeout_s = handshake_timeout_s
        self.accepted: dict[tuple[int, int, int], socket.socket] = {}
        self.rejected: list[str] = []
        self.stop_event = threading.Event()
        self.lock = threading.Lock()

    def run(self) -> None:
        try:
            self._loop()
        except Exception as e:  # noqa: BLE001 - reported by the connectors' timeouts too
            self.rejected.append(f"acceptor failed: {e}")
            log.warning("sparkccl: rank %d: tcp: acceptor failed: %s", self.rank, e)

    def _loop(self) -> None:
        sel = selectors.DefaultSelector()
        try:
            for key, ls in self.listeners.items():
                ls.setblocking(False)
                sel.register(ls, selectors.EVENT_READ, key)
            while not self.stop_event.is_set() and len(self.accepted) < len(self.expected):
                for skey, _ in sel.select(timeout=0.05):
                    try:
                        conn, addr = skey.fileobj.accept()
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError:
                        if self.stop_event.is_set():
                            return
                        raise
                    self._handshake(conn, addr, skey.data)
        finally:
            sel.close()

    def _handshake(self, conn: socket.socket, addr, key) -> None:
        why = None
        try:
            conn.setblocking(True)
            conn.settimeout(self.handshake_timeout_s)
            data = _recv_exact(conn, HELLO.size)
            if len(data) != HELLO.size:
                why = "incomplete hello"
            else:
                magic, secret, rank, world, ch, root = HELLO.unpack(data)
                ident = (rank, ch, root)
                if magic != MAGIC:
                    why = "not a sparkccl tcp hello"
                elif not hmac.compare_digest(secret, self.secret):
                    why = "wrong secret (another communicator, or not a peer)"
                elif world != self.world or self.expected.get(ident) != key:
                    why = (f"rank {rank} channel {ch} root {root} is not expected on this "
                           f"listener (channel {key[0]}, root {key[1]})")
                else:
                    with self.lock:
                        if ident in self.accepted:
                            why = f"rank {rank} channel {ch} root {root} is already connected"
                        else:
                            self.accepted[ident] = conn
                    if why is None:
                        conn.sendall(ACK)
                        return
        except OSError as e:
            why = f"handshake failed: {e}"
        self.rejected.append(f"{addr}: {why}")
        log.warning("sparkccl: rank %d: tcp: rejected a connection from %s: %s",
                    self.rank, addr, why)
        try:
            conn.close()
        except OSError:
            pass


def _connect_one(rank, world, secret, peer, ch, root, arr, src: Endpoint, dst, topology,
                 connect_timeout_s, deadline, buf_bytes, user_timeout_s) -> socket.socket:
    host, port = dst
    where = (f"peer {peer} ({_port_name(topology, arr)} port, root {root}) at {host}:{port} "
             f"from {src.addr} (this rank's {_port_name(topology, ch)} port, root {root}, "
             f"{src.source})")
    attempt = 0
    while True:
        attempt += 1
        s = socket.socket(_family(host), socket.SOCK_STREAM)
        try:
            try:
                s.bind((src.addr, 0))
            except OSError as e:
                raise CollectiveError(f"rank {rank}: tcp: cannot bind the source address "
                                      f"{src.addr} ({src.source}) to reach {where}: {e}",
                                      rank=rank, peer=peer) from None
            _tune(s, buf_bytes, user_timeout_s)
            s.settimeout(max(0.1, min(connect_timeout_s, deadline - time.monotonic())))
            try:
                s.connect((host, port))
            except ConnectionRefusedError as e:
                if attempt < 5 and time.monotonic() < deadline:
                    s.close()
                    time.sleep(0.1 * attempt)
                    continue
                raise CollectiveError(f"rank {rank}: tcp: cannot connect to {where}: {e}",
                                      rank=rank, peer=peer) from None
            except socket.timeout:
                raise CollectiveError(
                    f"rank {rank}: tcp: cannot connect to {where}: no answer within "
                    f"{s.gettimeout():g} s ({ENV_CONNECT_TIMEOUT})", rank=rank, peer=peer) from None
            except OSError as e:
                hint = ""
                if e.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH) and topology == "mesh":
                    hint = (" (topology='mesh' needs every rank to reach every other; on a "
                            "switchless ring use topology='ring' with SPARKCCL_TCP_PREV_ADDRS / "
                            "SPARKCCL_TCP_NEXT_ADDRS)")
                raise CollectiveError(f"rank {rank}: tcp: cannot connect to {where}: {e}{hint}",
                                      rank=rank, peer=peer) from None
            try:
                s.sendall(HELLO.pack(MAGIC, secret, rank, world, ch, root))
                ack = _recv_exact(s, len(ACK))
            except OSError as e:
                raise CollectiveError(f"rank {rank}: tcp: handshake with {where} failed: {e}",
                                      rank=rank, peer=peer) from None
            if ack != ACK:
                raise CollectiveError(f"rank {rank}: tcp: {where} refused the connection "
                                      "(wrong communicator or unexpected rank)",
                                      rank=rank, peer=peer)
            return s
        except BaseException:
            s.close()
            raise


@dataclass
class Links:
    """Connected sockets, ready for ``_native.TcpTransport``."""

    send: list[socket.socket]                               # per plan connection
    recv: list[tuple[socket.socket, int, int, int]]         # (sock, peer, arrival ch, root)

    def detach(self) -> tuple[list[int], list[list[int]]]:
        """File descriptors (blocking), ownership passes to the caller."""
        send_fds = []
        for s in self.send:
            s.setblocking(True)
            send_fds.append(s.detach())
        recv_rows = []
        for s, peer, ch, root in self.recv:
            s.setblocking(True)
            recv_rows.append([s.detach(), peer, ch, root])
        self.send, self.recv = [], []
        return send_fds, recv_rows

    def close(self) -> None:
        for s in self.send:
            s.close()
        for s, *_ in self.recv:
            s.close()
        self.send, self.recv = [], []


def connect(rv, plans, rank: int, topology: str, roots: int, timeout_s: float,
            user_timeout_s: float, env=None) -> Links:
    """Build every connection of ``plans[rank]`` and accept the peers' (all ranks call this
    together). ``plans``: every rank's plan (to know who connects to this rank)."""
    world = len(plans)
    env = os.environ if env is None else env
    deadline = time.monotonic() + timeout_s
    # A bad setting on one rank is posted like a listen error, so that every rank raises
    # it together instead of the others waiting out their timeout.
    setting_error = None
    try:
        connect_timeout = config.get(ENV_CONNECT_TIMEOUT, env)
        buf_bytes = config.get(ENV_BUF, env)
        eps = local_endpoints(topology, roots, env)
    except ConfigError as e:
        setting_error, eps = f"rank {rank}: {e}", {}

    # Who connects to this rank, and on which of its listeners.
    expected: dict[tuple[int, int, int], tuple[int, int]] = {}
    for s in range(world):
        if s == rank:
            continue
        for c in plans[s].connections:
            if c.peer == rank:
                expected[(s, c.channel, c.root)] = (arrival(topology, c.channel), c.root)

    listeners: dict[tuple[int, int], socket.socket] = {}
    error = None
    published = {}
    for key in sorted(set(expected.values())) if setting_error is None else ():
        ep = eps[key]
        ls = socket.socket(_family(ep.addr), socket.SOCK_STREAM)
        try:
            ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            ls.bind((ep.addr, 0))
            ls.listen(64)
        except OSError as e:
            ls.close()
            error = (f"rank {rank}: tcp: cannot listen on {ep.addr} ({ep.source}, "
                     f"{_port_name(topology, key[0])} port, root {key[1]}): {e}")
            break
        listeners[key] = ls
        published[f"{key[0]}/{key[1]}"] = [ep.addr, ls.getsockname()[1]]
    mine = {"listen": published, "error": error, "setting_error": setting_error}
    if rank == 0:
        mine["secret"] = secrets.token_hex(SECRET_BYTES)
    acceptor = None
    links = Links([], [])
    try:
        infos = rv.exchange("tcp-listen", mine, "publish its tcp listening addresses",
                            timeout_s=max(1.0, deadline - time.monotonic()))
        bad = [i["setting_error"] for i in infos if i.get("setting_error")]
        if bad:
            raise ConfigError("sparkccl tcp transport: " + "; ".join(bad))
        errors = [i["error"] for i in infos if i.get("error")]
        if errors:
            raise CollectiveError("sparkccl tcp transport: cannot listen:\n  " + "\n  ".join(errors),
                                  rank=rank)
        secret = bytes.fromhex(infos[0]["secret"])
        acceptor = _Acceptor(rank, world, listeners, expected, secret,
                             min(connect_timeout, max(1.0, deadline - time.monotonic())))
        acceptor.start()

        error = None
        for c in plans[rank].connections:
            arr = arrival(topology, c.channel)
            dst = infos[c.peer]["listen"].get(f"{arr}/{c.root}")
            try:
                if dst is None:
                    raise CollectiveError(f"rank {rank}: tcp: peer {c.peer} does not listen on "
                                          f"channel {arr} root {c.root} (plans disagree)",
                                          rank=rank, peer=c.peer)
                links.send.append(_connect_one(rank, world, secret, c.peer, c.channel, c.root, arr,
                                               eps[(c.channel, c.root)], tuple(dst), topology,
                                               connect_timeout, deadline, buf_bytes,
                                               user_timeout_s))
            except CollectiveError as e:
                error = str(e)
                break
        states = rv.exchange("tcp-connected", {"error": error}, "connect its tcp links",
                             timeout_s=max(1.0, deadline - time.monotonic()))
        errors = [s["error"] for s in states if s.get("error")]
        if errors:
            raise CollectiveError(
                f"rank {rank}: sparkccl tcp transport: could not connect every link of the "
                f"{topology} plan:\n  " + "\n  ".join(errors), rank=rank,
                cause="\n".join(errors))
        # Every connector got its acknowledgement, so every acceptor has registered them.
        acceptor.stop_event.set()
        acceptor.join(timeout=10)
        missing = sorted(set(expected) - set(acceptor.accepted))
        if missing:
            raise CollectiveError(f"rank {rank}: tcp: expected connections never arrived: "
                                  + ", ".join(f"rank {s} channel {ch} root {k}"
                                              for s, ch, k in missing), rank=rank)
        for (s, ch, k), sock in sorted(acceptor.accepted.items()):
            _tune(sock, buf_bytes, user_timeout_s)
            arr, _ = expected[(s, ch, k)]
            links.recv.append((sock, s, arr, k))
        acceptor.accepted = {}
        return links
    except BaseException:
        links.close()
        if acceptor is not None:
            acceptor.stop_event.set()
            acceptor.join(timeout=10)
            for sock in acceptor.accepted.values():
                sock.close()
        raise
    finally:
        for ls in listeners.values():
            ls.close()


class TcpTransport(Transport):
    """Any IP network: the sockets are built in :meth:`connect`, the proxy owns them from
    :meth:`attach` on. Only this process maps its segments."""

    name = "tcp"
    needs_liveness = True  # a link down or a stalled peer shows only at the timeout

    def __init__(self, ctx):
        super().__init__(ctx)
        self.links: Links | None = None

    def connect(self) -> None:
        c = self.ctx
        c.buffers.unlink()  # peers reach this memory through the network only
        self.links = connect(c.rv, c.plans, c.rank, c.topology, c.roots,
                             c.bootstrap_timeout_s, c.timeout_s)

    def attach(self, proxy) -> None:
        from .. import _native
        links, self.links = self.links, None
        # The native transport owns the sockets from here on (closes them if refused).
        proxy.attach(_native.TcpTransport(*links.detach()))

    def add_segment(self, proxy, kind, abort_check) -> None:
        self.ctx.buffers.unlink()
        self.ctx.rv.barrier(f"{kind}-created", f"create its {LABELS[kind]} buffers",
                            abort_check)

    def close(self) -> None:
        if self.links is not None:  # the proxy never took them
            self.links.close()
            self.links = None
