"""A sequence-parallel transformer block and an MoE finalize on plain torch.distributed.

    torchrun --nproc-per-node 4 examples/sp_block.py --backend sparkccl
    torchrun --nproc-per-node 4 examples/sp_block.py --backend sparkccl --topology ring
    torchrun --nproc-per-node 2 examples/sp_block.py --backend sparkccl
    torchrun --nproc-per-node 4 examples/sp_block.py --backend gloo        # the same digests
    torchrun --nproc-per-node 2 examples/sp_block.py --backend sparkccl --device cuda

Each rank holds T / world tokens of the sequence. The block:

    RMSNorm (this rank's tokens) -> all_gather_single (the whole sequence)
    -> column-parallel matmul, ReLU -> row-parallel matmul (partial sums)
    -> reduce_scatter_single (this rank's tokens) -> residual add
    -> all_gather_single (the output, for the digest)

and, tensor-parallel style, all_reduce of the same partial sums (whose rows must equal the
reduce-scattered ones bit for bit),

then an MoE layer's finalize (weighted sum of the top-k expert outputs plus the shared
expert, summed over the ranks that hold the experts) fused into the reduce-scatter
(``Communicator.moe_finalize_reduce_scatter`` of the group's communicator; with another
backend, the same sum through ``reduce_scatter_single``).

Every rank prints the same digests: sparkccl sums in fp32 in rank order on every topology.
The digests also agree across world sizes and with gloo, because this example keeps its
arithmetic exact: activations and weights sit on coarse grids (small multiples of powers of
two), so no sum rounds however the work is split. With ordinary data a different split of
the matmul gives different partial sums, and so different bits, with any library.
"""
from __future__ import annotations

import argparse
import hashlib
import os

import torch
import torch.distributed as dist

T, H, F = 1024, 512, 1024      # tokens, hidden, FFN width (divisible by the world size)
EXPERTS, TOPK = 8, 2
SEED = 1234
# torch 2.13's names; the older ones warn there on every call, and are all that torch < 2.13 has.
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
DEVICE = torch.device("cpu")  # --device cuda: one GPU per rank (LOCAL_RANK), shared if fewer


