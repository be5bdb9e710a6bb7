// Common part of the data-plane kernels (see kernels.cu): types, the shared protocol
// values and geometry, memory operations, team copies.
#pragma once

typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

// Values shared with the host (layout, geometry, the data plane's ABI): defined once.
#include "sparkccl/protocol.h"
using namespace sparkccl::layout;
using namespace sparkccl::geom;
using namespace sparkccl::gpu;
using namespace sparkccl::kargs;

// Kernel-only tuning.
#define UNROLL 4
#define BATCH 8  // reduce-scatter: sources loaded together when world <= BATCH

// ---------------------------------------------------------------- geometry (protocol.h)

// Piece c of a slice of S bytes, steps a multiple of granule g (finalize: a row).
__device__ __forceinline__ void piece_bounds_g(u64 S, int c, u64 g, u64* lo, u64* hi) {
  const Range r = piece_range(S, c, g);
  *lo = r.lo;
  *hi = r.hi;
}
__device__ __forceinline__ void piece_bounds(u64 S, int c, u64* lo, u64* hi) {
  piece_bounds_g(S, c, ALIGN, lo, hi);
}

// Parts (geometry.py Part), packed: root | roots << 2 | half << 4 | halves << 6; 0 = none.
#define PART_NONE 0u
__device__ __forceinline__ void part_range(u32 part, u64* lo, u64* hi) {
  const Range r = part_range(Range{*lo, *hi}, part & 3u, (part >> 2) & 3u, (part >> 4) & 3u,
                             (part >> 6) & 3u);
  *lo = r.lo;
  *hi = r.hi;
}
// The bytes of `part` of piece [*lo, *hi) below L (the rest is padding, never moved): the
// twin of plan.geometry.cut.
__device__ __forceinline__ void part_cut(u32 part, u64 L, u64* lo, u64* hi) {
  part_range(part, lo, hi);
  if (*lo > L) *lo = L;
  if (*hi > L) *hi = L;
}

// ---------------------------------------------------------------- memory operations
//
// SCCL_EMU: tests/cuda_emu.py compiles this file as host C++ (one thread per block) to run
// the kernels' logic against the real proxy on machines without a GPU; the definitions
// below then map each operation to its C++ atomic twin.

