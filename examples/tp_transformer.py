"""torch's own tensor-parallel API on backend "sparkccl": a small transformer, CPU.

    torchrun --nproc-per-node 2 examples/tp_transformer.py
    torchrun --nproc-per-node 3 examples/tp_transformer.py --topology ring --transport tcp

A decoder-only transformer built from plain ``torch.nn`` (embedding, RMSNorm, attention,
SwiGLU MLP, LM head) with random bf16 weights (seeded: the same model on every rank) is
split by ``torch.distributed.tensor.parallel.parallelize_module`` with the usual
Megatron-style plan: q / k / v and gate / up projections column-parallel, the attention
output and down projections row-parallel (their partial sums are all-reduced: two
all-reduces per layer, DTensor's functional collectives), the LM head column-parallel with
its logits gathered. sparkccl is never called directly: the collectives reach it through
the process group, which counts them.

Every rank prints the digest of the logits and the group's counts. The all-reduced partial
sums are fp32 sums in rank order, rounded once, so the digest is the same on every rank,
topology (mesh, ring), transport (shm, tcp) and run; with gloo or NCCL the summation
order is theirs. (A different world size splits the matmuls differently, so its partial
sums and digest differ, with any library.)
"""
from __future__ import annotations

import argparse
import hashlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB, HIDDEN, HEADS, FFN, LAYERS = 256, 192, 6, 384, 2   # heads and widths: divisible by 2, 3
BATCH, SEQ = 2, 24
SEED = 30


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
                * self.weight).to(x.dtype)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = HIDDEN // HEADS
        self.q = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.k = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.v = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.o = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        # -1 heads: this rank's share of them once q / k / v are column-parallel
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(HIDDEN, FFN, bias=False)
        self.up = nn.Linear(HIDDEN, FFN, bias=False)
        self.down = nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(HIDDEN), Attention()
        self.mlp_norm, self.mlp = RMSNorm(HIDDEN), MLP()

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = RMSNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x)
        return self.lm_head(self.norm(x))


def build_model(seed: int = SEED) -> Transformer:
    """Random weights from ``seed``: the same model on every rank, nothing downloaded."""
    torch.manual_seed(seed)
    return Transformer().to(torch.bfloat16)


def parallelize(model: Transformer, mesh) -> Transformer:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    plan = {"lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(LAYERS):
        plan.update({f"blocks.{i}.attn.{p}": ColwiseParallel() for p in ("q", "k", "v")})
        plan.update({f"blocks.{i}.mlp.{p}": ColwiseParallel() for p in ("gate", "up")})
        plan[f"blocks.{i}.attn.o"] = RowwiseParallel()
        plan[f"blocks.{i}.mlp.down"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


def tokens(seed: int = SEED) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def digest(t: torch.Tensor) -> str:
    raw = t.detach().contiguous().view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()[:16]


def logits_on(group) -> torch.Tensor:
    """The tensor-parallel model's logits on ``group`` (collective over it)."""
    from torch.distributed.device_mesh import DeviceMesh
    mesh = DeviceMesh.from_group(group, "cpu")
    model = parallelize(build_model(), mesh)
    with torch.no_grad():
        out = model(tokens())
    return out.full_tensor() if hasattr(out, "full_tensor") else out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--topology", default="mesh", choices=("mesh", "ring"))
    ap.add_argument("--transport", default="auto", choices=("auto", "shm", "tcp", "verbs"))
    ap.add_argument("--backend", default="sparkccl", help="sparkccl, or gloo to compare")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.backend == "sparkccl":
        from sparkccl.integrations.torch_backend import Options
        dist.init_process_group("sparkccl", pg_options=Options(topology=a.topology,
                                                               transport=a.transport))
    else:
        dist.init_process_group(a.backend)
    rank = dist.get_rank()
    logits = logits_on(dist.group.WORLD)
    pg = dist.group.WORLD
    counts = (f" routed {dict(pg.routed)} declined {dict(pg.declined)}"
              if hasattr(pg, "routed") else "")
    print(f"rank {rank}/{dist.get_world_size()} {a.backend} {a.topology}: logits "
          f"{list(logits.shape)} {logits.dtype} digest {digest(logits)}{counts}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "1")
    main()
