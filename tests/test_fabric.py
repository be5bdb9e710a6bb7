"""Fabric discovery, selection (docs/CONTRACT.md §6) and `sparkccl doctor`, against fake GB10 sysfs trees."""
from __future__ import annotations

import argparse
import io
import ipaddress
import os
import pathlib
import subprocess
import sys

import pytest

from sparkccl import doctor as doctor_mod
from sparkccl.fabric import (
    FabricError, choose_gid, discover, netdev_ipv4, parse_hca, roce_active_mtu, select_mesh,
    select_ring,
)
from fakesysfs import V1, V2, FakeSysfs, gb10, mapped  # tests/ is on sys.path under pytest

FAKE_VERBS = lambda: (True, "fake libibverbs", None)  # noqa: E731
ROOMY_MEMLOCK = lambda need: (True, "unlimited")  # noqa: E731


@pytest.fixture
def box(tmp_path):
    """A healthy GB10 with a VLAN upper device on rocep1s0f1's netdev; returns (fs, fabric)."""
    fs = gb10(tmp_path)
    return fs, discover(tmp_path, ipv4_of=fs.ipv4_of)


def fabric_of(tmp_path, **kw):
    fs = gb10(tmp_path, **kw)
    return discover(tmp_path, ipv4_of=fs.ipv4_of)


def names(choices):
    return [c.device for c in choices]


# -- discovery ---------------------------------------------------------------------------

def test_gb10_devices_group_into_qsfp_ports_by_pci_function(box):
    _, fabric = box
    got = [(d.name, d.pci, d.group, d.root) for d in fabric.devices]
    assert got == [("rocep1s0f0", "0000:01:00.0", "p1s0f0", 0),
                   ("roceP2p1s0f0", "0002:01:00.0", "p1s0f0", 1),
                   ("rocep1s0f1", "0000:01:00.1", "p1s0f1", 0),
                   ("roceP2p1s0f1", "0002:01:00.1", "p1s0f1", 1)]


def test_grouping_and_netdev_fall_back_to_names_and_gid0_without_pci_links(tmp_path):
    gb10(tmp_path)
    for dev in ("rocep1s0f1", "roceP2p1s0f1"):
        os.unlink(tmp_path / "class/infiniband" / dev / "device")
    fabric = discover(tmp_path)
    by = {d.name: d for d in fabric.devices}
    assert (by["roceP2p1s0f1"].pci, by["roceP2p1s0f1"].group, by["roceP2p1s0f1"].root) == \
        (None, "p1s0f1", 1)
    assert by["rocep1s0f1"].root == 0
    assert by["roceP2p1s0f1"].ports[0].netdev == "enP2p1s0f1np1"  # from GID 0's ndev


def test_port_facts(box):
    _, fabric = box
    p = fabric.device("rocep1s0f1").ports[0]
    assert (p.port, p.state, p.phys_state, p.link_layer) == (1, "ACTIVE", "LinkUp", "Ethernet")
    assert p.rate == "200 Gb/sec (2X NDR)" and p.rate_gbps == 200.0
    assert (p.netdev, p.netdev_mtu, p.active_mtu) == ("enp1s0f1np1", 9000, 4096)
    assert p.ipv4 == ipaddress.IPv4Interface("192.168.102.1/24")
    # empty (all-zero) slots of the 16-entry table are skipped; 4 own + 2 VLAN entries remain
    assert [g.index for g in p.gids] == [0, 1, 2, 3, 4, 5]
    assert [(g.type, g.ndev, g.ipv4) for g in p.gids[2:]] == [
        (V1, "enp1s0f1np1", "192.168.102.1"), (V2, "enp1s0f1np1", "192.168.102.1"),
        (V1, "enp1s0f1np1.100", "10.10.0.1"), (V2, "enp1s0f1np1.100", "10.10.0.1")]
    assert p.gids[0].ipv4 is None  # IPv6 link-local


def test_down_port(tmp_path):
    fabric = fabric_of(tmp_path, down=("rocep1s0f1",))
    p = fabric.device("rocep1s0f1").ports[0]
    assert (p.state, p.phys_state, p.is_active) == ("DOWN", "Disabled", False)


