"""The command line (sparkccl/cli.py): argument checks before anything starts, help, version,
progress lines, the bench plot and its tables. Nothing here starts ranks except one small
run_ranks check and one small bench run (all_reduce and ep at toy sizes, world 2)."""
from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys

import pytest

import sparkccl
from sparkccl import bench, demo, localrun
from sparkccl.cli import build_parser, main
from sparkccl.progress import Progress

COMMANDS = ("demo", "bench", "plan", "doctor", "selftest")


@pytest.fixture
def nothing_starts(monkeypatch):
    """Fail the test if any rank would be started."""
    def refuse(*a, **k):
        raise AssertionError("ranks were started")
    monkeypatch.setattr(localrun, "run_ranks", refuse)
    monkeypatch.setattr(demo, "run_demo", refuse)
    monkeypatch.setattr(bench, "run_bench", refuse)


def _exit_code(argv, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        main(argv)
    return e.value.code, capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["demo", "--world", "0"], "argument --world: 0: sparkccl's plans cover 2 to 8 ranks"),
    (["demo", "--world", "9"], "argument --world: 9: sparkccl's plans cover 2 to 8 ranks"),
    (["demo", "--world", "1"], "argument --world: 1: sparkccl's plans cover 2 to 8 ranks"),
    (["demo", "--world", "four"], "argument --world: 'four' is not a whole number of ranks"),
    (["plan", "--collective", "all_gather", "--world", "0"], "2 to 8 ranks"),
    (["plan", "--collective", "all_gather", "--world", "9"], "2 to 8 ranks"),
    (["bench", "--world", "9"], "2 to 8 ranks"),
    (["demo", "--transport", "ib"], "invalid choice: 'ib'"),
    (["bench", "--min-bytes", "1.5Q"], "'1.5Q': expected a byte size"),
    (["bench", "--iters", "0"], "argument --iters: 0: must be at least 1"),
    (["bench", "--min-bytes", "2M", "--max-bytes", "1M"], "--min-bytes 2097152 is larger"),
    (["bench", "--baseline", "gloo", "--baseline", "mpi"],
     "unknown baseline mpi for device cpu (have: gloo)"),
    (["bench", "--collective", "alltoall"], "argument --collective: invalid choice: 'alltoall'"),
    (["bench", "--collective", "ep", "--tokens", "128,x"],
     "argument --tokens: '128,x': expected token counts"),
    (["bench", "--collective", "ep", "--tokens", "0"], "every count must be at least 1"),
    (["bench", "--collective", "ep", "--topk", "17"], "--topk 17: at most 16"),
    (["bench", "--collective", "ep", "--world", "2", "--experts-per-rank", "2", "--topk", "5"],
     "--topk 5: at most 16 and at most the experts (2 per rank x 2)"),
    (["bench", "--collective", "ep", "--hidden", "100"], "--hidden 100: must be a multiple of 8"),
])
def test_bad_arguments_exit_2_before_anything_starts(argv, message, capsys, nothing_starts):
    code, err = _exit_code(argv, capsys)
    assert code == 2
    assert f"sparkccl {argv[0]}: error:" in err and message in err
    assert err.count("error:") == 1 and "Traceback" not in err


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_device_cuda_without_a_gpu_exits_2_with_the_communicators_text(command, monkeypatch,
                                                                        capsys, nothing_starts):
    import torch
    from sparkccl.dataplane.cuda_runtime import check_available
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(sparkccl.CudaUnavailable) as e:  # what a rank's Communicator says
        check_available()
    code, err = _exit_code([command, "--device", "cuda"], capsys)
    assert code == 2
    assert f"sparkccl {command}: error: --device cuda: CudaUnavailable: {e.value}\n" in err
    assert "a visible GPU" in err and err.count("error:") == 1 and "Traceback" not in err


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_a_bad_setting_is_one_message_before_any_rank_starts(command, monkeypatch, capsys,
                                                            nothing_starts):
    monkeypatch.setenv("SPARKCCL_TIMEOUT_S", "abc")
    monkeypatch.setenv("SPARKCCL_ROOTS", "3")
    code, err = _exit_code([command], capsys)
    assert code == 2
    assert (f"sparkccl {command}: error: SPARKCCL_TIMEOUT_S='abc': expected a number; "
            "SPARKCCL_ROOTS='3': must be in [1, 2]\n") in err
    assert err.count("SPARKCCL_TIMEOUT_S") == 1 and "Traceback" not in err


