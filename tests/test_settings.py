"""Settings (sparkccl/config.py): every SPARKCCL_* variable declared once, one parser whose
errors name the variable and the value, sources as `sparkccl doctor` prints them, and the
exception hierarchy exported from the package."""
from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

import sparkccl
from sparkccl import config, doctor
from sparkccl.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
# A whole variable name: not the stem of an f-string ("SPARKCCL_RING_{side}_HCA") or of a
# family ("SPARKCCL_IB_*"), not a C macro of the native code.
NAME = re.compile(r"\bSPARKCCL_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_{*(])")


def test_every_variable_named_in_the_package_is_declared():
    named = _names(ROOT / "sparkccl")
    undeclared = {n: str(p) for n, p in named.items() if n not in config.VARIABLES}
    assert not undeclared, f"read but not declared in config.VARIABLES: {undeclared}"
    # ... and every declaration is read somewhere (the package, or test machinery such as
    # the emulated NIC), so the tables hold no stale entries.
    read_by_config = set(re.findall(r'(?:get|lookup)\("(SPARKCCL_\w+)"',
                                    (ROOT / "sparkccl/config.py").read_text()))
    read = set(named) | read_by_config | set(_names(ROOT / "tests"))
    assert set(config.VARIABLES) <= read, set(config.VARIABLES) - read


def _names(top: Path) -> dict[str, Path]:
    named = {}
    for path in top.rglob("*"):
        if path.suffix in (".py", ".cu", ".cuh", ".h", ".c", ".cpp") and path.is_file() \
                and path.name not in ("config.py", "test_settings.py"):
            for name in NAME.findall(path.read_text(errors="replace")):
                named.setdefault(name, path.relative_to(ROOT))
    return named


def test_the_tables_are_generated_from_the_declarations():
    table = config.variables_table()
    assert len(table.splitlines()) == 2 + len(config.VARIABLES)
    assert table in config.__doc__
    assert table in (ROOT / "README.md").read_text(), \
        "README's settings table differs: paste `python -m sparkccl.config` into it"


@pytest.mark.parametrize("name, value, expect", [
    ("SPARKCCL_SLOT_BYTES", "lots", "expected a byte size"),
    ("SPARKCCL_SLOT_BYTES", "1.5K", "must be >= 4096"),
    ("SPARKCCL_SLOT_BYTES", "1.0000001M", "not a whole number of bytes"),
    ("SPARKCCL_TIMEOUT_S", "soon", "expected a number"),
    ("SPARKCCL_TIMEOUT_S", "0", "must be >= 0.001"),
    ("SPARKCCL_ROOTS", "3", "must be in [1, 2]"),
    ("SPARKCCL_RS_UP_FRONT", "maybe", "expected 0 or 1"),
    ("SPARKCCL_DIRECT_MODE", "turbo", "expected one of auto, fused, split, ce"),
    ("SPARKCCL_IB_GID_INDEX", "three", "expected a GID index (an integer >= 0)"),
    ("SPARKCCL_IB_TIMEOUT", "40", "must be in [1, 31]"),
])
def test_a_bad_value_names_the_variable_and_the_value(name, value, expect):
    with pytest.raises(ConfigError) as e:
        config.get(name, {name: value})
    assert str(e.value).startswith(f"{name}={value!r}: ") and expect in str(e.value)
    assert isinstance(e.value, ValueError) and isinstance(e.value, sparkccl.SparkcclError)