@pytest.mark.parametrize("netdev_mtu, ib_mtu", [
    (9000, 4096), (4192, 4096), (4191, 2048), (2144, 2048), (1500, 1024), (1100, 512),
    (352, 256), (351, None), (None, None)])
def test_roce_active_mtu_is_the_largest_ib_mtu_that_fits_with_headers(netdev_mtu, ib_mtu):
    assert roce_active_mtu(netdev_mtu) == ib_mtu


def test_netdev_mtu_1500_gives_active_mtu_1024(tmp_path):
    fabric = fabric_of(tmp_path, netdev_mtu=1500)
    assert {p.active_mtu for _, p in fabric.ports()} == {1024}
    assert {c.mtu for c in select_mesh(fabric, env={}).check().mesh} == {1024}


def test_missing_sysfs_gives_no_devices(tmp_path):
    assert discover(tmp_path / "nothing").devices == ()


def test_sysfs_root_from_environment(tmp_path, monkeypatch):
    gb10(tmp_path)
    monkeypatch.setenv("SPARKCCL_SYSFS_ROOT", str(tmp_path))
    assert len(discover().devices) == 4


def test_netdev_ipv4_uses_the_kernel():
    assert netdev_ipv4("no-such-dev0") is None
    lo = netdev_ipv4("lo")
    if lo is None:
        pytest.skip("no IPv4 on lo in this network namespace")
    assert lo == ipaddress.IPv4Interface("127.0.0.1/8")


# -- GID choice --------------------------------------------------------------------------

def test_chosen_gid_is_the_roce_v2_entry_of_the_own_netdevs_ipv4(box):
    _, fabric = box
    for d, p in fabric.ports():
        g = choose_gid(p)
        assert g.index == 3 and g.gid == mapped(str(p.ipv4.ip))
        assert f"RoCE v2 GID of {p.ipv4.ip}, the IPv4 address of {p.netdev}" in g.why
    assert "skipped 4, 5 (upper device enp1s0f1np1.100)" in \
        choose_gid(fabric.device("rocep1s0f1").ports[0]).why


def test_vlan_entries_listed_first_are_skipped(tmp_path):
    fabric = fabric_of(tmp_path, vlan_first=True)
    p = fabric.device("rocep1s0f1").ports[0]
    assert [g.ndev for g in p.gids[2:4]] == ["enp1s0f1np1.100"] * 2
    assert choose_gid(p).index == 5


def test_vlan_holding_the_same_ipv4_never_wins(tmp_path):
    fabric = fabric_of(tmp_path, vlan_first=True, vlan_ip="192.168.102.1/24")
    g = choose_gid(fabric.device("rocep1s0f1").ports[0])
    assert g.index == 5 and "skipped 2, 3 (upper device enp1s0f1np1.100)" in g.why


def test_only_roce_v1_entries_is_an_error(tmp_path):
    fs = FakeSysfs(tmp_path)
    fs.add_device("rocep1s0f0", "0000:01:00.0", netdev="enp1s0f0np0", ipv4="10.0.0.1/24")
    fs.add_port("rocep1s0f0", gids=[("fe80::1", V1, "enp1s0f0np0"),
                                    ("::ffff:10.0.0.1", V1, "enp1s0f0np0")])
    p = discover(tmp_path, ipv4_of=fs.ipv4_of).device("rocep1s0f0").ports[0]
    with pytest.raises(FabricError, match=r"no RoCE v2 GID holds the IPv4 address of "
                                          r"enp1s0f0np0 \(10\.0\.0\.1\).*only RoCE v1"):
        choose_gid(p)


def test_no_ipv4_is_an_error(tmp_path):
    fabric = fabric_of(tmp_path, no_ipv4=("rocep1s0f0",))
    with pytest.raises(FabricError, match=r"enp1s0f0np0 \(rocep1s0f0 port 1\) has no IPv4"):
        choose_gid(fabric.device("rocep1s0f0").ports[0])


