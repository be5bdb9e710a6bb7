// Reduce-scatter: sums in rank order, rounded once.
#pragma once
#include "wait.cu"

// ---------------------------------------------------------------- reduce-scatter

// Element types: load as fp32, store rounded once (round to nearest even).
struct BF16 {
  typedef u16 T;
  static __device__ __forceinline__ float load(u16 v) { return __uint_as_float(((u32)v) << 16); }
  static __device__ __forceinline__ u16 store(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (u16)((u >> 16) | 0x40);  // NaN stays NaN
    return (u16)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
};
struct F16 {
  typedef u16 T;
  static __device__ __forceinline__ float load(u16 v) { return f16_to_f32(v); }
  static __device__ __forceinline__ u16 store(float f) { return f32_to_f16_rn(f); }
};
struct F32 {
  typedef u32 T;
  static __device__ __forceinline__ float load(u32 v) { return __uint_as_float(v); }
  static __device__ __forceinline__ u32 store(float f) { return __float_as_uint(f); }
};

template <class E>
__device__ __forceinline__ void unpack(V16 v, float* f) {
  if (sizeof(typename E::T) == 2) {
    u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      f[2 * k] = E::load((typename E::T)(w[k] & 0xFFFF));
      f[2 * k + 1] = E::load((typename E::T)(w[k] >> 16));
    }
  } else {
    f[0] = E::load(v.x); f[1] = E::load(v.y); f[2] = E::load(v.z); f[3] = E::load(v.w);
  }
}
template <class E>
__device__ __forceinline__ V16 pack(const float* f) {
  V16 v;
  if (sizeof(typename E::T) == 2) {
    u32 w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k)
      w[k] = (u32)E::store(f[2 * k]) | ((u32)E::store(f[2 * k + 1]) << 16);
    v.x = w[0]; v.y = w[1]; v.z = w[2]; v.w = w[3];
  } else {
    v.x = E::store(f[0]); v.y = E::store(f[1]); v.z = E::store(f[2]); v.w = E::store(f[3]);
  }
  return v;
}

// The end of a rank-order sum: AVG's fp32 sum divided once by world (IEEE division), then
// the one rounding to E.
template <class E>
__device__ __forceinline__ V16 round_sum(float* acc, int world, bool avg) {
  const int VEC = 16 / sizeof(typename E::T);
  if (avg) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[k] = __fdiv_rn(acc[k], (float)world);
  }
  return pack<E>(acc);
}

// One 16-byte unit of every source, v[0 .. world) (world <= BATCH), summed in rank order:
// fp32 from rank 0's value, one __fadd_rn per later rank, then round_sum. The one definition
// of the reductions' bits (docs/CONTRACT.md "All-reduce"), for every kernel that has the
// sources' units in registers (team_reduce, the one shot's LL way).
template <class E>
__device__ __forceinline__ V16 sum_sources(const V16* v, int world, bool avg) {
  const int VEC = 16 / sizeof(typename E::T);
  float acc[VEC];
  unpack<E>(v[0], acc);
#pragma unroll
  for (int i = 1; i < BATCH; ++i) {
    if (i < world) {
      float t[VEC];
      unpack<E>(v[i], t);
#pragma unroll
      for (int k = 0; k < VEC; ++k) acc[k] = __fadd_rn(acc[k], t[k]);
    }
  }
  return round_sum<E>(acc, world, avg);
}

