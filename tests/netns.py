"""A multi-host testbed on one machine: "boxes" in network namespaces joined by veth links.

Two fabrics (docs/CONTRACT.md §3), each with a separate **management** bridge that every box joins
(like a cluster's LAN) and that carries only the bootstrap store:

* ``switch``: every box has one veth per root, ``rt0`` / ``rt1``, on a bridge per root
  (in a namespace of its own); root k is subnet ``10.{10+k}.0.0/24``, box r is ``.{r+1}``.
* ``ring``: box r's "next" port is a veth pair to box r+1's "prev" port, one pair per root
  (``nx{k}`` in box r, ``pv{k}`` in box r+1), each pair its own subnet
  ``10.{20+k}.{r}.0/24`` (box r ``.1``, box r+1 ``.2``). No routes between
  non-neighbours: ring relays are needed, and a mesh cannot connect.

Management: bridge ``brmg`` in the switch namespace (``10.99.0.254/24``), box r's ``mg``
is ``10.99.0.{r+1}``. The store (a ``TCPStore``) is served by rank 0 in box 0 on the
management address. Links can be shaped with ``tc`` (``rate`` with tbf, ``delay`` with
netem where the kernel has it). Fabric links use MTU 9000 (as RoCE clusters do), IPv6
is off in every namespace, so link counters show only our traffic, and every interface has
RPS on, so that a veth delivers each flow in order as a cable does (``Fabric._in_order``).

Everything is created under names ``sccl-<pid>-<n>-...`` and removed on exit, also when a
test fails; namespaces left by a killed run (their pid is gone) are removed by the next.

::

    with Fabric("ring", 4) as fab:
        results = fab.run(job, args=(...,))        # job(rank, world, store, *args) in box rank
        env = fab.env(2)                           # SPARKCCL_TCP_* of box 2

Run as a script (``python tests/netns.py rank SPEC RANK``) it is the rank process itself.
"""
from __future__ import annotations

import importlib.util
import itertools
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

PREFIX = "sccl"
MGMT_NET = "10.99.0"
STORE_PORT = 29500
_counter = itertools.count()


class NetnsError(RuntimeError):
    pass


def ip(*args: str, check: bool = True, input: str | None = None) -> str:
    p = subprocess.run(["ip", *args], capture_output=True, text=True, input=input)
    if check and p.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {p.stderr.strip() or p.stdout.strip()}")
    return p.stdout


def in_ns(ns: str, *cmd: str, check: bool = True) -> str:
    p = subprocess.run(["ip", "netns", "exec", ns, *cmd], capture_output=True, text=True)
    if check and p.returncode != 0:
        raise NetnsError(f"[{ns}] {' '.join(cmd)}: {p.stderr.strip() or p.stdout.strip()}")
    return p.stdout