def test_forced_gid_index_is_used_with_warnings(box):
    _, fabric = box
    p = fabric.device("rocep1s0f1").ports[0]
    g = choose_gid(p, 2, "NCCL_IB_GID_INDEX=2")
    assert g.index == 2 and "forced by NCCL_IB_GID_INDEX=2" in g.why and "RoCE v1" in g.why
    assert "belongs to enp1s0f1np1.100" in choose_gid(p, 5, "x").why
    with pytest.raises(FabricError, match=r"GID index 9 \(x\) is empty"):
        choose_gid(p, 9, "x")


# -- NCCL_IB_HCA syntax ------------------------------------------------------------------

@pytest.mark.parametrize("text, admitted", [
    ("roceP2", ["roceP2p1s0f0", "roceP2p1s0f1"]),                     # prefix
    ("rocep1s0f", ["rocep1s0f0", "rocep1s0f1"]),                      # prefix, case-sensitive
    ("=rocep1s0f", []),                                               # exact
    ("=rocep1s0f1,roceP2p1s0f1", ["rocep1s0f1", "roceP2p1s0f1"]),
    ("^roceP2", ["rocep1s0f0", "rocep1s0f1"]),                        # exclude prefix
    ("^=rocep1s0f", ["rocep1s0f0", "roceP2p1s0f0", "rocep1s0f1", "roceP2p1s0f1"]),
    ("^=rocep1s0f0", ["roceP2p1s0f0", "rocep1s0f1", "roceP2p1s0f1"]),
    ("rocep1s0f1:1", ["rocep1s0f1"]),                                 # :port
    ("rocep1s0f1:2", []),
    (" rocep1s0f0 , roceP2p1s0f0:1 ", ["rocep1s0f0", "roceP2p1s0f0"]),
])
def test_hca_list_syntax(box, text, admitted):
    _, fabric = box
    spec = parse_hca(text, "NCCL_IB_HCA")
    assert [p.device for _, p in fabric.ports() if spec.admits(p)] == admitted


def test_hca_list_given_as_sequence_is_exact(box):
    _, fabric = box
    spec = parse_hca(["rocep1s0f", "roceP2p1s0f1:1"], "devices")
    assert [p.device for _, p in fabric.ports() if spec.admits(p)] == ["roceP2p1s0f1"]


@pytest.mark.parametrize("text, message", [
    ("rocep1s0f1:x", "port 'x' of 'rocep1s0f1' is not a number"),
    ("^", "names no device"),
])
def test_hca_list_errors(text, message):
    with pytest.raises(FabricError, match=message):
        parse_hca(text, "NCCL_IB_HCA")


def test_nccl_ib_hca_matching_nothing(box):
    _, fabric = box
    sel = select_mesh(fabric, env={"NCCL_IB_HCA": "mlx5_9"})
    assert not sel.ok and sel.mesh == ()
    assert "NCCL_IB_HCA=mlx5_9 matches no device (found: rocep1s0f0" in sel.errors[0]
    with pytest.raises(FabricError, match="mesh fabric: NCCL_IB_HCA=mlx5_9 matches no device"):
        sel.check()


# -- mesh selection and precedence -------------------------------------------------------

def test_mesh_auto_takes_both_roots_of_the_first_usable_port(box):
    _, fabric = box
    sel = select_mesh(fabric, env={}).check()
    assert sel.source == "automatic discovery"
    assert [(c.device, c.root, c.gid_index, c.ipv4, c.mtu, c.netdev) for c in sel.mesh] == [
        ("rocep1s0f0", 0, 3, "192.168.100.1/24", 4096, "enp1s0f0np0"),
        ("roceP2p1s0f0", 1, 3, "192.168.101.1/24", 4096, "enP2p1s0f0np0")]
    assert sel.mesh[0].gid == mapped("192.168.100.1") and sel.mesh[0].rate.startswith("200")
    assert any("QSFP p1s0f1 is usable too" in n for n in sel.notes)


