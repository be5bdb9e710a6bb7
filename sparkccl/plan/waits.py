"""What each wait word of a rank's plan carries: plan analysis for the executors that consume
pieces part by part (the CUDA data plane's wait kernels and its copy-engine mode).

A wait word k of source i (``plan.waits[op][i][k]``) is written by the sender of one stream;
that stream's items say which part of each piece (root share, direction half) it carries.
This module reads that from every rank's plan and packs it as the kernels expect
(:func:`part_code`). Pure Python: no torch, no native module.
"""
from __future__ import annotations

from .build import build_plan
from .geometry import Part
from .model import Op, RankPlan, Region


def part_code(part: Part) -> int:
    """A plan Part packed for the kernels: root | roots << 2 | half << 4 | halves << 6."""
    return part.root | part.roots << 2 | part.half << 4 | part.halves << 6


def part_of(code: int) -> Part:
    """The inverse of :func:`part_code`."""
    return Part(code & 3, code >> 2 & 3, code >> 4 & 3, code >> 6 & 3)


PART_NONE = 0
"""No part: the word carries nothing to copy or sum."""
PART_WHOLE = part_code(Part(0, 1, 0, 1))
"""The whole piece."""


def max_wait_words(plan: RankPlan) -> int:
    """The most wait words any source has for any op (at least 1): the tables' width."""
    return max(1, max(len(w) for op in Op for w in plan.waits[op]))


def wait_table(plan: RankPlan, maxw: int) -> list:
    """``[op][world][maxw]``: flag word k this rank waits on for source i, -1 where none."""
    table = [[[-1] * maxw for _ in range(plan.world)] for _ in Op]
    for op in Op:
        for i, words in enumerate(plan.waits[op]):
            for k, word in enumerate(words):
                table[int(op)][i][k] = int(word)
    return table


def wait_parts(plan: RankPlan, maxw: int) -> list:
    """``[op][world + 1][maxw]`` part codes: row i < world gives the part of each piece that
    wait word k of source i carries (from the writer's items, in the senders' plans), row
    world the parts the reduce-scatter reduces after word k of every source (the same split
    when every source cuts its pieces alike, else the whole piece after the last word)."""
    W, me = plan.world, plan.rank
    plans = [build_plan(plan.topology, W, q, plan.roots) for q in range(W)]
    out = [[[0] * maxw for _ in range(W + 1)] for _ in Op]
    for op in Op:
        dreg = Region.AG if op == Op.AG else Region.RS_RECV
        rows = {}
        for i, words in enumerate(plan.waits[op]):
            if i == me or not words:
                continue
            codes = []
            for w in words:
                parts = {it.part for q in range(W) if q != me for s in plans[q].streams
                         if s.op == op and s.dst_flag == w and plans[q].connections[s.conn].peer == me
                         for it in s.items if it.dst_region == dreg and it.dst_block == i}
                codes.append(part_code(next(iter(parts))) if len(parts) == 1 else None)
            if None in codes:  # not one part per word: the whole piece after the last word
                codes = [PART_NONE] * (len(codes) - 1) + [PART_WHOLE]
            rows[i] = codes
            for k, code in enumerate(codes):
                out[int(op)][i][k] = code
        uniform = bool(rows) and len({tuple(c) for c in rows.values()}) == 1
        split = next(iter(rows.values())) if uniform else [PART_NONE] * (maxw - 1) + [PART_WHOLE]
        for k, code in enumerate(split):
            out[int(op)][W][k] = code
    return out


def ce_words(waits: list, parts: list, rank: int, reduce: bool) -> list:
    """The wait words in which this rank receives every piece, in order, as (k, [(source,
    Part) copied once word k came], whether the reduce-scatter sums after word k). waits /
    parts: one op's rows of :func:`wait_table` and :func:`wait_parts`. A word no source
    sends is left out, unless the reduce-scatter sums there (the whole piece after the last
    word, where sources split pieces differently)."""
    W = len(waits)
    out = []
    for k in range(len(waits[0])):
        sums = reduce and parts[W][k] != PART_NONE
        if sums or any(waits[i][k] >= 0 for i in range(W) if i != rank):
            out.append((k, [(i, part_of(parts[i][k])) for i in range(W)
                            if i != rank and parts[i][k] != PART_NONE], sums))
    return out
