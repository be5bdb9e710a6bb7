"""Fused MoE finalize + reduce-scatter against the unfused path, 2 ranks on 2 GPUs.

One MoE layer's combine under sequence parallelism (docs/CONTRACT.md §4), T = 16384 tokens, H = 4096,
topk = 8 by default: every rank holds partial expert outputs y [T * topk, H] (bf16), the
routing (pos, weights) and the shared-expert output [T, H], and ends with its T / W rows of
the sum over ranks.

  fused          Communicator.moe_finalize_reduce_scatter: rows computed straight into the
                 send slot, row pieces sent while later rows are computed
  finalize       torch finalize alone (torch.compile of the FMA chain; --finalize eager: a
                 loop of index_select + addcmul_), rows in device memory
  sparkccl rs    Communicator.reduce_scatter of the finalized rows
  nccl rs        torch.distributed.reduce_scatter_tensor (NCCL) of the finalized rows
  unfused        finalize + sparkccl rs, and finalize + nccl rs

Each time is the wall time of one call (every rank synchronized and at a barrier first),
the slowest rank per iteration, median over --iters. Routing weights are powers of two, so
the torch finalize's multiply-add equals the FMA chain and "fused == unfused sparkccl" must
hold bit for bit (checked and printed). With ``SPARKCCL_GPU_DIRECT`` support, both data-plane
modes are measured (--modes).

    NCCL_NVLS_ENABLE=0 python3 benchmarks/finalize_bench.py --out benchmarks/finalize_h200x2.txt

Needs 2 GPUs (one per rank), torch with NCCL, cuda-python; builds nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

# NVLink multicast stays off (shared machines); the caller may set more.
for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def make_inputs(rank: int, T: int, H: int, topk: int, seed: int, device):
    """Made on the GPU (a CPU generator would take minutes at this size)."""
    import torch
    g = torch.Generator(device=device)
    g.manual_seed(seed * 7919 + rank)
    R = T * topk  # one expert-output row per (token, k), as after a grouped GEMM
    kw = dict(generator=g, device=device)
    y = (torch.randn((R, H), **kw) * 0.5).to(torch.bfloat16)
    pos = torch.randperm(R, **kw).to(torch.int32)
    # Powers of two: multiply-add == FMA, so the unfused sparkccl path equals the fused one.
    weights = torch.exp2(torch.randint(-5, 0, (T, topk), **kw).to(torch.float32))
    shared = (torch.randn((T, H), **kw) * 0.5).to(torch.bfloat16)
    y8 = (torch.randn((R, H), **kw) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = torch.exp2(torch.randint(-8, -4, (R, H // 128), **kw).to(torch.float32))
    return dict(y=y, pos=pos, weights=weights, shared=shared, y8=y8, scales=scales)


def torch_finalizer(kind: str, topk: int):
    """fn(y, pos2 [T, topk] int64, weights, shared) -> bf16 rows [T, H]."""
    import torch

    def eager(y, pos2, weights, shared):
        acc = shared.float()
        for k in range(topk):
            acc.addcmul_(y.index_select(0, pos2[:, k]).float(), weights[:, k:k + 1])
        return acc.to(torch.bfloat16)

    def chain(y, pos2, weights, shared):
        acc = shared.float()
        for k in range(topk):
            acc = acc + weights[:, k:k + 1] * y[pos2[:, k]].float()
        return acc.to(torch.bfloat16)

    if kind == "eager":
        return eager, "eager (index_select + addcmul_ per k)"
    try:
        return torch.compile(chain, dynamic=False), "torch.compile (one fused gather + FMA kernel)"
    except Exception as e:  # pragma: no cover - depends on the install
        return eager, f"eager (torch.compile failed: {e})"


def bench_job(rank, world, store, cfg):
    import torch
    import torch.distributed as dist

    import sparkccl
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    T, Tpad, H, topk = cfg["tokens"], cfg["tokens"], cfg["hidden"], cfg["topk"]
    dist.init_process_group("nccl", store=dist.PrefixStore("nccl", store), rank=rank,
                            world_size=world, device_id=dev)
    inp = make_inputs(rank, T, H, topk, cfg["seed"], dev)
    pos2 = inp["pos"].view(T, topk).long()
    fin, fin_name = torch_finalizer(cfg["finalize"], topk)
    rows_pad = -(-(Tpad // world) // 8) * 8
    slot = max(64 << 20, world * rows_pad * 2 * H)

    def timed(fn, sync_comm=None):
        times = []
        for it in range(cfg["warmup"] + cfg["iters"]):
            torch.cuda.synchronize()
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if sync_comm is not None:
                sync_comm.synchronize()
            torch.cuda.synchronize()
            if it >= cfg["warmup"]:
                times.append(time.perf_counter() - t0)
        t = torch.tensor(times, dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a collective takes its slowest rank's time
        return statistics.median(t.tolist()) * 1e3

    out = {"finalize_impl": fin_name, "rows_per_rank": Tpad // world, "slot_bytes": slot,
           "modes": {}}
    rows = fin(inp["y"], pos2, inp["weights"], inp["shared"])  # compile outside the timing
    torch.cuda.synchronize()
    out["finalize_ms"] = timed(lambda: fin(inp["y"], pos2, inp["weights"], inp["shared"]))
    nccl_out = torch.empty((Tpad // world, H), dtype=torch.bfloat16, device=dev)
    out["nccl_rs_ms"] = timed(lambda: dist.reduce_scatter_tensor(nccl_out, rows))

    def unfused_nccl():
        r = fin(inp["y"], pos2, inp["weights"], inp["shared"])
        dist.reduce_scatter_tensor(nccl_out, r)

    out["unfused_nccl_ms"] = timed(unfused_nccl)
    for mode in cfg["modes"]:
        env_before = os.environ.get("SPARKCCL_GPU_DIRECT")
        os.environ["SPARKCCL_GPU_DIRECT"] = "1" if mode == "direct" else "0"
        try:
            comm = sparkccl.Communicator(store=dist.PrefixStore(f"sccl-{mode}", store), rank=rank,
                                         world_size=world, device="cuda", slot_bytes=slot,
                                         timeout_s=120)
        finally:
            if env_before is None:
                os.environ.pop("SPARKCCL_GPU_DIRECT", None)
            else:
                os.environ["SPARKCCL_GPU_DIRECT"] = env_before
        m = {"gpu_direct": bool(comm._wiring and comm._wiring.gpu_direct)}
        with comm:
            def fused():
                return comm.moe_finalize_reduce_scatter(inp["y"], inp["pos"], inp["weights"],
                                                        inp["shared"], num_tokens=T,
                                                        padded_tokens=Tpad)

            def fused_fp8():
                return comm.moe_finalize_reduce_scatter(inp["y8"], inp["pos"], inp["weights"],
                                                        inp["shared"], num_tokens=T,
                                                        padded_tokens=Tpad,
                                                        y_scales=inp["scales"])

            def unfused():
                return comm.reduce_scatter(fin(inp["y"], pos2, inp["weights"], inp["shared"]))

            m["fused_ms"] = timed(fused, comm)
            m["fused_e4m3_ms"] = timed(fused_fp8, comm)
            m["sparkccl_rs_ms"] = timed(lambda: comm.reduce_scatter(rows), comm)
            m["unfused_sparkccl_ms"] = timed(unfused, comm)
            a, b = fused(), unfused()
            comm.synchronize()
            m["fused_equals_unfused_sparkccl"] = bool(torch.equal(a.view(torch.int16),
                                                                  b.view(torch.int16)))
            m["fused_vs_nccl_max_abs_diff"] = float((a.float() - nccl_out.float()).abs().max())
            m["ratio_unfused_sparkccl_over_fused"] = m["unfused_sparkccl_ms"] / m["fused_ms"]
            m["ratio_unfused_nccl_over_fused"] = out["unfused_nccl_ms"] / m["fused_ms"]
        out["modes"][mode] = m
    dist.destroy_process_group()
    return out


def describe_env() -> dict:
    import torch
    d = {"python": platform.python_version(), "torch": torch.__version__,
         "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
         "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
         "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE")}
    try:
        d["sparkccl_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                              capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    return d


def report(cfg, env, res) -> str:
    lines = [f"# sparkccl fused MoE finalize + reduce-scatter, {cfg['world']} ranks "
             f"(one GPU each), T = {cfg['tokens']}, H = {cfg['hidden']}, topk = {cfg['topk']}",
             f"# {json.dumps(env)}",
             f"# torch finalize: {res['finalize_impl']}; slot {res['slot_bytes'] >> 20} MiB; "
             f"median of {cfg['iters']} calls (slowest rank per call), ms", ""]
    lines.append(f"{'torch finalize alone':<44} {res['finalize_ms']:8.3f}")
    lines.append(f"{'NCCL reduce_scatter alone':<44} {res['nccl_rs_ms']:8.3f}")
    lines.append(f"{'unfused: torch finalize + NCCL':<44} {res['unfused_nccl_ms']:8.3f}")
    for mode, m in res["modes"].items():
        tag = f"[{mode}{'' if m['gpu_direct'] == (mode == 'direct') else ' (not available)'}]"
        lines += ["",
                  f"{tag + ' sparkccl reduce_scatter alone':<44} {m['sparkccl_rs_ms']:8.3f}",
                  f"{tag + ' unfused: torch finalize + sparkccl':<44} {m['unfused_sparkccl_ms']:8.3f}",
                  f"{tag + ' FUSED finalize + reduce-scatter (bf16)':<44} {m['fused_ms']:8.3f}",
                  f"{tag + ' fused, e4m3 y + scales':<44} {m['fused_e4m3_ms']:8.3f}",
                  f"{tag + ' ratio unfused sparkccl / fused':<44} "
                  f"{m['ratio_unfused_sparkccl_over_fused']:8.2f}x",
                  f"{tag + ' ratio unfused NCCL / fused':<44} "
                  f"{m['ratio_unfused_nccl_over_fused']:8.2f}x",
                  f"{tag + ' fused == unfused sparkccl (bitwise)':<44} "
                  f"{m['fused_equals_unfused_sparkccl']}",
                  f"{tag + ' max |fused - NCCL path|':<44} {m['fused_vs_nccl_max_abs_diff']:.3g}"]
    lines += ["", "json: " + json.dumps({"config": cfg, "env": env, "results": res})]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the report here too")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--finalize", choices=("compile", "eager"), default="compile")
    ap.add_argument("--modes", default="direct,proxy",
                    help="data-plane modes to measure: direct (SPARKCCL_GPU_DIRECT=1), proxy (=0)")
    args = ap.parse_args(argv)
    import torch

    from sparkccl.localrun import check, run_ranks
    if torch.cuda.device_count() < args.world:
        print(f"finalize_bench: needs {args.world} GPUs, found {torch.cuda.device_count()}",
              file=sys.stderr)
        return 2
    if args.tokens % args.world:
        print("finalize_bench: --tokens must be a multiple of --world", file=sys.stderr)
        return 2
    cfg = dict(tokens=args.tokens, hidden=args.hidden, topk=args.topk, world=args.world,
               iters=args.iters, warmup=args.warmup, seed=args.seed, finalize=args.finalize,
               modes=[m for m in args.modes.split(",") if m])
    t0 = time.time()
    res = check(run_ranks(bench_job, args.world, args=(cfg,), timeout_s=1800))[0]
    text = report(cfg, describe_env(), res)
    text += f"# wall {time.time() - t0:.0f} s\n"
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