def test_transports_are_accepted_and_passed_through(monkeypatch):
    seen = []
    monkeypatch.setattr(demo, "run_demo", lambda **kw: seen.append(kw) or 0)
    for t in ("auto", "shm", "tcp", "verbs"):
        assert main(["demo", "--transport", t, "--world", "2"]) == 0
    assert [kw["transport"] for kw in seen] == ["auto", "shm", "tcp", "verbs"]
    assert {kw["world"] for kw in seen} == {2}


def test_bench_sizes_parse_like_the_settings(monkeypatch):
    seen = {}
    monkeypatch.setattr(bench, "run_bench", lambda **kw: seen.update(kw) or 0)
    assert main(["bench", "--min-bytes", "1.5M", "--max-bytes", "64MiB", "--no-baseline"]) == 0
    assert seen["min_bytes"] == 3 << 19 and seen["max_bytes"] == 64 << 20
    assert main(["bench", "--no-baseline"]) == 0  # string defaults go through the same type
    assert seen["min_bytes"] == 1 << 20 and seen["max_bytes"] == 64 << 20


def test_bench_collectives_and_the_ep_layer_are_passed_through(monkeypatch):
    seen = {}
    monkeypatch.setattr(bench, "run_bench", lambda **kw: seen.update(kw) or 0)
    assert main(["bench", "--no-baseline"]) == 0
    assert seen["collectives"] == ("all_gather", "reduce_scatter")
    assert main(["bench", "--collective", "all_reduce", "--collective", "ep", "--tokens", "64,512",
                 "--hidden", "7168", "--topk", "8", "--experts-per-rank", "64",
                 "--ep-mode", "low_latency"]) == 0
    assert seen["collectives"] == ("all_reduce", "ep")
    assert seen["ep"] == bench.EpShape(tokens=(64, 512), hidden=7168, topk=8,
                                       experts_per_rank=64, mode="low_latency")


def test_bench_all_reduce_and_ep_tables(capsys):
    """A real run at toy sizes: the all_reduce table beside gloo, the ep table (its combines
    checked bit for bit inside: exact True, exit code 0) beside ag+rs and gloo's all-to-all."""
    rc = bench.run_bench(world=2, min_bytes=64 << 10, max_bytes=64 << 10, iters=1,
                         collectives=("all_reduce", "ep"),
                         ep=bench.EpShape(tokens=(8, 20), hidden=64, topk=4,
                                          experts_per_rank=4))
    out = capsys.readouterr().out
    assert rc == 0, out
    ar = out[out.index("\nall_reduce\n"):]
    assert "gloo busbw" in ar and "65536" in ar and "all_gather\n" not in out, out
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:3] == ["tokens", "ep", "ms"])
    rows = [line.split() for line in lines[head + 1:head + 3]]
    assert [r[0] for r in rows] == ["8", "20"] and all(r[4] == "True" for r in rows), out
    assert "gloo a2a ms" in out, out


def test_bench_plot_without_matplotlib_is_a_clear_error(monkeypatch, capsys, nothing_starts):
    monkeypatch.setattr(bench, "have_matplotlib", lambda: False)
    code, err = _exit_code(["bench", "--plot", "out.png"], capsys)
    assert code == 2 and "--plot needs matplotlib: pip install 'sparkccl[plot]'" in err


