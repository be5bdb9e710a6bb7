// The two-step all-reduce as one operation under one seq (docs/PROTOCOL.md "All-reduce",
// "Two steps fused on CUDA"): one launch per collective, the union of a reduce-scatter's and
// an all-gather's wire (ring entries of op RS, then of op AG; the proxies cannot tell it from
// the CPU twin's, CpuDataPlane.all_reduce). GPU-direct where a.rs_dtab and a.ag_dtab are set
// (the kernel runs this rank's publish streams of both ops itself, entries CHUNK_DIRECT, as
// sccl_rs_direct_* and sccl_ag_direct do), else the proxy path. Roles:
//
//   blocks [0, npub): the RS publish. GPU-direct: direct.cu's direct_publish along the RS
//      table. The proxy path: chunks j != rank of the input go into RS send slot
//      seq % 2 (a zero-copy input lies there already: npub is 1 and it only hands off), and
//      the RS entries (first ring index + c) go to the proxy: a slice of at most
//      ONE_HANDOFF_SLICE, or a zero-copy input, in one hand-off (every piece is ready at
//      once); else piece by piece, publish.cu's finish_piece. The own chunk is not copied:
//      no stream sends it, the sum reads it from the input, and in place a copy of it could
//      read a result the consumers already wrote.
//   block npub: the poller. One progress word serves both parts: the RS part's units first
//      (wait.cu, the RS WaitParams), then the AG part's, counted on from the RS part's last
//      (WaitArgs::ubase). RS data depends only on the publishes at the start, and AG piece c
//      of a source only on RS piece c of every rank, so waiting for the whole RS part first
//      never holds back a wait another rank's progress needs; it is also the wire's order
//      (each connection carries the RS pieces, all queued at the start, ahead of the AG's).
//   blocks npub + 1 ..: the consumers. Per piece c (a one-hand-off slice: all at once), once
//      piece c of this rank's chunk came from every source (part by part, as rs_wait sums
//      it), reduce_scatter.cu's team_reduce, the reduce-scatter's very sum (rank order,
//      fp32, AVG divided once, rounded once), stores the rounded piece into this rank's
//      block of AG slot seq % 3 and into the result, from the same registers; the last
//      consumer block to finish the piece hands it to the proxy as AG piece c (ring index
//      first + PIECES + c); GPU-direct, the sum goes to the result alone and on from there
//      to the peers (fused_ag_send) before the hand-off. Then wait.cu's ag_wait copies the
//      peers' AG pieces out as they arrive.
//
// The last block to finish advances the device state by both parts' entries (2 * PIECES), so
// a captured all-reduce replays with fresh numbers (docs/PROTOCOL.md "Sequence state").
#pragma once
#include "allreduce.cu"

__device__ void fused_rs_publish(const FusedAllReduceArgs& a, u64* state, u64 seq, u64 first,
                                 int rank, int world, u32 blk, u32 npub) {
  if (plane_failed(state)) return;  // (nothing more to the peers: see plane_failed)
  u32* counters = (u32*)a.counters + (seq % COUNTER_SETS) * PIECES;
  u8* send = slot_at((u8*)a.send, a.send_code, seq);
  const u8* src = (const u8*)a.src;
  u8* ring = (u8*)a.ring;
  if (a.rs_dtab) {  // GPU-direct: the reduce-scatter's publish streams, as sccl_rs_direct_*
    PubArgs p;
    p.src = src ? src : send; p.src_stride = src ? a.src_stride : a.S; p.src_sys = !src;
    p.L = a.L; p.S = a.S; p.dtab = (const u64*)a.rs_dtab; p.own_dst = (u8*)0; p.dst2 = (u8*)0;
    p.ring = ring; p.state = state; p.first_index = first; p.seq = seq; p.call = a.rs_call;
    p.sized = false; p.counters = counters;
    direct_publish(p, blk, npub);
    return;
  }
  if (!src || a.S <= ONE_HANDOFF_SLICE) {
    if (src)
      for (int j = 0; j < world; ++j)
        if (j != rank)
          team_copy<false>(send + j * a.S, (u8*)0, src + j * a.src_stride, a.L, blk, npub);
    hand_off(counters, npub, (const u64*)0, ring, state, first, seq, a.S, a.rs_call, 0,
             PIECES - 1, (u32)CHUNK_ALL);
    return;
  }
  const u32 bpp = npub / PIECES;
  const int c = (int)(blk / bpp);
  if (c >= PIECES) return;
  u64 lo, hi;
  piece_bounds(a.S, c, &lo, &hi);
  const u64 x = lo < a.L ? lo : a.L;
  const u64 e = hi < a.L ? hi : a.L;
  if (e > x)
    for (int j = 0; j < world; ++j)
      if (j != rank)
        team_copy<false>(send + j * a.S + x, (u8*)0, src + j * a.src_stride + x, e - x,
                         blk % bpp, bpp);
  finish_piece(counters + c, bpp, ring, state, first + c, seq, a.S, a.rs_call, c);
}