def test_mesh_auto_skips_a_port_with_a_root_down(tmp_path):
    sel = select_mesh(fabric_of(tmp_path, down=("roceP2p1s0f0",)), env={}).check()
    assert names(sel.mesh) == ["rocep1s0f1", "roceP2p1s0f1"]
    assert "roceP2p1s0f0 port 1 is DOWN (physical link Disabled)" in sel.notes
    one = select_mesh(fabric_of(tmp_path / "b", down=("roceP2p1s0f0",)), env={}, roots=1)
    assert names(one.check().mesh) == ["rocep1s0f0"]


def test_mesh_auto_with_nothing_usable(tmp_path):
    fabric = fabric_of(tmp_path, down=("rocep1s0f0", "rocep1s0f1"))
    sel = select_mesh(fabric, env={})
    assert not sel.ok and sel.notes == ()
    assert sel.errors[0].startswith("no port has 2 usable root(s): ")
    assert "rocep1s0f1 port 1 is DOWN" in sel.errors[0]
    assert "QSFP p1s0f1: 1 usable root(s), 2 needed (SPARKCCL_ROOTS=1 uses one)" in sel.errors[0]


def test_mesh_precedence_argument_then_sparkccl_then_nccl_then_auto(box):
    _, fabric = box
    env = {"SPARKCCL_IB_HCA": "rocep1s0f1,roceP2p1s0f1", "NCCL_IB_HCA": "^=rocep1s0f0"}
    sel = select_mesh(fabric, devices=["roceP2p1s0f0", "rocep1s0f0"], env=env).check()
    assert sel.source == "devices=roceP2p1s0f0,rocep1s0f0"
    assert names(sel.mesh) == ["rocep1s0f0", "roceP2p1s0f0"]  # lanes in root order
    sel = select_mesh(fabric, env=env).check()
    assert sel.source == "SPARKCCL_IB_HCA=rocep1s0f1,roceP2p1s0f1"
    assert names(sel.mesh) == ["rocep1s0f1", "roceP2p1s0f1"]
    del env["SPARKCCL_IB_HCA"]
    sel = select_mesh(fabric, env=env).check()  # NCCL list narrows automatic discovery
    assert sel.source == "NCCL_IB_HCA=^=rocep1s0f0"
    assert names(sel.mesh) == ["rocep1s0f1", "roceP2p1s0f1"]
    assert select_mesh(fabric, env={}).source == "automatic discovery"


def test_explicit_devices_must_work_and_match_the_root_count(tmp_path):
    fabric = fabric_of(tmp_path, down=("rocep1s0f1",))
    sel = select_mesh(fabric, env={"SPARKCCL_IB_HCA": "=rocep1s0f1,roceP2p1s0f1"})
    assert sel.errors == ("rocep1s0f1 port 1 is DOWN (physical link Disabled)",)
    sel = select_mesh(fabric, env={"SPARKCCL_IB_HCA": "roceP2p1s0f1"})
    assert "SPARKCCL_IB_HCA=roceP2p1s0f1 names 1 device port(s) (roceP2p1s0f1 port 1); " \
           "sparkccl uses 2 here" in sel.errors[0]
    one = select_mesh(fabric, env={"SPARKCCL_IB_HCA": "roceP2p1s0f1"}, roots=1).check()
    assert names(one.mesh) == ["roceP2p1s0f1"]
    sel = select_mesh(fabric, devices="rocep1s0f0,mlx5_0")
    assert any("devices=rocep1s0f0,mlx5_0: 'mlx5_0' matches no device" in e for e in sel.errors)
    sel = select_mesh(fabric, env={"SPARKCCL_IB_HCA": "roce"})  # prefix: all four
    assert any("names 4 device port(s)" in e for e in sel.errors)


def test_nccl_ib_hca_naming_a_down_root_is_an_error(tmp_path):
    fabric = fabric_of(tmp_path, down=("roceP2p1s0f1",))
    sel = select_mesh(fabric, env={"NCCL_IB_HCA": "=rocep1s0f1,roceP2p1s0f1"})
    assert not sel.ok
    assert "among NCCL_IB_HCA==rocep1s0f1,roceP2p1s0f1" in sel.errors[0]
    assert "roceP2p1s0f1 port 1 is DOWN" in sel.errors[0]


