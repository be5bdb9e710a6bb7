// MoE finalize + reduce-scatter, through the proxy and GPU-direct.
#pragma once
#include "direct.cu"

// ---------------------------------------------------------------- MoE finalize (SPEC §6)
//
// sccl_finalize computes token rows straight into the reduce-scatter send slot:
//
//   row[t] = shared[t] + sum_k w[t, k] * y[pos[t * topk + k]]   (fp32 fmaf chain in k order)
//
// rounded once to bf16 (round to nearest even); rows t >= T are zero. With e4m3 y the term is
// yv = float(e4m3) * scale[p, col / 128] (one fp32 multiply, rounded), then the fmaf. The CPU
// twin is native/src/finalize_cpu.cpp (std::fmaf): same operations, same bits.
//
// One collective covers `rows` rows of every destination's chunk (local rows row_lo.. of
// chunk j = token rows j * Rr + row_lo + ...) in a slice of S = rows_pad * 2H bytes, rows_pad =
// rows rounded up to a multiple of 8 (the extra rows are zero and never copied out), cut
// into 8 row pieces (granule = one row). With rows_pad a multiple of 8 the row pieces are
// exactly the 16-byte-granule pieces every other step (proxy, waits, reduction) computes. Work items, in order: x = c * (W - 1) + k for row piece c = 0..7
// and peer k = 0..W-2 (destination j = (rank + 1 + k) % W, the mesh order), then this rank's
// own chunk, which is not sent: it goes to device memory (`own`) for the reduce-scatter wait
// kernel that follows. Every block takes a share of every item (so items finish in order,
// and the network starts on piece 0 while later pieces are computed); the last block to
// finish item (c, j) claims the next of the (W - 1) * 8 ring indices the host reserved and
// publishes it (RS, seq, piece c, chunk j, granule = row bytes): entries appear in completion
// order, and the proxy sends each destination's pieces in piece order.
//
// counters: [FIN_CLAIM] item counters, then the claim counter (all reset to 0 by their last
// user). bad: [0] count of out-of-range pos values met, [1..3] (t, k, value) of the first:
// such a term is NaN (never read out of bounds); the host raises at synchronize().

// FIN_CLAIM (protocol.h): counters per set before the claim counter (items <= 7 * 8 here).

// float8 e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, NaN = S.1111.111.
__device__ __forceinline__ float e4m3_to_f32(u32 b) {
  const u32 s = (b & 0x80u) << 24, e = (b >> 3) & 0xFu, m = b & 7u;
  if (e == 15 && m == 7) return __uint_as_float(s | 0x7FC00000u);
  if (e == 0) {
    const float f = (float)m * 0.001953125f;  // m * 2^-9, exact
    return s ? -f : f;
  }
  return __uint_as_float(s | ((e + 120u) << 23) | (m << 20));
}

__device__ __forceinline__ u64 ld_dev8_any(const u8* p) {
  if ((((u64)p) & 7) == 0) return *(const u64*)p;
  u64 v = 0;
  for (int q = 0; q < 8; ++q) v |= (u64)p[q] << (8 * q);
  return v;
}

struct FinArgs {
  const u8* y;          // [R, H] bf16, or e4m3 bytes
  const float* scales;  // [R, H / 128] (e4m3 only)
  const int* pos;       // [T * topk]
  const float* wts;     // [T, topk]
  const u8* shared;     // [T, H] bf16
  u32* bad;
  u64 T, topk, H, R, fp8;
};

__device__ void fin_bad(const FinArgs& a, u64 t, int k, int p) {
  if (atomicAdd(a.bad, 1u) == 0) {
    a.bad[1] = (u32)t;
    a.bad[2] = (u32)k;
    a.bad[3] = (u32)p;
  }
}

#define FIN_BATCH 8  // y loads in flight per thread before their fmaf steps