#ifdef SCCL_EMU
#include "sccl_emu.h"
#define SCCL_COLD
#else
// Failure paths: kept out of line, so the waits' loops compile as they did without them.
#define SCCL_COLD __noinline__
__device__ __forceinline__ u64 ld_acquire_sys(const u64* p) {
  u64 v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ u64 ld_relaxed_sys(const u64* p) {
  u64 v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ u64 ld_acquire_gpu(const u64* p) {
  u64 v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_gpu(u64* p, u64 v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void st_release_sys(u64* p, u64 v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
// A count that another block of the same launch waits for (fire and forget: the adding
// thread does not wait for the old value), and that block's read of it.
__device__ __forceinline__ void red_release_gpu(u32* p, u32 v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ u32 ld_acquire_gpu32(const u32* p) {
  u32 v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// After a __threadfence_system() by the same thread: the fence orders every earlier write
// (this block's, through __syncthreads, and other blocks', through the counters) before it.
__device__ __forceinline__ void st_relaxed_sys(u64* p, u64 v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void st_volatile_u64(u64* p, u64 v) { *(volatile u64*)p = v; }
__device__ __forceinline__ void st_volatile_u32(u32* p, u32 v) { *(volatile u32*)p = v; }

__device__ __forceinline__ u64 globaltimer() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void nanosleep(u32 ns) { asm volatile("nanosleep.u32 %0;" ::"r"(ns)); }
// Programmatic dependent launch (sm_90 and later; a no-op before, and for a launch made
// without the attribute): a kernel launched with it may start while the kernel before it
// on the stream still runs, so it waits here, every thread, before it reads anything that
// kernel wrote (the device state first of all); then it lets the next such launch start.
__device__ __forceinline__ void wait_previous_grid() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void let_next_grid_start() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

struct V16 {
  u32 x, y, z, w;
};

// 16-byte load from pinned (system) memory that a CPU thread or NIC wrote while this
// kernel ran: ld.cv treats cached system-memory lines as stale.
// (No "memory" clobber: independent loads may be issued back to back; they follow the
// acquire that made the data visible through __syncthreads, which the compiler keeps.)
__device__ __forceinline__ V16 ld_sys16(const u8* p) {
  V16 v;
  asm volatile("ld.global.cv.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ V16 ld_dev16(const u8* p) {
  V16 v;
  asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ void st16(u8* p, V16 v) {
  asm volatile("st.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w) : "memory");
}
__device__ __forceinline__ u8 ld_sys8(const u8* p) {
  u32 v;
  asm volatile("ld.global.cv.u8 %0, [%1];" : "=r"(v) : "l"(p));
  return (u8)v;
}
// LL lines (protocol.h LL_SLOTS) in mapped host memory: 16 bytes stored at once, as two
// 8-byte halves {data, flag} that each arrive whole (the GPU's aligned 8-byte stores are not
// split); read back volatile, so a line not yet complete is read again from memory.
__device__ __forceinline__ void st_ll16(u8* p, V16 v) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w) : "memory");
}
__device__ __forceinline__ V16 ld_ll16(const u8* p) {
  V16 v;
  asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
// fp16 conversions through 32-bit registers only (a 16-bit "h" asm operand later stored
// byte by byte came out wrong on sm_90 with NVRTC 13.0).
__device__ __forceinline__ float f16_to_f32(u16 v) {
  float f;
  asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.f32.f16 %0, lo; }" : "=f"(f) : "r"((u32)v));
  return f;
}
__device__ __forceinline__ u16 f32_to_f16_rn(float f) {
  u32 d;  // cvt.rn.f16x2.f32 d, a, b: a -> upper half, b -> lower half
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(0.0f), "f"(f));
  return (u16)(d & 0xFFFFu);
}
#endif  // SCCL_EMU

// Unaligned 16-byte access (device memory only; pinned addresses are always 16-aligned).
__device__ __forceinline__ V16 ld_any16(const u8* p, bool sys) {
  if ((((u64)p) & 15) == 0) return sys ? ld_sys16(p) : ld_dev16(p);
  u32 w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    u32 b0, b1, b2, b3;
    if (sys) {
      b0 = ld_sys8(p + 4 * k); b1 = ld_sys8(p + 4 * k + 1);
      b2 = ld_sys8(p + 4 * k + 2); b3 = ld_sys8(p + 4 * k + 3);
    } else {
      b0 = p[4 * k]; b1 = p[4 * k + 1]; b2 = p[4 * k + 2]; b3 = p[4 * k + 3];
    }
    w[k] = b0 | (b1 << 8) | (b2 << 16) | (b3 << 24);
  }
  V16 v = {w[0], w[1], w[2], w[3]};
  return v;
}
__device__ __forceinline__ void st_any16(u8* p, V16 v) {
  if ((((u64)p) & 15) == 0) {
    st16(p, v);
    return;
  }
  u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    p[4 * k] = (u8)w[k];
    p[4 * k + 1] = (u8)(w[k] >> 8);
    p[4 * k + 2] = (u8)(w[k] >> 16);
    p[4 * k + 3] = (u8)(w[k] >> 24);
  }
}

// KIND_ALL_TO_ALL_SIZED (a call word's kind): each chunk's first 8 bytes say its length;
// the publish copy, the GPU-direct writes and the copy-out cut its parts there, not at L.
__device__ __forceinline__ bool call_sized(u64 call) {
  return (call >> CALL_KIND_SHIFT & 0xFFu) == (u64)KIND_ALL_TO_ALL_SIZED;
}
// The bytes of the sized chunk of L bytes at p that travel (protocol.h sized_bytes); one
// 8-byte load where p is aligned (a slot's blocks), else byte by byte (a chunk of an
// all-to-all's input need not be). sys: p in host memory.
__device__ __forceinline__ u64 sized_end(const u8* p, u64 L, bool sys) {
  if (L < 8) return L;
  u64 h = 0;
  if ((((u64)p) & 7) == 0) {
    h = sys ? ld_relaxed_sys((const u64*)p) : *(const u64*)p;
  } else {
    for (int k = 7; k >= 0; --k) h = h << 8 | (sys ? ld_sys8(p + k) : p[k]);
  }
  return sized_bytes(h, L);
}
// A sized all-to-all's copies cut chunks at their lengths, read once per block into shared
// memory (ends[j], chunk j at base + j * stride) for the first SIZED_CHUNKS chunks, before
// the block's first copy; chunk_end reads the rest where used. Read per item and piece
// instead (8 byte loads by every thread, between its copies), the GPU-direct all-to-all's
// publish of 928 KiB blocks took 265 us on the H200 against 88 unsized; read once, 102
// (benchmarks/ep_latency_h200.txt, fourteenth session).
#ifndef SIZED_CHUNKS  // (tests build the emulation with fewer, to reach the fallback)
#define SIZED_CHUNKS 64
#endif
__device__ __forceinline__ void read_chunk_ends(u64* ends, const u8* base, u64 stride, u64 n,
                                                u64 L, bool sys) {
  for (u64 j = threadIdx.x; j < n && j < SIZED_CHUNKS; j += blockDim.x)
    ends[j] = sized_end(base + j * stride, L, sys);
  __syncthreads();
}
__device__ __forceinline__ u64 chunk_end(const u64* ends, u64 j, const u8* base, u64 stride, u64 L,
                                         bool sys) {
  return j < SIZED_CHUNKS ? ends[j] : sized_end(base + j * stride, L, sys);
}

// Copy n bytes src -> dst (and dst2 if not null), shared by a team of `nblocks` blocks
// (this block is number `b` of them). Full 16-byte units first (UNROLL loads in flight
// per thread), then the tail bytes.
template <bool SRC_SYS>
__device__ __forceinline__ void team_copy(u8* dst, u8* dst2, const u8* src, u64 n, u32 b,
                                          u32 nblocks) {
  const u64 units = n / 16;
  const u64 tid = (u64)b * blockDim.x + threadIdx.x;
  const u64 nthreads = (u64)nblocks * blockDim.x;
  const bool aligned = ((((u64)dst) | ((u64)src) | ((u64)dst2)) & 15) == 0;
  if (aligned) {
    u64 u = tid;
    for (; u + (UNROLL - 1) * nthreads < units; u += UNROLL * nthreads) {
      V16 v[UNROLL];
#pragma unroll
      for (int k = 0; k < UNROLL; ++k)
        v[k] = SRC_SYS ? ld_sys16(src + 16 * (u + k * nthreads)) : ld_dev16(src + 16 * (u + k * nthreads));
#pragma unroll
      for (int k = 0; k < UNROLL; ++k) {
        st16(dst + 16 * (u + k * nthreads), v[k]);
        if (dst2) st16(dst2 + 16 * (u + k * nthreads), v[k]);
      }
    }
    for (; u < units; u += nthreads) {
      V16 v = SRC_SYS ? ld_sys16(src + 16 * u) : ld_dev16(src + 16 * u);
      st16(dst + 16 * u, v);
      if (dst2) st16(dst2 + 16 * u, v);
    }
  } else {
    for (u64 u = tid; u < units; u += nthreads) {
      V16 v = ld_any16(src + 16 * u, SRC_SYS);
      st_any16(dst + 16 * u, v);
      if (dst2) st_any16(dst2 + 16 * u, v);
    }
  }
  for (u64 k = units * 16 + tid; k < n; k += nthreads) {
    u8 v = SRC_SYS ? ld_sys8(src + k) : src[k];
    dst[k] = v;
    if (dst2) dst2[k] = v;
  }
}

// ---------------------------------------------------------------- sequence state
//
// A collective's seq and first ring index (protocol.h STATE_*): moved on only by the last
// block of the previous collective's last kernel (or sccl_advance after it, modes split
// and ce), earlier on the same stream, so a plain load at any point of a launch sees this
// collective's values.
__device__ __forceinline__ u64 state_word(const u64* state, int k) {
  return *(volatile const u64*)(state + k);
}
// The timeline (protocol.h TL_*, a measurement aid: SPARKCCL_GPU_TIMELINE compiles it in):
// one thread notes when this collective passed a step. Compiled out otherwise, so the
// kernels that measure latency are not slowed by the measuring.
#ifdef SCCL_TIMELINE
__device__ __forceinline__ void timeline_stamp(const u64* state, u64 seq, int point) {
  u64* tl = (u64*)state_word(state, STATE_TIMELINE);
  if (tl) st_volatile_u64(tl + (seq % TL_CALLS) * TL_POINTS + point, globaltimer());
}
#define TL_STAMP(state, seq, point) timeline_stamp(state, seq, point)
#else
#define TL_STAMP(state, seq, point) ((void)0)
#endif
// The next collective's state: seq + 1, ring index + entries (the ring entries this one
// used), the finalize gate + gate_add (sccl_finalize_direct's publish blocks, else 0).
__device__ __forceinline__ void advance_state(u64* state, u64 entries, u64 gate_add) {
  st_volatile_u64(state + STATE_SEQ, state_word(state, STATE_SEQ) + 1);
  st_volatile_u64(state + STATE_RING, state_word(state, STATE_RING) + entries);
  st_volatile_u64(state + STATE_GATE, state_word(state, STATE_GATE) + gate_add);
}
// Every thread of every block, at the end of a collective's last kernel (entries != 0; 0
// where another of its kernels may still run, and the host then queues sccl_advance): the
// last block to finish advances the state. Safe because every block read seq at its start,
// and the next kernel on the stream starts only after this one ended; it saves a launch.
__device__ __forceinline__ void last_block_advances(u64* state, u64 entries, u64 gate_add) {
  if (!entries) return;
  __syncthreads();
  if (threadIdx.x != 0) return;
  __threadfence();
  if (atomicAdd((u32*)(state + STATE_EXITS), 1u) != gridDim.x - 1) return;
  __threadfence();  // every other block's reads of the state came before their counts
  st_volatile_u64(state + STATE_EXITS, 0);
  TL_STAMP(state, state_word(state, STATE_SEQ), TL_EXIT);
  advance_state(state, entries, gate_add);
}
// Has a wait of this data plane failed (state[1], the dead word)? Then its later collectives
// publish nothing (mode poison, where they still run): a peer still reading a slot of an
// earlier collective must not see it rewritten by one whose waits were skipped (the reuse
// chain of docs/PROTOCOL.md "Slot reuse" holds only while every wait really waited).
__device__ __forceinline__ bool plane_failed(const u64* state) {
  return *(volatile const u64*)(state + STATE_DEAD) != 0;
}
// Slot seq % slots of a region (code: slots << SLOT_SHIFT | stride, 0 for a plain pointer).
template <class T>
__device__ __forceinline__ T* slot_at(T* base, u64 code, u64 seq) {
  const u64 slots = code >> SLOT_SHIFT;
  if (!base || !slots) return base;
  return (T*)((u8*)base + (seq % slots) * (code & ((1ull << SLOT_SHIFT) - 1)));
}