def test_gid_index_precedence(box):
    _, fabric = box
    env = {"SPARKCCL_IB_GID_INDEX": "2", "NCCL_IB_GID_INDEX": "1"}
    assert {(c.gid_index, c.why.split(";")[0]) for c in
            select_mesh(fabric, gid_index=0, env=env).check().mesh} == {(0, "forced by gid_index=0")}
    assert {c.why.split(";")[0] for c in select_mesh(fabric, env=env).check().mesh} == \
        {"forced by SPARKCCL_IB_GID_INDEX=2"}
    del env["SPARKCCL_IB_GID_INDEX"]
    assert {c.gid_index for c in select_mesh(fabric, env=env).check().mesh} == {1}
    bad = select_mesh(fabric, env={"SPARKCCL_IB_GID_INDEX": "three"})
    assert bad.errors == ("SPARKCCL_IB_GID_INDEX='three': expected a GID index (an integer >= 0)",)
    empty = select_mesh(fabric, env={"NCCL_IB_GID_INDEX": "7"})
    assert "GID index 7 (NCCL_IB_GID_INDEX=7) is empty" in empty.errors[0]


# -- ring selection ----------------------------------------------------------------------

def test_ring_auto_lower_port_faces_prev(box):
    _, fabric = box
    sel = select_ring(fabric, env={}).check()
    assert names(sel.prev) == ["rocep1s0f0", "roceP2p1s0f0"]
    assert names(sel.next) == ["rocep1s0f1", "roceP2p1s0f1"]
    assert sel.mesh == () and any("prev = QSFP p1s0f0" in n for n in sel.notes)


def test_ring_precedence_per_side(box):
    _, fabric = box
    env = {"SPARKCCL_RING_PREV_HCA": "rocep1s0f1,roceP2p1s0f1",
           "SPARKCCL_RING_NEXT_HCA": "rocep1s0f0,roceP2p1s0f0",
           "NCCL_IB_HCA": "=rocep1s0f0"}
    sel = select_ring(fabric, env=env).check()
    assert names(sel.prev) == ["rocep1s0f1", "roceP2p1s0f1"]
    assert names(sel.next) == ["rocep1s0f0", "roceP2p1s0f0"]
    sel = select_ring(fabric, prev_devices="=rocep1s0f1,roceP2p1s0f1",
                      next_devices=["rocep1s0f0", "roceP2p1s0f0"], env={})
    assert sel.check().source == ("prev prev_devices==rocep1s0f1,roceP2p1s0f1, "
                                  "next next_devices=rocep1s0f0,roceP2p1s0f0")
    # an argument for one side and the variable for the other combine
    sel = select_ring(fabric, prev_devices="=rocep1s0f1,roceP2p1s0f1",
                      env={"SPARKCCL_RING_NEXT_HCA": "=rocep1s0f0,roceP2p1s0f0"}).check()
    assert names(sel.next) == ["rocep1s0f0", "roceP2p1s0f0"]


def test_ring_errors(box, tmp_path):
    _, fabric = box
    sel = select_ring(fabric, env={"SPARKCCL_RING_PREV_HCA": "rocep1s0f0,roceP2p1s0f0"})
    assert sel.errors == ("SPARKCCL_RING_PREV_HCA=rocep1s0f0,roceP2p1s0f0 names the prev port "
                          "but nothing names the next port (next_devices= or "
                          "SPARKCCL_RING_NEXT_HCA)",)
    sel = select_ring(fabric, prev_devices="=rocep1s0f0,roceP2p1s0f0",
                      next_devices="=rocep1s0f0,roceP2p1s0f1")
    assert "rocep1s0f0 named for both prev and next" in sel.errors
    sel = select_ring(fabric, env={"NCCL_IB_HCA": "=rocep1s0f1,roceP2p1s0f1"})
    assert sel.errors[0].startswith("a ring needs two ports with 2 usable root(s) each among "
                                    "NCCL_IB_HCA==rocep1s0f1,roceP2p1s0f1; usable: p1s0f1")
    down = select_ring(fabric_of(tmp_path / "d", down=("roceP2p1s0f0",)), env={})
    assert not down.ok and "roceP2p1s0f0 port 1 is DOWN" in down.errors[0]
    with pytest.raises(FabricError, match="^ring fabric: a ring needs two ports"):
        down.check()