// 16 output bytes: columns [8 cu, 8 cu + 8) of token row t. Loads go in batches of
// FIN_BATCH rows (all in flight together), then that batch's steps of the chain in k order.
template <bool FP8>
__device__ __forceinline__ V16 fin_unit(const FinArgs& a, u64 t, u64 cu) {
  if (t >= a.T) {
    V16 z = {0u, 0u, 0u, 0u};
    return z;
  }
  float acc[8];
  unpack<BF16>(ld_any16(a.shared + (t * a.H + cu * 8) * 2, false), acc);
  const int* pp = a.pos + t * a.topk;
  const float* ww = a.wts + t * a.topk;
  const int K = (int)a.topk;
  for (int k0 = 0; k0 < K; k0 += FIN_BATCH) {
    if (!FP8) {
      V16 v[FIN_BATCH];
#pragma unroll
      for (int q = 0; q < FIN_BATCH; ++q) {
        const int k = k0 + q;
        if (k < K) {
          const int p = pp[k];
          if (p >= 0 && (u64)p < a.R) {
            v[q] = ld_any16(a.y + ((u64)p * a.H + cu * 8) * 2, false);
          } else {
            V16 nan = {0x7FC07FC0u, 0x7FC07FC0u, 0x7FC07FC0u, 0x7FC07FC0u};
            v[q] = nan;
            fin_bad(a, t, k, p);
          }
        }
      }
#pragma unroll
      for (int q = 0; q < FIN_BATCH; ++q) {
        if (k0 + q < K) {
          float f[8];
          unpack<BF16>(v[q], f);
          const float wk = ww[k0 + q];
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[e] = __fmaf_rn(wk, f[e], acc[e]);
        }
      }
    } else {
      const u64 groups = a.H / 128;
      u64 v[FIN_BATCH];
      float sc[FIN_BATCH];
#pragma unroll
      for (int q = 0; q < FIN_BATCH; ++q) {
        const int k = k0 + q;
        if (k < K) {
          const int p = pp[k];
          if (p >= 0 && (u64)p < a.R) {
            v[q] = ld_dev8_any(a.y + (u64)p * a.H + cu * 8);
            sc[q] = a.scales[(u64)p * groups + (cu * 8) / 128];
          } else {
            v[q] = 0x7F7F7F7F7F7F7F7Full;  // e4m3 NaN
            sc[q] = 1.0f;
            fin_bad(a, t, k, p);
          }
        }
      }
#pragma unroll
      for (int q = 0; q < FIN_BATCH; ++q) {
        if (k0 + q < K) {
          const float wk = ww[k0 + q];
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            const float yv = __fmul_rn(e4m3_to_f32((u32)(v[q] >> (8 * e)) & 0xFFu), sc[q]);
            acc[e] = __fmaf_rn(wk, yv, acc[e]);
          }
        }
      }
    }
  }
  // A NaN row element is the canonical NaN (0x7FFF), whatever produced it: the same bits
  // on every GPU, in the emulation and in the CPU twin (whose NaN payloads would differ).
#pragma unroll
  for (int e = 0; e < 8; ++e)
    if (acc[e] != acc[e]) acc[e] = __uint_as_float(0x7FFFFFFFu);
  return pack<BF16>(acc);
}

// Called by every thread of every block after its share of item x: the last block claims a
// ring index and publishes (piece c, chunk j).
__device__ __forceinline__ void fin_publish(u32* counters, u64 x, u64 items, u8* ring,
                                            u64* state, u64 first_index, u64 seq, u64 S, u64 RB,
                                            u64 call, int c, u64 j) {
  __threadfence_system();  // this thread's row stores before the count (and the tag)
  __syncthreads();
  if (threadIdx.x == 0) {
    u32 old = atomicAdd(counters + x, 1u);
    if (old == gridDim.x - 1) {
      __threadfence();  // acquire the other blocks' counts (and, cumulatively, their rows)
      counters[x] = 0;  // ready for the launch that reuses this counter set
      const u32 k = atomicAdd(counters + FIN_CLAIM, 1u);
      if (k == items - 1) counters[FIN_CLAIM] = 0;
      const u64 index = first_index + k;
      u64 lo, hi;
      piece_bounds_g(S, c, RB, &lo, &hi);
      write_entry(ring, state, index, seq, S, lo, hi, call, (u32)c, (u32)j, (u32)RB);
    }
  }
}