def test_precedence_argument_sparkccl_nccl_default():
    env = {"SPARKCCL_IB_TIMEOUT": "20", "NCCL_IB_TIMEOUT": "14", "NCCL_IB_TC": "106",
           "SPARKCCL_SLOT_BYTES": " 1.5M "}
    assert config.lookup("SPARKCCL_IB_TIMEOUT", env) == (20, "SPARKCCL_IB_TIMEOUT")
    assert config.lookup("SPARKCCL_IB_TC", env) == (106, "NCCL_IB_TC")
    assert config.lookup("SPARKCCL_IB_SL", env) == (0, "default")
    assert config.lookup("SPARKCCL_SLOT_BYTES", env) == (3 << 19, "SPARKCCL_SLOT_BYTES")
    assert config.lookup("SPARKCCL_IB_SL", {"SPARKCCL_IB_SL": "  "}) == (0, "default")
    assert config.lookup_nccl("SPARKCCL_IB_HCA", {"SPARKCCL_IB_HCA": "a"}) == (None, None)
    assert config.lookup_nccl("SPARKCCL_IB_HCA", {"NCCL_IB_HCA": "=mlx5_0"}) == \
        ("=mlx5_0", "NCCL_IB_HCA")
    s = config.resolve(slot_bytes="8M", timeout_s=3, env=env)
    assert (s.slot_bytes, s.timeout_s, s.bootstrap_timeout_s) == (8 << 20, 3.0, 3.0)
    s = config.resolve(bootstrap_timeout_s=7.5, env={"SPARKCCL_BOOTSTRAP_TIMEOUT_S": "99"})
    assert s.bootstrap_timeout_s == 7.5
    with pytest.raises(ConfigError, match=r"^bootstrap_timeout_s=0: must be > 0 seconds"):
        config.resolve(bootstrap_timeout_s=0)
    with pytest.raises(ConfigError, match=r"^slot_bytes='12 parsecs': expected a byte size"):
        config.resolve(slot_bytes="12 parsecs")


def test_effective_settings_say_where_each_comes_from():
    env = {"SPARKCCL_SLOT_BYTES": "32M", "NCCL_IB_TIMEOUT": "20", "SPARKCCL_ROOTS": "x"}
    rows = {n: (v, s) for n, v, s in config.effective({"SPARKCCL_IB_HCA": "rocep1s0f0"}, env)}
    assert set(rows) == set(config.VARIABLES)
    assert rows["SPARKCCL_SLOT_BYTES"] == ("32 MiB", "SPARKCCL_SLOT_BYTES")
    assert rows["SPARKCCL_IB_TIMEOUT"] == ("20", "NCCL_IB_TIMEOUT")
    assert rows["SPARKCCL_IB_HCA"] == ("rocep1s0f0", "argument")
    assert rows["SPARKCCL_RING_PREV_HCA"] == ("discovered", "discovered")
    assert rows["SPARKCCL_TIMEOUT_S"] == ("120", "default")
    assert rows["SPARKCCL_ROOTS"] == ("INVALID", "SPARKCCL_ROOTS='x': expected an integer")


def _doctor(tmp_path, **kw):
    out = io.StringIO()
    kw.setdefault("env", {})
    rc = doctor.doctor(sysfs_root=str(tmp_path), out=out,
                       verbs=lambda: (False, "not loaded (test)", None),
                       memlock=lambda need: (True, "unlimited"), **kw)
    return rc, out.getvalue()


def test_doctor_prints_settings_with_their_sources(tmp_path):
    rc, out = _doctor(tmp_path, env={"SPARKCCL_SLOT_BYTES": "32M", "NCCL_IB_TC": "106"},
                      roots=1, shm_space=lambda: 1 << 40)
    assert rc == 0
    lines = [" ".join(line.split()) for line in out.splitlines()]
    assert "SPARKCCL_SLOT_BYTES 32 MiB SPARKCCL_SLOT_BYTES" in lines
    assert "SPARKCCL_IB_TC 106 NCCL_IB_TC" in lines
    assert "SPARKCCL_ROOTS 1 argument" in lines
    assert f"SPARKCCL_SYSFS_ROOT {tmp_path} argument" in lines
    rc, out = _doctor(tmp_path, env={"SPARKCCL_TIMEOUT_S": "-1"}, shm_space=lambda: 1 << 40)
    assert rc == 1 and "FAIL: SPARKCCL_TIMEOUT_S='-1': must be >= 0.001" in out