# -- doctor ------------------------------------------------------------------------------

def _doctor(tmp_path, fs=None, **kw):
    out = io.StringIO()
    kw.setdefault("env", {})
    kw.setdefault("verbs", FAKE_VERBS)
    kw.setdefault("memlock", ROOMY_MEMLOCK)
    rc = doctor_mod.doctor(sysfs_root=str(tmp_path), ipv4_of=fs.ipv4_of if fs else None,
                           out=out, **kw)
    return rc, out.getvalue()


def _clean_env(monkeypatch):
    for v in list(os.environ):
        if v.startswith(("SPARKCCL_", "NCCL_IB_")):
            monkeypatch.delenv(v)


def test_doctor_on_this_machine_without_rdma_devices(monkeypatch, capsys):
    _clean_env(monkeypatch)
    if os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband"):
        pytest.skip("this machine has RDMA devices")
    ap = argparse.ArgumentParser()
    doctor_mod.add_parser(ap.add_subparsers(dest="command"))
    args = ap.parse_args(["doctor"])
    assert args.func(args) == 0
    out = " ".join(capsys.readouterr().out.split())  # (wrapped to the terminal's width)
    assert "no RDMA devices found (/sys/class/infiniband does not exist)" in out
    assert "the shm transport (one host) remains available" in out
    assert "memlock:" in out and "libibverbs:" in out