template <bool FP8>
__device__ __forceinline__ void fin_body(const FinArgs& a, u64 Rr, u64 row_lo, u64 rows,
                                         u64 rows_pad, u64 world, u64 rank, u8* send, u8* own, u8* ring,
                                         u64* state, u64 first_index, u64 seq, u64 call,
                                         u32* counters) {
  const u64 RB = 2 * a.H;       // row bytes: the piece granule
  const u64 S = rows_pad * RB;  // this collective's slice (rows per destination, padded)
  const u64 upr = a.H / 8;  // 16-byte output units per row
  const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  const u64 nthreads = (u64)gridDim.x * blockDim.x;
  const u64 peers = world - 1;
  const u64 items = PIECES * peers;
  for (u64 x = 0; x < items; ++x) {
    const int c = (int)(x / peers);
    const u64 j = (rank + 1 + x % peers) % world;
    u64 lo, hi;
    piece_bounds_g(S, c, RB, &lo, &hi);
    u8* out = send + j * S + lo;
    const u64 r0 = lo / RB;
    const u64 n = (hi - lo) / RB * upr;
    for (u64 u = tid; u < n; u += nthreads) {
      const u64 r = u / upr, cu = u - r * upr;
      const u64 t = r0 + r < rows ? j * Rr + row_lo + r0 + r : ~0ull;  // padding rows: zero
      st16(out + r * RB + cu * 16, fin_unit<FP8>(a, t, cu));
    }
    fin_publish(counters, x, items, ring, state, first_index, seq, S, RB, call, c, j);
  }
  const u64 tbase = rank * Rr + row_lo;
  const u64 n = rows * upr;
  for (u64 u = tid; u < n; u += nthreads) {
    const u64 r = u / upr, cu = u - r * upr;
    st_any16(own + r * RB + cu * 16, fin_unit<FP8>(a, tbase + r, cu));
  }
}

// Grid: any number of blocks (all resident for the best overlap: the host launches at most
// one per SM), 512 threads or fewer. send: slotted (send_code, see slot_at); counters:
// COUNTER_SETS sets of FIN_SET, by seq.
// FinArgs of the launch's rows (protocol.h kargs::FinRowsArgs).
__device__ __forceinline__ FinArgs fin_args(const FinRowsArgs& r) {
  FinArgs a;
  a.y = (const u8*)r.y; a.scales = (const float*)r.scales; a.pos = (const int*)r.pos;
  a.wts = (const float*)r.wts; a.shared = (const u8*)r.shared; a.bad = (u32*)r.bad;
  a.T = r.T; a.topk = r.topk; a.H = r.H; a.R = r.R; a.fp8 = r.fp8;
  return a;
}

// One parameter: protocol.h kargs::FinalizeArgs, by value.
extern "C" __global__ void __launch_bounds__(512) sccl_finalize(const FinalizeArgs x) {
  u64* const state = (u64*)x.state;
  if (plane_failed(state)) return;  // (the proxy may still send this slot; see plane_failed)
  const u64 seq = state_word(state, STATE_SEQ);
  const u64 first_index = state_word(state, STATE_RING);
  u8* const send = slot_at((u8*)x.send, x.send_code, seq);
  u32* const counters = (u32*)x.counters + (seq % COUNTER_SETS) * FIN_SET;
  const FinRowsArgs& r = x.rows;
  const FinArgs a = fin_args(r);
  if (r.fp8)
    fin_body<true>(a, r.Rr, r.row_lo, r.rows, r.rows_pad, x.world, x.rank, send, (u8*)x.own,
                   (u8*)x.ring, state, first_index, seq, x.call, counters);
  else
    fin_body<false>(a, r.Rr, r.row_lo, r.rows, r.rows_pad, x.world, x.rank, send, (u8*)x.own,
                    (u8*)x.ring, state, first_index, seq, x.call, counters);
}

// ---------------------------------------------------------------- MoE finalize, GPU-direct