def test_doctor_computes_the_memory_a_rank_needs(tmp_path):
    per_rank = doctor.bytes_per_rank(4, "mesh", 64 << 20, 2)
    # 3 all-gather + 2 send + 2 receive slots of 64 MiB, and the control block's pages
    # (3 x 4 x 16 KiB of them the LL area).
    assert (448 << 20) + 3 * 4 * (16 << 10) < per_rank < (448 << 20) + (1 << 20)
    assert doctor.bytes_per_rank(4, None, 64 << 20, 2) >= per_rank  # the larger topology
    rc, out = _doctor(tmp_path, shm_space=lambda: 1 << 40)
    assert rc == 0 and "memory: 448.2 MiB of shared memory per rank (world 4, slot 64 MiB" in out
    assert "448.2 MiB" in (ROOT / "README.md").read_text()


def test_doctor_fails_when_dev_shm_is_too_small(tmp_path):
    rc, out = _doctor(tmp_path, shm_space=lambda: 64 << 20, local_ranks=4)
    assert rc == 1
    assert "/dev/shm: 64 MiB free, 1.751 GiB needed: too small" in out
    assert "--shm-size=" in out and "SPARKCCL_SLOT_BYTES" in out
    rc, out = _doctor(tmp_path, shm_space=lambda: None)
    assert rc == 1 and "/dev/shm is not mounted" in out
    rc, out = _doctor(tmp_path, shm_space=lambda: 1 << 40, world=9)
    assert rc == 1 and "--world 9: world size must be 2..8" in out


def test_the_exception_hierarchy_as_exported():
    E = sparkccl
    assert {"SparkcclError", "ConfigError", "FabricError", "CudaUnavailable",
            "CollectiveError", "Communicator"} <= set(dir(E)) and \
        set(E.__all__) >= {"SparkcclError", "ConfigError", "FabricError", "CudaUnavailable",
                           "CollectiveError", "Communicator"}
    assert issubclass(E.ShmSpaceError, E.ConfigError) and "ShmSpaceError" in E.__all__
    for cls, builtin in ((E.ConfigError, ValueError), (E.FabricError, ValueError),
                         (E.ShmSpaceError, ValueError),
                         (E.CudaUnavailable, RuntimeError), (E.CollectiveError, RuntimeError)):
        assert issubclass(cls, E.SparkcclError) and issubclass(cls, builtin), cls
        assert cls.__module__ == "sparkccl.errors"
    from sparkccl.dataplane import nvrtc
    from sparkccl.fabric import FabricError
    assert nvrtc.CudaUnavailable is E.CudaUnavailable and FabricError is E.FabricError
    e = E.CollectiveError("x", rank=1, peer=2, connection="channel 0 root 1")
    import pickle
    back = pickle.loads(pickle.dumps(e))
    assert (back.rank, back.peer, back.connection, back.cause) == (1, 2, "channel 0 root 1", "x")


def test_package_metadata():
    tomllib = pytest.importorskip("tomllib", reason="Python < 3.11 has no tomllib")
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["version"] == sparkccl.__version__
    assert meta["license"] == {"text": "Apache-2.0"} and meta["authors"]
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]
    assert {"plot", "cuda", "test"} <= set(meta["optional-dependencies"])


def test_shm_workers_spin_only_where_they_have_cores(monkeypatch):
    """SPARKCCL_SHM_WORKER_SPIN_US unset: the copy workers spin for the proxy's spin time
    only where every rank's proxy, caller and copy workers (one per peer and root) have a
    core; else they sleep at once. Set: as given."""
    monkeypatch.setattr(config, "usable_cpus", lambda: 16)
    assert config.resolve(local_ranks=2, env={}).worker_spin_us == config.DEFAULT_SPIN_US
    assert config.resolve(local_ranks=2, env={"SPARKCCL_PROXY_SPIN_US": "70"}).worker_spin_us == 70
    assert config.resolve(local_ranks=4, env={}).worker_spin_us == 0  # 4 * (2 + 3 * 2) > 16
    monkeypatch.setattr(config, "usable_cpus", lambda: 2)
    assert config.resolve(local_ranks=2, env={}).worker_spin_us == 0
    assert config.resolve(local_ranks=2, env={"SPARKCCL_SHM_WORKER_SPIN_US": "9"}).worker_spin_us == 9