def unavailable_reason() -> str | None:
    """Why the testbed cannot run here (None if it can). Only missing root or a missing
    ``ip`` command count; anything else that fails is a real failure."""
    if os.geteuid() != 0:
        return "network namespaces need root (run the tests as root, as CI does)"
    if shutil.which("ip") is None:
        return "the 'ip' command is missing (apt-get install iproute2)"
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def list_namespaces() -> list[str]:
    out = ip("netns", "list", check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def cleanup_stale() -> None:
    """Remove namespaces of earlier runs whose process is gone."""
    for ns in list_namespaces():
        parts = ns.split("-")
        if len(parts) >= 3 and parts[0] == PREFIX and parts[1].isdigit():
            if not _pid_alive(int(parts[1])):
                ip("netns", "del", ns, check=False)


@dataclass(frozen=True)
class Link:
    box: int
    ifname: str
    role: str       # "root" (switch), "prev" / "next" (ring)
    root: int
    addr: str       # this end's address
    peer_box: int | None  # ring: the box at the other end


def ring_link_ifname(role: str, root: int) -> str:
    return f"{'nx' if role == 'next' else 'pv'}{root}"


class Fabric:
    def __init__(self, kind: str, world: int, roots: int = 2, *, mtu: int = 9000,
                 rate: str | None = None, delay: str | None = None, hostnames: bool = False,
                 congestion: str | None = None):
        if kind not in ("switch", "ring"):
            raise ValueError(f"kind must be 'switch' or 'ring', got {kind!r}")
        if not 2 <= world <= 16:
            raise ValueError("world must be 2..16")
        self.kind, self.world, self.roots = kind, world, roots
        self.mtu, self.rate, self.delay = mtu, rate, delay
        # TCP congestion control in every box (None: the host's default). The host's may be
        # bbr, which paces below a tbf-shaped link's rate (benchmarks/netns_raw_tcp.py:
        # 79-87% of it here; cubic fills it).
        self.congestion = congestion
        # Ranks in their own UTS namespace with host name "box<r>" (look like separate hosts).
        self.hostnames = hostnames
        self.tag = f"{PREFIX}-{os.getpid()}-{next(_counter)}"
        self.sw = f"{self.tag}-sw"
        self.boxes = [f"{self.tag}-b{r}" for r in range(world)]
        self.links: list[Link] = []
        self.created: list[str] = []
        self.procs: list[subprocess.Popen] = []
        self.runs = 0
        self.in_order = True  # every interface has RPS on (_in_order); False where it can't
        self.tmp = tempfile.mkdtemp(prefix=f"{self.tag}-")

    # ---- lifetime ---------------------------------------------------------------------
    def __enter__(self) -> "Fabric":
        try:
            self.build()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def _add_ns(self, ns: str) -> None:
        ip("netns", "add", ns)
        self.created.append(ns)
        ip("-n", ns, "link", "set", "lo", "up")
        # No IPv6 (router solicitations etc. would show in the link counters); /proc/sys/net
        # is this namespace's view. Kernels without IPv6 have nothing to turn off.
        in_ns(ns, "sh", "-c", "for f in /proc/sys/net/ipv6/conf/all/disable_ipv6 "
              "/proc/sys/net/ipv6/conf/default/disable_ipv6; do [ -e $f ] && echo 1 > $f; "
              "done; true")

    def build(self) -> None:
        cleanup_stale()
        for ns in [self.sw, *self.boxes]:
            self._add_ns(ns)
        if self.congestion:
            for ns in self.boxes:
                in_ns(ns, "sysctl", "-q", "-w", f"net.ipv4.tcp_congestion_control={self.congestion}")
        sw = self.sw
        bridges = ["brmg"] + ([f"br{k}" for k in range(self.roots)] if self.kind == "switch" else [])
        for br in bridges:
            ip("-n", sw, "link", "add", "name", br, "type", "bridge")
            ip("-n", sw, "link", "set", br, "up")
        ip("-n", sw, "addr", "add", f"{MGMT_NET}.254/24", "dev", "brmg")
        for r, box in enumerate(self.boxes):
            self._veth(box, "mg", sw, f"m{r}", master="brmg", mtu=1500)
            ip("-n", box, "addr", "add", f"{self.mgmt_addr(r)}/24", "dev", "mg")
        if self.kind == "switch":
            for r, box in enumerate(self.boxes):
                for k in range(self.roots):
                    name = f"rt{k}"
                    self._veth(box, name, sw, f"b{r}k{k}", master=f"br{k}", mtu=self.mtu)
                    addr = f"10.{10 + k}.0.{r + 1}"
                    ip("-n", box, "addr", "add", f"{addr}/24", "dev", name)
                    self.links.append(Link(r, name, "root", k, addr, None))
        else:
            for r in range(self.world):
                nxt = (r + 1) % self.world
                for k in range(self.roots):
                    a, b = ring_link_ifname("next", k), ring_link_ifname("prev", k)
                    self._veth(self.boxes[r], a, self.boxes[nxt], b, mtu=self.mtu)
                    net = f"10.{20 + k}.{r}"
                    ip("-n", self.boxes[r], "addr", "add", f"{net}.1/24", "dev", a)
                    ip("-n", self.boxes[nxt], "addr", "add", f"{net}.2/24", "dev", b)
                    self.links.append(Link(r, a, "next", k, f"{net}.1", nxt))
                    self.links.append(Link(nxt, b, "prev", k, f"{net}.2", r))
        for ns in [sw, *self.boxes]:
            self._in_order(ns)
        if self.rate or self.delay:
            for lk in self.links:
                self.shape(lk.box, lk.ifname, self.rate, self.delay)

    def _in_order(self, ns: str) -> None:
        """Make ns's interfaces deliver each flow in order, as a cable does. A veth hands a
        sent packet to the receive backlog of the CPU that sends it, and a TCP flow is sent
        from process context and from softirqs (the ACKs' processing) on any CPU: when two
        CPUs' backlogs drain in the other order the receiver gets segments out of order, and
        the sender's loss detection (RACK: its reordering window is at most a quarter of the
        minimum RTT, microseconds on a veth) takes the earlier ones for lost and sends them
        again; the receiver's DSACKs then show they were not. With RPS the receiving side
        queues every packet of a flow (by its hash) on one CPU's backlog whichever CPU sent
        it, so a flow stays in order (benchmarks/ring_link_bytes.py prints the counters).
        Kernels without RPS (no rps_cpus files) keep the reordering; ``in_order`` says so."""
        mask = (1 << (os.cpu_count() or 1)) - 1
        words = []
        while True:  # the cpumask format: 32-bit hex words, most significant first
            words.append(f"{mask & 0xFFFFFFFF:08x}")
            mask >>= 32
            if not mask:
                break
        out = in_ns(ns, "sh", "-c", "ok=0; bad=0; for f in /sys/class/net/*/queues/rx-*/rps_cpus; "
                    f"do [ -e $f ] || continue; if echo {','.join(reversed(words))} > $f; "
                    "then ok=$((ok+1)); else bad=$((bad+1)); fi; done; echo $ok $bad")
        ok, bad = (int(v) for v in out.split()[-2:])
        if ok == 0 or bad:
            self.in_order = False

    def _veth(self, ns_a: str, a: str, ns_b: str, b: str, master: str | None = None,
              mtu: int = 1500) -> None:
        ip("-n", ns_a, "link", "add", "name", a, "mtu", str(mtu), "type", "veth", "peer", "name", b,
           "mtu", str(mtu), "netns", ns_b)
        if master:
            ip("-n", ns_b, "link", "set", b, "master", master)
        ip("-n", ns_b, "link", "set", b, "up")
        ip("-n", ns_a, "link", "set", a, "up")

    def shape(self, box: int, ifname: str, rate: str | None, delay: str | None) -> None:
        """Egress shaping of one link end: ``rate`` like "1gbit" (tbf), ``delay`` like
        "1ms" (netem, which some kernels lack: then NetnsError says so)."""
        ns = self.boxes[box]
        if delay:
            args = ["netem", "delay", delay] + (["rate", rate] if rate else [])
            p = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", ifname,
                                "root", *args], capture_output=True, text=True)
            if p.returncode != 0:
                raise NetnsError(f"tc netem on {ifname}: {p.stderr.strip()} (this kernel may "
                                 "lack sch_netem; shape with rate only)")
        elif rate:
            in_ns(ns, "tc", "qdisc", "replace", "dev", ifname, "root", "tbf", "rate", rate,
                  "burst", "256kb", "latency", "100ms")

    def destroy(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.kill()
                except OSError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.procs = []
        for ns in reversed(self.created):
            ip("netns", "del", ns, check=False)
        self.created = []
        shutil.rmtree(self.tmp, ignore_errors=True)

    # ---- addresses --------------------------------------------------------------------
    def mgmt_addr(self, r: int) -> str:
        return f"{MGMT_NET}.{r + 1}"

    def link(self, box: int, role: str, root: int) -> Link:
        for lk in self.links:
            if lk.box == box and lk.role == role and lk.root == root:
                return lk
        raise KeyError((box, role, root))

    def env(self, r: int) -> dict[str, str]:
        """SPARKCCL_TCP_* for box r (mesh addresses on a switch; prev/next on a ring)."""
        roots = range(self.roots)
        if self.kind == "switch":
            return {"SPARKCCL_TCP_ADDRS": ",".join(self.link(r, "root", k).addr for k in roots)}
        return {"SPARKCCL_TCP_PREV_ADDRS": ",".join(self.link(r, "prev", k).addr for k in roots),
                "SPARKCCL_TCP_NEXT_ADDRS": ",".join(self.link(r, "next", k).addr for k in roots)}

    # ---- links ------------------------------------------------------------------------
    def set_link(self, box: int, ifname: str, up: bool) -> None:
        ip("-n", self.boxes[box], "link", "set", "dev", ifname, "up" if up else "down")

    def counters(self, box: int) -> dict[str, tuple[int, int]]:
        """{ifname: (tx_bytes, rx_bytes)} of box's interfaces (read from the outside)."""
        out = json.loads(ip("-n", self.boxes[box], "-j", "-s", "link", "show"))
        return {d["ifname"]: (d["stats64"]["tx"]["bytes"], d["stats64"]["rx"]["bytes"])
                for d in out}

    # ---- ranks ------------------------------------------------------------------------
    def start(self, fn, args: tuple = (), *, env: dict | None = None,
              rank_env: dict | None = None, torch_threads: int = 1) -> "Run":
        """Start fn(rank, world, store, *args) in every box (rank r in box r)."""
        self.runs += 1
        port = STORE_PORT + self.runs
        mod = sys.modules.get(fn.__module__)
        spec = dict(module=fn.__module__, file=getattr(mod, "__file__", None),
                    qualname=fn.__qualname__, args=args, world=self.world,
                    store=(self.mgmt_addr(0), port), torch_threads=torch_threads,
                    sys_path=[p for p in sys.path if p])
        run_dir = tempfile.mkdtemp(prefix=f"run{self.runs}-", dir=self.tmp)
        spec_path = os.path.join(run_dir, "spec.pkl")
        with open(spec_path, "wb") as f:
            pickle.dump(spec, f)
        procs = []
        for r in range(self.world):
            e = dict(os.environ)
            e.update(self.env(r))
            e.update(env or {})
            e.update((rank_env or {}).get(r, {}))
            log = open(os.path.join(run_dir, f"rank{r}.log"), "wb")
            cmd = [sys.executable, os.path.abspath(__file__), "rank", spec_path, str(r)]
            if self.hostnames:
                cmd = ["unshare", "--uts", "sh", "-c", f'hostname box{r} && exec "$@"', "sh", *cmd]
            p = subprocess.Popen(["ip", "netns", "exec", self.boxes[r], *cmd],
                                 stdout=log, stderr=subprocess.STDOUT, env=e,
                                 start_new_session=True)
            log.close()
            procs.append(p)
            self.procs.append(p)
        return Run(self, run_dir, procs)

    def run(self, fn, args: tuple = (), *, timeout_s: float = 300, **kw):
        return self.start(fn, args, **kw).wait(timeout_s)


class Run:
    def __init__(self, fabric: Fabric, run_dir: str, procs: list):
        self.fabric, self.dir, self.procs = fabric, run_dir, procs

    def log(self, r: int, tail: int = 3000) -> str:
        try:
            with open(os.path.join(self.dir, f"rank{r}.log"), "rb") as f:
                return f.read().decode(errors="replace")[-tail:]
        except OSError:
            return ""

    def wait(self, timeout_s: float):
        from sparkccl.localrun import RankResult
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            left = deadline - time.monotonic()
            try:
                p.wait(timeout=max(0.0, left))
            except subprocess.TimeoutExpired:
                pass
        results = []
        for r, p in enumerate(self.procs):
            res = RankResult(rank=r)
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
                res.error_type = "Timeout"
                res.message = f"no result after {timeout_s:g} s\n{self.log(r)}"
            res.exitcode = p.returncode
            path = os.path.join(self.dir, f"rank{r}.result")
            if res.error_type is None:
                try:
                    with open(path, "rb") as f:
                        kind, payload, elapsed = pickle.load(f)
                except (OSError, EOFError, pickle.UnpicklingError):
                    res.error_type = "Exited"
                    res.message = f"exit code {p.returncode} without a result\n{self.log(r)}"
                else:
                    res.elapsed_s = elapsed
                    if kind == "ok":
                        res.value = payload
                    else:
                        res.error, res.error_type, res.message, res.traceback = payload
                        res.traceback = (res.traceback or "") + "\n--- log ---\n" + self.log(r)
            results.append(res)
        return results


# ---- inside a rank ---------------------------------------------------------------------

def barrier(store, name: str, world: int, timeout_s: float = 120) -> None:
    """All ranks reach ``name`` (through the store, over the management network)."""
    n = store.add(f"netns-barrier/{name}", 1)
    deadline = time.monotonic() + timeout_s
    while n < world:
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {name}: {n}/{world}")
        time.sleep(0.005)
        n = store.add(f"netns-barrier/{name}", 0)


def local_counters(ifnames) -> dict[str, tuple[int, int]]:
    """{ifname: (tx_bytes, rx_bytes)} from this namespace's sysfs (call inside a rank)."""
    out = {}
    for n in ifnames:
        base = f"/sys/class/net/{n}/statistics"
        with open(f"{base}/tx_bytes") as f:
            tx = int(f.read())
        with open(f"{base}/rx_bytes") as f:
            rx = int(f.read())
        out[n] = (tx, rx)
    return out


def local_tcp_sockets() -> dict[tuple[str, str], dict[str, int]]:
    """{(local "addr:port", peer "addr:port"): counters} of this namespace's established TCP
    sockets, from ``ss -tin`` (call inside a rank). Counters, per socket since it opened:
    ``bytes_sent`` (payload, retransmissions included), ``bytes_retrans`` (payload sent
    again), ``bytes_received`` (payload delivered in order, each byte once), ``retrans_segs``
    (segments sent again); ss leaves out the ones that are still 0."""
    out = subprocess.run(["ss", "-tinOH", "state", "established"], capture_output=True,
                         text=True, check=True).stdout
    socks = {}
    for line in out.splitlines():
        f = line.split()
        if len(f) < 4:
            continue
        c = dict(bytes_sent=0, bytes_retrans=0, bytes_received=0, retrans_segs=0)
        for tok in f[4:]:
            k, _, v = tok.partition(":")
            if k in ("bytes_sent", "bytes_retrans", "bytes_received") and v.isdigit():
                c[k] = int(v)
            elif k == "retrans" and "/" in v:  # retrans:<now outstanding>/<total>
                c["retrans_segs"] = int(v.split("/")[1])
        socks[(f[2], f[3])] = c
    return socks


# Per-namespace TCP counters (/proc/net/snmp "Tcp:", /proc/net/netstat "TcpExt:") that say
# whether and why segments were sent again on the fabric's links.
TCP_COUNTERS = ("RetransSegs", "TCPLossProbes", "TCPTimeouts", "TCPSpuriousRTOs",
                "TCPFastRetrans", "TCPLostRetransmit", "TCPDSACKRecv", "TCPDSACKOldSent",
                "TCPSACKReorder", "TCPTSReorder", "TCPOFOQueue", "TCPOFODrop", "TCPRcvQDrop",
                "TCPBacklogDrop", "TCPRetransFail", "TCPSpuriousRtxHostQueues")


def local_tcp_counters() -> dict[str, int]:
    """TCP_COUNTERS of this namespace (call inside a rank: /proc/net is the namespace's)."""
    vals = {}
    for path in ("/proc/net/snmp", "/proc/net/netstat"):
        with open(path) as f:
            lines = f.read().splitlines()
        for names, values in zip(lines[::2], lines[1::2]):
            prefix, _, names = names.partition(":")
            if prefix not in ("Tcp", "TcpExt"):
                continue
            for k, v in zip(names.split(), values.partition(":")[2].split()):
                if k in TCP_COUNTERS:
                    vals[k] = int(v)
    return vals


def _load_fn(spec):
    for p in reversed(spec["sys_path"]):
        if p not in sys.path:
            sys.path.insert(0, p)
    name, path = spec["module"], spec["file"]
    try:
        if name == "__main__":  # a script's function: load the script under another name
            name = "__netns_job__"
            raise ImportError(name)
        mod = importlib.import_module(name)
    except ImportError:
        if not path:
            raise
        s = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(s)
        sys.modules[name] = mod
        s.loader.exec_module(mod)
    obj = mod
    for part in spec["qualname"].split("."):
        obj = getattr(obj, part)
    return obj


def _rank_main(spec_path: str, rank: int) -> int:
    t0 = time.monotonic()
    with open(spec_path, "rb") as f:
        spec = pickle.load(f)
    out = os.path.join(os.path.dirname(spec_path), f"rank{rank}.result")
    world = spec["world"]
    store = None
    try:
        from datetime import timedelta

        import torch
        import torch.distributed as dist
        torch.set_num_threads(spec["torch_threads"])
        host, port = spec["store"]
        store = dist.TCPStore(host, port, world_size=None, is_master=(rank == 0),
                              timeout=timedelta(seconds=300), wait_for_workers=False)
        fn = _load_fn(spec)
        value = fn(rank, world, store, *spec["args"])
        result = ("ok", value)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        from sparkccl.localrun import failure_record
        result = ("err", failure_record(e))
    with open(out + ".tmp", "wb") as f:
        pickle.dump((*result, time.monotonic() - t0), f)
    os.replace(out + ".tmp", out)
    if store is not None:
        try:  # rank 0 serves the store: keep it up until every rank has its result
            store.add("netns-done", 1)
            if rank == 0:
                # (a rank cut off from the management network has its result once its
                # file is written, though it cannot say so through the store)
                results = [os.path.join(os.path.dirname(spec_path), f"rank{q}.result")
                           for q in range(world)]
                deadline = time.monotonic() + 60
                while (store.add("netns-done", 0) < world and time.monotonic() < deadline
                       and not all(os.path.exists(p) for p in results)):
                    time.sleep(0.01)
        except Exception:
            pass
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "rank":
        sys.exit(_rank_main(sys.argv[2], int(sys.argv[3])))
    print(__doc__)