// GPU-direct, every consumer thread after its share of bytes [x, e) of piece [lo, hi): the
// units it summed (team_reduce's mapping: unit u of [x, e) is thread u % nthreads's) from the
// result `mine` into the peers' AG slots, along every AG direct-table item whose part of the
// piece holds them (direct.cu direct_publish's destinations). A thread re-reads only what it
// wrote itself, so no block waits for another before the piece's hand-off.
__device__ void fused_ag_send(const u64* dtab, const u8* mine, u64 seq, u64 S, u64 L, u64 lo,
                              u64 hi, u64 x, u64 e, u32 b, u32 nb) {
  const u64 ns = dtab[0];
  const u64* items = dtab + 1 + ns * DT_STREAM;
  const u64 tid = (u64)b * blockDim.x + threadIdx.x;
  const u64 nthreads = (u64)nb * blockDim.x;
  for (u64 s = 0; s < ns; ++s) {
    const u64* row = dtab + 1 + s * DT_STREAM;
    for (u64 t = row[DT_FIRST]; t < row[DT_FIRST] + row[DT_ITEMS]; ++t) {
      const u64* m = items + t * DT_ITEM;
      u64 pa = lo, pe = hi;
      part_cut((u32)m[DT_PART], L, &pa, &pe);
      const u64 a0 = pa > x ? pa : x, e0 = pe < e ? pe : e;
      if (e0 <= a0) continue;
      u8* d = (u8*)m[DT_BASE] + (seq % m[DT_SLOTS]) * m[DT_STRIDE] + m[DT_BLOCK] * S;
      const u64 u0 = (a0 - x) / 16;  // (parts and pieces are 16-byte aligned, L too)
      for (u64 u = u0 + (tid + nthreads - u0 % nthreads) % nthreads; x + 16 * u < e0;
           u += nthreads)
        st16(d + x + 16 * u, ld_any16(mine + x + 16 * u, false));
    }
  }
}

// The poller (one thread): the RS part's waits, then the AG part's (see above).
__device__ void fused_poll(const WaitArgs& wr, const WaitArgs& wa, bool whole) {
  if (whole) poll_whole_slice(wr);
  else poller(wr);
  if (plane_failed(wr.state)) return;  // (recorded once, by the RS part's wait)
  if (whole) poll_whole_slice(wa);
  else poller(wa);
}