// Sum bytes [a, e) of the piece over sources in rank order: source i's bytes are at
// recv + i * S (pinned, 16-aligned), except the own source at own (device input or own
// send slot; own_sys says which). Writes dst[a, e). avg: the fp32 sum divided once by
// world (IEEE division) before the one rounding (the all-reduce's AVG). dst2: a second
// destination of the same bytes, or null (the fused all-reduce stores each rounded sum in
// its all-gather block and in the result from the same registers: no read back across PCIe).
template <class E>
__device__ void team_reduce(u8* dst, const u8* recv, const u8* own, bool own_sys, u64 S, u64 a,
                            u64 e, int rank, int world, u32 b, u32 nb, bool avg = false,
                            u8* dst2 = 0) {
  const int VEC = 16 / sizeof(typename E::T);
  const u64 n = e - a;
  const u64 units = n / 16;
  const u64 tid = (u64)b * blockDim.x + threadIdx.x;
  const u64 nthreads = (u64)nb * blockDim.x;
  for (u64 u = tid; u < units; u += nthreads) {
    const u64 off = a + 16 * u;
    V16 r;
    if (world <= BATCH) {
      // Every source's load in flight at once, then the sum in rank order.
      V16 v[BATCH];
#pragma unroll
      for (int i = 0; i < BATCH; ++i)
        if (i < world) v[i] = i == rank ? ld_any16(own + off, own_sys) : ld_sys16(recv + i * S + off);
      r = sum_sources<E>(v, world, avg);
    } else {
      float acc[VEC];
      {
        const u8* p = rank == 0 ? own + off : recv + off;
        V16 v = rank == 0 ? ld_any16(p, own_sys) : ld_sys16(p);
        unpack<E>(v, acc);
      }
      for (int i = 1; i < world; ++i) {
        float t[VEC];
        V16 v = i == rank ? ld_any16(own + off, own_sys) : ld_sys16(recv + i * S + off);
        unpack<E>(v, t);
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc[k] = __fadd_rn(acc[k], t[k]);
      }
      r = round_sum<E>(acc, world, avg);
    }
    st_any16(dst + off, r);
    if (dst2) st_any16(dst2 + off, r);
  }
  // Tail: the last elements of the last piece (L not a multiple of 16).
  typedef typename E::T T;
  const u64 tail_elems = (n - units * 16) / sizeof(T);
  for (u64 k = tid; k < tail_elems; k += nthreads) {
    const u64 off = a + units * 16 + k * sizeof(T);
    float acc = 0.f;
    for (int i = 0; i < world; ++i) {
      const u8* p = i == rank ? own + off : recv + i * S + off;
      T raw = 0;
      const bool sys = i == rank ? own_sys : true;
      for (int q = 0; q < (int)sizeof(T); ++q)
        raw |= (T)((T)(sys ? ld_sys8(p + q) : p[q]) << (8 * q));
      float f = E::load(raw);
      acc = i == 0 ? f : __fadd_rn(acc, f);
    }
    if (avg) acc = __fdiv_rn(acc, (float)world);
    const u32 r = (u32)E::store(acc);
    for (int q = 0; q < (int)sizeof(T); ++q) {
      dst[off + q] = (u8)(r >> (8 * q));
      if (dst2) dst2[off + q] = (u8)(r >> (8 * q));
    }
  }
}

// Finalize (sccl_finalize_direct): the own chunk is computed in the same launch, so the
// consumers wait until gate[c] (bumped once by each of the launch's publish blocks after
// its share of own piece c) reaches target (wrap-safe u32 compare). Returns false if the
// wait failed, saw the abort word or ran past the timeout (backstop_failed).
__device__ __forceinline__ bool wait_gate(const WaitArgs& w, const u32* gate, u32 target,
                                          u64 t0) {
  __shared__ int gok;
  if (threadIdx.x == 0) {
    int r = 1;
    u32 spins = 0;
    while ((int)(*(volatile const u32*)gate - target) < 0) {
      if (++spins > 16) {
        nanosleep(200);
        if ((spins & 1023) == 0) {
          const u64 p = ld_acquire_gpu(w.state);
          if (p >= w.seq * PROG_STRIDE + FAILED || backstop_failed(w, t0)) { r = 0; break; }
        }
      }
    }
    __threadfence();  // acquire: the publish blocks' own rows before their bumps
    gok = r;
  }
  __syncthreads();
  const bool r = gok;
  __syncthreads();
  return r;
}