// sccl_finalize_direct: the finalize when this rank's reduce-scatter streams run on the GPU
// (GPU-direct, see sccl_rs_direct_*): the publish blocks compute each row unit straight into
// the peer's mapped receive region (or a ring neighbour's staging block), item by item of
// the direct table, piece by piece; after each piece the last block hands it off
// (hand_off in direct.cu: every stream's flag and one ring entry, chunk -2: the proxy only
// relays).
// The own chunk's rows of piece c go to `own` (device memory), then gate[c] is bumped;
// the launch's other blocks run the reduce-scatter wait (1 poller + consumers), which
// reduces piece c once every source's piece arrived and gate[c] reached gate_target.
template <bool FP8>
__device__ void fin_direct_publish(const FinArgs& a, u64 Rr, u64 row_lo, u64 rows, u64 rows_pad,
                                   u64 rank, const u64* dtab, u8* own, u8* ring, u64* state,
                                   u64 first_index, u64 seq, u64 call, u32* counters, u32* gate,
                                   u32 b, u32 nb) {
  const u64 RB = 2 * a.H, S = rows_pad * RB, L = rows * RB;
  const bool failed = plane_failed(state);  // then nothing to the peers
  const u64 ns = failed ? 0 : dtab[0];
  const u64* items = dtab + 1 + ns * DT_STREAM;
  const u64 tid = (u64)b * blockDim.x + threadIdx.x;
  const u64 nthreads = (u64)nb * blockDim.x;
  for (int c = 0; c < PIECES; ++c) {
    u64 lo, hi;
    piece_bounds(S, c, &lo, &hi);  // row pieces: rows_pad is a multiple of 8
    for (u64 s = 0; s < ns; ++s) {
      const u64* row = dtab + 1 + s * DT_STREAM;
      for (u64 t = row[DT_FIRST]; t < row[DT_FIRST] + row[DT_ITEMS]; ++t) {
        const u64* m = items + t * DT_ITEM;
        u64 x = lo, e = hi;
        part_range((u32)m[DT_PART], &x, &e);
        if (e > L) e = L;  // padding rows are never read: not sent
        if (e <= x) continue;
        u8* d = (u8*)m[DT_BASE] + (seq % m[DT_SLOTS]) * m[DT_STRIDE] + m[DT_BLOCK] * S;
        const u64 tb = m[DT_CHUNK] * Rr + row_lo;  // token row of the chunk's local row 0
        for (u64 off = x + 16 * tid; off < e; off += 16 * nthreads) {
          const u64 lr = off / RB;
          st16(d + off, fin_unit<FP8>(a, tb + lr, (off - lr * RB) / 16));
        }
      }
    }
    hand_off(counters + c, nb, failed ? (const u64*)0 : dtab, ring, state, first_index, seq, S,
             call, c, c);
    const u64 e = hi < L ? hi : L;
    const u64 tb = rank * Rr + row_lo;
    for (u64 off = (lo < L ? lo : L) + 16 * tid; off < e; off += 16 * nthreads) {
      const u64 lr = off / RB;
      st_any16(own + off, fin_unit<FP8>(a, tb + lr, (off - lr * RB) / 16));
    }
    __threadfence();  // this thread's own rows before the bump
    __syncthreads();
    if (threadIdx.x == 0) atomicAdd(gate + c, 1u);
  }
}

// Grid: npub publish blocks, then 1 poller + consumer blocks (all resident: 2 per SM).
// counters: as sccl_*_direct's; recv: slotted (recv_code). The gate's target is the bumps of
// every earlier launch (STATE_GATE) plus this launch's npub.
// One parameter: protocol.h kargs::FinalizeDirectArgs, by value.
extern "C" __global__ void __launch_bounds__(256, 2) sccl_finalize_direct(
    const FinalizeDirectArgs x) {
  WAIT_PARAMS_OF(x)
  const u64 npub = x.npub;
  WAIT_ARGS_INIT(x.rows.rows_pad * 2 * x.rows.H)  // (rs_wait's S below)
  const u64 seq = w.seq;
  const u64 first_index = state_word(state, STATE_RING);
  const u64 gate_target = state_word(state, STATE_GATE) + npub;
  u32* const counters = (u32*)x.counters + (seq % COUNTER_SETS) * PIECES;
  u32* const gate = (u32*)x.gate;
  const FinRowsArgs& r = x.rows;
  if (blockIdx.x < npub) {
    const FinArgs a = fin_args(r);
    if (r.fp8)
      fin_direct_publish<true>(a, r.Rr, r.row_lo, r.rows, r.rows_pad, (u64)w.rank,
                               (const u64*)x.dtab, (u8*)x.own, (u8*)x.ring, state, first_index,
                               seq, x.call, counters, gate, blockIdx.x, (u32)npub);
    else
      fin_direct_publish<false>(a, r.Rr, r.row_lo, r.rows, r.rows_pad, (u64)w.rank,
                                (const u64*)x.dtab, (u8*)x.own, (u8*)x.ring, state, first_index,
                                seq, x.call, counters, gate, blockIdx.x, (u32)npub);
  } else {
    rs_wait<BF16>(slot_at((const u8*)x.recv, x.recv_code, seq), (const u8*)x.own, 0, (u8*)x.dst,
                  r.rows * 2 * r.H, r.rows_pad * 2 * r.H, w, blockIdx.x - (u32)npub,
                  gridDim.x - (u32)npub, gate, (u32)gate_target);
  }
  last_block_advances(state, adv_entries, adv_gate);
}