def test_bench_plot_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="the optional [plot] extra is not installed")
    path = tmp_path / "busbw.png"
    sizes = [1 << 20, 4 << 20, 16 << 20]
    bench.plot_busbw(str(path), sizes, {
        "all_gather": {"sparkccl": [1.0, 2.0, 3.0], "gloo": [0.5, None, 1.0]},
        "reduce_scatter": {"sparkccl": [1.0, 1.5, 2.5], "gloo": [0.4, 0.6, 0.9]}}, "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_help_lists_every_command_and_every_option_has_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for c in COMMANDS:
        assert f"\n    {c} " in out
    ap = build_parser()
    subs = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    assert set(subs.choices) == set(COMMANDS)
    for name, p in subs.choices.items():
        for action in p._actions:
            assert action.help, f"sparkccl {name} {action.option_strings}: no help text"
        text = p.format_help()
        for action in p._actions:
            if action.default not in (None, False, argparse.SUPPRESS) and action.option_strings:
                assert f"(default: {action.default})" in " ".join(text.split()), \
                    f"sparkccl {name} {action.option_strings[0]}: default not shown"


@pytest.mark.parametrize("command", COMMANDS)
def test_help_is_plain_text(command, capsys):
    """The doctor and selftest descriptions are module docstrings: no reST left in help."""
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    for markup in ("``", ":class:", ":func:", ":mod:", ":meth:", "**", "::\n"):
        assert markup not in out, (command, markup)
    if command == "doctor":
        assert "`sparkccl doctor`: what RDMA hardware" in out


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"sparkccl {sparkccl.__version__}"


def test_parser_imports_nothing_heavy():
    code = ("import sys; from sparkccl.cli import build_parser; build_parser(); "
            "heavy = [m for m in ('torch', 'numpy', 'sparkccl.comm', 'sparkccl._native') "
            "if m in sys.modules]; print(heavy); sys.exit(bool(heavy))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_progress_plain_lines_when_not_a_terminal():
    out = io.StringIO()
    p = Progress("demo", stream=out)
    p.update("all_gather", 1, 6)
    p(0, ("bursts", 2, 4, "bursts"))
    p.close()
    assert out.getvalue() == "demo: all_gather 1/6 sizes\ndemo: bursts 2/4 bursts\n"


def _reporting_job(rank, world, store, steps):
    for i in range(1, steps + 1):
        localrun.report_progress((f"rank{rank}", i, steps))
    return rank


@pytest.mark.slow
def test_run_ranks_delivers_progress_from_the_ranks():
    seen = []
    results = localrun.run_ranks(_reporting_job, 2, args=(3,), timeout_s=120,
                                 progress=lambda rank, item: seen.append((rank, item)))
    assert localrun.check(results) == [0, 1]
    for r in (0, 1):
        assert [item for rank, item in seen if rank == r] == \
            [(f"rank{r}", i, 3) for i in (1, 2, 3)]


def test_console_script_entry_point_is_the_cli():
    r = subprocess.run([sys.executable, "-m", "sparkccl.cli", "plan", "--collective",
                        "reduce_scatter", "--world", "3"], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert r.returncode == 0 and "verifier: passed" in r.stdout


def _shm_tokens(pids) -> set[str]:
    """The communicator tokens of the shared-memory segments these processes map."""
    import re
    tokens = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                tokens |= set(re.findall(r"/dev/shm/sparkccl-\d+-(\w+)-r\d+-", f.read()))
        except OSError:
            pass
    return tokens


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("when", ["ranks starting", "collectives running"])
def test_ctrl_c_on_demo_is_one_line_exit_130_nothing_left(when, tmp_path):
    """SIGINT to the demo's process group, as a terminal's Ctrl-C sends it: while the ranks'
    interpreters start, and once the collectives run."""
    import glob
    import signal
    import time
    # (SIGINT back to its default in the demo: a test run started as a background job of a
    # shell without job control inherits it ignored, and Python then leaves it ignored)
    p = subprocess.Popen([sys.executable, "-m", "sparkccl.cli", "demo", "--world", "2"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert p.stdout.readline().startswith("sparkccl demo: world 2")
        if when == "ranks starting":  # both ranks (and the resource tracker) started
            deadline = time.monotonic() + 60
            while len(_children(p.pid)) < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.3)
        else:
            first = p.stderr.readline()
            assert first.startswith("demo: all_gather 1/"), first
        children = _children(p.pid)
        assert len(children) >= 3, children
        tokens = _shm_tokens(children)
        os.killpg(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 130, (out, err)
    lines = [ln for ln in err.splitlines() if not ln.startswith("demo: ")]  # progress lines
    assert lines == ["sparkccl demo: interrupted"], err
    assert "demo: passed" not in out and "Traceback" not in out
    time.sleep(0.5)  # (the resource tracker leaves once the demo's pipes close)
    assert [c for c in children if _running(c)] == []
    assert when == "ranks starting" or tokens, "the ranks mapped no segment"
    assert [f for t in tokens for f in glob.glob(f"/dev/shm/sparkccl-*-{t}-*")] == []