def test_doctor_runs_as_a_command_without_devices(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPARKCCL_", "NCCL_IB_"))}
    env["SPARKCCL_SYSFS_ROOT"] = str(tmp_path)
    code = ("import argparse, sys; from sparkccl.doctor import add_parser; "
            "ap = argparse.ArgumentParser(); add_parser(ap.add_subparsers()); "
            "a = ap.parse_args(['doctor']); sys.exit(a.func(a))")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "no RDMA devices found" in r.stdout


def test_doctor_without_devices_fails_only_for_an_rdma_request(tmp_path):
    rc, out = _doctor(tmp_path, env={"NCCL_IB_HCA": "mlx5_0"})
    assert rc == 0 and "NCCL_IB_HCA is set but there is nothing for it to select" in out
    rc, out = _doctor(tmp_path, env={"SPARKCCL_IB_HCA": "rocep1s0f1"})
    assert rc == 1 and "FAIL: SPARKCCL_IB_HCA asks for RDMA devices, and there are none" in out


def test_doctor_on_a_healthy_gb10(tmp_path):
    fs = gb10(tmp_path)
    rc, out = _doctor(tmp_path, fs)
    assert rc == 0, out
    row = next(line for line in out.splitlines() if line.startswith("rocep1s0f1 "))
    for cell in ("p1s0f1/0", "ACTIVE/LinkUp", "200 Gb/s (2X NDR)", "Ethernet", "enp1s0f1np1",
                 "192.168.102.1/24", "4096 (9000)", " 3 ", "RoCE v2 GID of 192.168.102.1",
                 "skipped 4, 5 (upper device enp1s0f1np1.100)"):
        assert cell in row, (cell, row)
    assert "memlock: unlimited" in out and "libibverbs: fake libibverbs" in out
    assert "mesh [automatic discovery]: rocep1s0f0:1 (GID 3" in out
    assert "  prev: rocep1s0f0:1" in out and "  next: rocep1s0f1:1" in out
    assert out.rstrip().endswith("OK: sparkccl can use RDMA here (mesh, ring)")


@pytest.mark.parametrize("columns", [80, 120])
def test_doctor_wraps_to_the_terminal(columns):
    """`sparkccl doctor` on a terminal of `columns` (COLUMNS): no line longer; the same words
    as the unwrapped report; the port table as one block per port where it does not fit."""
    import tempfile
    with tempfile.TemporaryDirectory(prefix="dr") as short:  # (the path is a value shown)
        _doctor_wraps(pathlib.Path(short), columns)


def _doctor_wraps(tmp_path, columns):
    fs = gb10(tmp_path)
    rc, wide = _doctor(tmp_path, fs, world=8)
    rc2, narrow = _doctor(tmp_path, fs, world=8, columns=columns)
    assert rc == rc2 == 0
    assert max(map(len, wide.splitlines())) > 120  # (what there is to wrap)
    assert max(map(len, narrow.splitlines())) <= columns, narrow
    def outside_port_table(text):
        head, rest = text.split("RDMA devices under")
        return sorted((head + rest[rest.index("memlock:"):]).split())  # (cells wrap in place)
    assert outside_port_table(narrow) == outside_port_table(wide)
    assert "rocep1s0f1:\n  QSFP/root: p1s0f1/0\n  port: 1\n  state: ACTIVE/LinkUp" in narrow
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPARKCCL_", "NCCL_IB_"))}
    r = subprocess.run([sys.executable, "-m", "sparkccl.cli", "doctor"], capture_output=True,
                       text=True, timeout=120, env={**env, "COLUMNS": str(columns)})
    assert r.returncode == 0 and max(map(len, r.stdout.splitlines())) <= columns, r.stdout


def test_doctor_shows_why_a_port_is_unusable_and_passes_if_mesh_works(tmp_path):
    fs = gb10(tmp_path, down=("roceP2p1s0f0",))
    rc, out = _doctor(tmp_path, fs)
    assert rc == 0, out
    assert "unusable: roceP2p1s0f0 port 1 is DOWN (physical link Disabled)" in out
    assert "ring [automatic discovery]: cannot work" in out
    rc, out = _doctor(tmp_path, fs, topology="ring")  # but a ring was asked for
    assert rc == 1 and "FAIL: ring: a ring needs two ports" in out


@pytest.mark.parametrize("kw, message", [
    (dict(env={"SPARKCCL_IB_HCA": "foo"}), "'foo' matches no device"),
    (dict(devices="=rocep1s0f1"), "names 1 device port(s)"),
    (dict(env={"SPARKCCL_RING_NEXT_HCA": "rocep1s0f1,roceP2p1s0f1"}),
     "nothing names the prev port"),
    (dict(env={"SPARKCCL_IB_GID_INDEX": "12"}),
     "GID index 12 (SPARKCCL_IB_GID_INDEX=12) is empty"),
    (dict(verbs=lambda: (False, "libibverbs cannot be loaded (install rdma-core", None)),
     "libibverbs cannot be loaded"),
    (dict(verbs=lambda: (True, "loaded", [])), "libibverbs lists none of the devices"),
    (dict(memlock=lambda need: (False, "8 MiB: too small")), "memlock limit: 8 MiB: too small"),
])
def test_doctor_fails_with_the_reason(tmp_path, kw, message):
    fs = gb10(tmp_path)
    rc, out = _doctor(tmp_path, fs, **kw)
    assert rc == 1, out
    fail = out[out.index("FAIL:"):]
    assert message in fail, out


def test_memlock_status(monkeypatch):
    monkeypatch.setattr(doctor_mod.resource, "getrlimit", lambda _: (8 << 20, 8 << 20))
    monkeypatch.setattr(doctor_mod, "_can_lock_memory", lambda: False)
    ok, text = doctor_mod.memlock_status(512 << 20)
    assert not ok and text.startswith("8 MiB (sparkccl pins about 512 MiB per rank): too small")
    ok, text = doctor_mod.memlock_status(4 << 20)
    assert ok and "warning: not unlimited" in text
    monkeypatch.setattr(doctor_mod, "_can_lock_memory", lambda: True)
    assert doctor_mod.memlock_status(512 << 20)[0]
    inf = doctor_mod.resource.RLIM_INFINITY
    monkeypatch.setattr(doctor_mod.resource, "getrlimit", lambda _: (inf, inf))
    assert doctor_mod.memlock_status(512 << 20) == (True, "unlimited")


def test_verbs_status_reports_without_raising():
    ok, text, listed = doctor_mod.verbs_status()
    assert isinstance(ok, bool) and "libibverbs" in text
    assert (listed is None) == (not ok)