def grid(shape, lo, hi, scale, seed):
    """Integers in [lo, hi] times ``scale``: the same values on every rank and world size."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(lo, hi + 1, shape, generator=g).to(torch.float32) * scale).to(DEVICE)


def rms_norm(x, weight, eps=1e-6):
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight
    # Onto a grid of 1/8 in [-4, 4], so that the matmuls below are exact.
    return (y * 8).round().clamp(-32, 32).div(8).to(torch.bfloat16)


def digest(t):
    raw = t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()[:16]


def sp_block(x_local, group, rank, world):
    """One block on this rank's tokens ``x_local`` [T / world, H] (bf16)."""
    norm_w = grid((H,), 1, 4, 0.5, SEED + 1)
    w1 = grid((H, F), -2, 2, 0.25, SEED + 2)      # column-parallel: this rank's columns
    w2 = grid((F, H), -2, 2, 0.25, SEED + 3)      # row-parallel: this rank's rows
    cols = slice(rank * F // world, (rank + 1) * F // world)

    xn_local = rms_norm(x_local, norm_w)
    xn = torch.empty(T, H, dtype=torch.bfloat16, device=DEVICE)
    all_gather_single(xn, xn_local, group=group)

    h = torch.relu(xn.float() @ w1[:, cols])
    h = (h / 4).round().clamp(-32, 32)
    partial = h @ w2[cols, :]                     # fp32 partial sums, [T, H]
    out_local = torch.empty(T // world, H, dtype=torch.float32, device=DEVICE)
    reduce_scatter_single(out_local, partial, group=group)

    y_local = (x_local.float() + out_local).to(torch.bfloat16)
    y = torch.empty(T, H, dtype=torch.bfloat16, device=DEVICE)
    all_gather_single(y, y_local, group=group)
    # Tensor-parallel style instead: all_reduce the partial sums (reduce-scatter then
    # all-gather inside sparkccl): the same bits as the reduce-scattered rows above.
    full = partial.clone()
    dist.all_reduce(full, group=group)
    return y, full, out_local


def moe_inputs(rank, world):
    """Routing, expert outputs and shared-expert output; this rank holds experts
    ``rank * EXPERTS / world ...``. Tokens routed to other ranks' experts get weight 0 here."""
    g = torch.Generator().manual_seed(SEED + 10)
    experts = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(T)])
    weights_all = torch.tensor([0.5, 0.25])[None, :].expand(T, TOPK).contiguous()
    mine = (experts * world // EXPERTS) == rank
    # Expert e's output for token t: a small-integer row, the same on every world size.
    y_rows = [torch.zeros(H, device=DEVICE)]
    pos = torch.zeros(T, TOPK, dtype=torch.int32)
    for t, k in mine.nonzero().tolist():
        e = int(experts[t, k])
        y_rows.append(grid((H,), -8, 8, 1.0, SEED + 100 + e * T + t))
        pos[t, k] = len(y_rows) - 1
    y = torch.stack(y_rows).to(torch.bfloat16)
    weights = torch.where(mine, weights_all, torch.zeros(())).to(DEVICE)
    shared = grid((T, H), -8, 8, 1.0, SEED + 11).to(torch.bfloat16)
    if rank != 0:
        shared = torch.zeros_like(shared)  # the shared expert is counted once, on rank 0
    return y, pos.reshape(-1).to(DEVICE), weights, shared


def moe_finalize(group, rank, world):
    y, pos, weights, shared = moe_inputs(rank, world)
    comm = getattr(group, "communicator", None)
    if comm is not None and world > 1:
        # The fused finalize + reduce-scatter of the sparkccl backend's communicator.
        part = comm(DEVICE).moe_finalize_reduce_scatter(y, pos, weights, shared,
                                                       num_tokens=T, padded_tokens=T)
    else:
        rows = shared.float() + (weights[..., None] * y.float()[pos.long()].view(T, TOPK, H)).sum(1)
        part = torch.empty(T // world, H, dtype=torch.float32, device=DEVICE)
        reduce_scatter_single(part, rows.to(torch.bfloat16).float(), group=group)
        part = part.to(torch.bfloat16)
    out = torch.empty(T, H, dtype=torch.bfloat16, device=DEVICE)
    all_gather_single(out, part, group=group)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="sparkccl")
    ap.add_argument("--topology", choices=["mesh", "ring"], default="mesh")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = ap.parse_args()
    global DEVICE
    if args.device == "cuda":
        # One GPU per rank; with fewer GPUs than ranks they share (correctness runs only).
        DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))
                              % torch.cuda.device_count())
        torch.cuda.set_device(DEVICE)
    torch.set_num_threads(1)
    options = None
    if args.backend == "sparkccl":
        from sparkccl.integrations.torch_backend import Options  # also registers "sparkccl"
        options = Options(topology=args.topology)
    dist.init_process_group(args.backend, pg_options=options)
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD

    x = grid((T, H), -16, 16, 0.25, SEED).to(torch.bfloat16)
    x_local = x[rank * T // world:(rank + 1) * T // world].contiguous()
    y, full, out_local = sp_block(x_local, group, rank, world)
    rows = slice(rank * T // world, (rank + 1) * T // world)
    same = torch.equal(full[rows].view(torch.int32), out_local.view(torch.int32))
    moe = moe_finalize(group, rank, world)

    routed = dict(getattr(group, "routed", {}))
    declined = dict(getattr(group, "declined", {}))
    print(f"rank {rank}/{world} {args.backend} {args.topology} {args.device}: block {digest(y)} "
          f"all_reduce {digest(full)} (= reduce-scatter: {same}) moe {digest(moe)} | "
          f"sparkccl ran {routed} "
          f"fallback {declined}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