// Reduce-scatter wait + rank-order sum, run by blocks blk = 0..nblk-1 (blk 0 polls).
// recv: RS recv slot of this seq (source i's chunk at recv + i * S); own: this rank's own
// chunk (device input chunk `rank`, or the own block of the send slot when own_sys); dst:
// output (L bytes). Part k of each piece (parts row W) is reduced once every source's
// wait word k arrived (and, with a gate, once gate[c] reached gate_target: see wait_gate).
template <class E>
__device__ void rs_wait(const u8* recv, const u8* own, u64 own_sys, u8* dst, u64 L, u64 S,
                        const WaitArgs& w, u32 blk, u32 nblk, const u32* gate = 0,
                        u32 gate_target = 0) {
  if (blk == 0) {
    if (threadIdx.x == 0) poller(w);
    return;
  }
  const u32 b = blk - 1, nb = nblk - 1;
  u64 seen = 0;
  const u64 t0 = globaltimer();
  if (!gate && S <= ONE_HANDOFF_SLICE) {  // one wait for the last unit, then one sum of L bytes
    if (w.world > 1 && !wait_progress(w, unit(w, PIECES - 1, w.maxw - 1, w.world - 1), &seen, t0))
      return;
    team_reduce<E>(dst, recv, own, own_sys != 0, S, 0, L, w.rank, w.world, b, nb);
    return;
  }
  for (int c = 0; c < PIECES; ++c) {
    u64 lo, hi;
    piece_bounds(S, c, &lo, &hi);
    if (gate && !wait_gate(w, gate + c, gate_target, t0)) return;
    for (int k = 0; k < w.maxw; ++k) {
      const u32 part = (u32)w.parts[w.world * w.maxw + k];
      if (part == PART_NONE) continue;
      if (w.world > 1 && !wait_progress(w, unit(w, c, k, w.world - 1), &seen, t0)) return;
      u64 a = lo, e = hi;
      part_cut(part, L, &a, &e);
      if (e > a) team_reduce<E>(dst, recv, own, own_sys != 0, S, a, e, w.rank, w.world, b, nb);
    }
  }
}

// rs_wait<E> of a protocol.h kargs::WaitRoleArgs (the receive slot `in`, own, the result
// `out`); in and own are slotted (in_code, own_code: see slot_at).
template <class E>
__device__ __forceinline__ void rs_wait_role(const WaitRoleArgs& x, const WaitArgs& w, u32 blk,
                                             u32 nblk) {
  rs_wait<E>(slot_at((const u8*)x.in, x.in_code, w.seq),
             slot_at((const u8*)x.own, x.own_code, w.seq), x.own_sys, (u8*)x.out, x.L, x.S, w,
             blk, nblk);
}

// One parameter: protocol.h kargs::WaitRoleArgs.
#define RS_KERNEL(NAME, E)                                                                   \
  extern "C" __global__ void __launch_bounds__(512) NAME(const WaitRoleArgs x) {             \
    WAIT_PARAMS_OF(x)                                                                        \
    WAIT_ARGS_INIT(x.S)                                                                      \
    rs_wait_role<E>(x, w, blockIdx.x, gridDim.x);                                            \
    last_block_advances(state, adv_entries, adv_gate);                                       \
  }

RS_KERNEL(sccl_rs_wait_bf16, BF16)
RS_KERNEL(sccl_rs_wait_f16, F16)
RS_KERNEL(sccl_rs_wait_f32, F32)

// Copy-engine data plane ("ce" mode): the rank-order sum of the part of piece c that
// parts gives wait word k (unit = c * maxw + k; the host passes the whole piece at the last
// word: ce_engine.py sum_parts), once the copy engines staged it (stage: source i's chunk at
// stage + i * S, device memory; own as in rs_wait). Launched on a stream of its own behind
// an event recorded after the unit's staging copies, so it waits for nothing itself and
// runs while the next unit travels. One parameter: protocol.h kargs::SumUnitArgs (unit its
// first field, set per launch).
#define RS_SUM_UNIT_KERNEL(NAME, E)                                                          \
  extern "C" __global__ void __launch_bounds__(512) NAME(const SumUnitArgs x) {              \
    const u32 part = (u32)((const int*)x.parts)[x.unit % x.maxw];                            \
    if (part == PART_NONE) return;                                                           \
    u64 a, e;                                                                                \
    piece_bounds(x.S, (int)(x.unit / x.maxw), &a, &e);                                       \
    part_cut(part, x.L, &a, &e);                                                             \
    if (e > a)                                                                               \
      team_reduce<E>((u8*)x.dst, (const u8*)x.stage, (const u8*)x.own, x.own_sys != 0, x.S,  \
                     a, e, (int)x.rank, (int)x.world, blockIdx.x, gridDim.x);                \
  }

RS_SUM_UNIT_KERNEL(sccl_rs_sum_unit_bf16, BF16)
RS_SUM_UNIT_KERNEL(sccl_rs_sum_unit_f16, F16)
RS_SUM_UNIT_KERNEL(sccl_rs_sum_unit_f32, F32)