template <class E>
__device__ void fused_consume(const FusedAllReduceArgs& a, const WaitArgs& wr,
                              const WaitArgs& wa, u64 first, u32 b, u32 nb) {
  const u64 seq = wr.seq, L = a.L, S = a.S;
  const int rank = wr.rank, world = wr.world;
  u8* const ag = slot_at((u8*)a.ag, a.ag_code, seq);
  u8* const block = ag + rank * S;  // this rank's AG block: what the proxy sends on
  const u8* const recv = slot_at((const u8*)a.recv, a.recv_code, seq);
  const bool zero_copy = a.src == 0;
  const u8* const own = zero_copy ? slot_at((const u8*)a.send, a.send_code, seq) + rank * S
                                  : (const u8*)a.src + rank * a.src_stride;
  u8* const mine = (u8*)a.dst + rank * a.dst_stride;
  u32* const counters = (u32*)a.ag_counters + (seq % COUNTER_SETS) * PIECES;
  u8* const ring = (u8*)a.ring;
  u64* const state = wr.state;
  const bool avg = a.avg != 0;
  // GPU-direct: the sum goes to the result only, then from there to the peers (no proxy
  // reads this rank's own AG block: relays forward only other origins' blocks), and the
  // entries say CHUNK_DIRECT: the proxy skips the AG publish streams the GPU ran.
  const u64* const dtab = (const u64*)a.ag_dtab;
  u8* const to = dtab ? mine : block;
  u8* const to2 = dtab ? (u8*)0 : mine;
  const u32 chunk = dtab ? (u32)CHUNK_DIRECT : (u32)CHUNK_ALL;
  u64 seen = 0;
  const u64 t0 = globaltimer();
  if (S <= ONE_HANDOFF_SLICE) {  // one wait for the RS part's last unit, one sum, one hand-off
    if (!wait_progress(wr, unit(wr, PIECES - 1, wr.maxw - 1, world - 1), &seen, t0)) return;
    team_reduce<E>(to, recv, own, zero_copy, S, 0, L, rank, world, b, nb, avg, to2);
    if (dtab)
      for (int c = 0; c < PIECES; ++c) {
        u64 lo, hi;
        piece_bounds(S, c, &lo, &hi);
        fused_ag_send(dtab, mine, seq, S, L, lo, hi, 0, L, b, nb);
      }
    hand_off(counters, nb, dtab, ring, state, first + PIECES, seq, S, a.ag_call, 0,
             PIECES - 1, chunk);
  } else {
    for (int c = 0; c < PIECES; ++c) {
      u64 lo, hi;
      piece_bounds(S, c, &lo, &hi);
      // As rs_wait: part k of the piece once every source's wait word k came (two roots or
      // directions per port send a piece in two parts), so the sum of the first part
      // overlaps the second's arrival; the piece is handed off once all of it is summed.
      for (int k = 0; k < wr.maxw; ++k) {
        const u32 part = (u32)wr.parts[world * wr.maxw + k];
        if (part == PART_NONE) continue;
        if (!wait_progress(wr, unit(wr, c, k, world - 1), &seen, t0)) return;
        u64 x = lo, e = hi;
        part_cut(part, L, &x, &e);
        if (e > x) {
          team_reduce<E>(to, recv, own, zero_copy, S, x, e, rank, world, b, nb, avg, to2);
          if (dtab) fused_ag_send(dtab, mine, seq, S, L, lo, hi, x, e, b, nb);
        }
      }
      if (dtab)
        hand_off(counters + c, nb, dtab, ring, state, first + PIECES, seq, S, a.ag_call, c, c,
                 chunk);
      else
        finish_piece(counters + c, nb, ring, state, first + PIECES + c, seq, S, a.ag_call, c);
    }
  }
  ag_wait(ag, (u8*)a.dst, a.dst_stride, L, S, wa, b + 1, nb + 1);  // (its block 0 polls)
}

template <class E>
__device__ __forceinline__ void allreduce_fused(const FusedAllReduceArgs& a) {
  const WaitParams* wp = (const WaitParams*)a.wp_rs;
  WAIT_ARGS_INIT(a.S)
  // The AG part's wait differs from the RS part's only in its tables (the WaitParams blocks
  // of one plane share everything else, maxw included) and in where its units start.
  const WaitParams* const wp_ag = (const WaitParams*)a.wp_ag;
  WaitArgs wa = w;
  wa.waits = (const int*)wp_ag->waits;
  wa.parts = (const int*)wp_ag->parts;
  wa.ubase = unit(w, PIECES - 1, w.maxw - 1, w.world - 1);
  const u32 npub = (u32)a.npub;
  const u64 first = state_word(state, STATE_RING);
  if (blockIdx.x < npub) {
    fused_rs_publish(a, state, w.seq, first, w.rank, w.world, blockIdx.x, npub);
  } else if (blockIdx.x == npub) {
    if (threadIdx.x == 0) fused_poll(w, wa, a.S <= ONE_HANDOFF_SLICE);
  } else {
    fused_consume<E>(a, w, wa, first, blockIdx.x - npub - 1, gridDim.x - npub - 1);
  }
  last_block_advances(state, 2 * PIECES, 0);
}

#define ALLREDUCE_FUSED_KERNEL(NAME, E)                                                      \
  extern "C" __global__ void __launch_bounds__(512) NAME(const FusedAllReduceArgs a) {       \
    allreduce_fused<E>(a);                                                                   \
  }

ALLREDUCE_FUSED_KERNEL(sccl_ar_fused_bf16, BF16)
ALLREDUCE_FUSED_KERNEL(sccl_ar_fused_f16, F16)
ALLREDUCE_FUSED_KERNEL(sccl_ar_fused_f32, F32)
