// sparkccl GPU data plane: the CUDA twin of sparkccl/dataplane/cpu.py.
//
// Compiled at run time with NVRTC (sparkccl/dataplane/nvrtc.py) for the device's own
// architecture (sm_80 and up). No headers: NVRTC needs nothing but this file.
//
// Two kernels per collective, launched on the caller's stream:
//
//   *_publish: copy piece c of the input into the send region (all-gather: own block of AG
//      slot seq%3, and the own slice of the device result; reduce-scatter: chunk j's piece
//      c into block j of RS send slot seq%2). The last block to finish piece c writes ring
//      entry first_index + c (fields, system fence, then tag = index + 1). The host
//      reserved the collective's 8 ring indices before the launch (it waited for space),
//      so this kernel never waits.
//
//   *_wait: block 0 is the poller: one thread polls the pinned flag words with
//      ld.acquire.sys in (piece, source) order, watching the abort word and a timeout on
//      %globaltimer, and relays progress through a device-memory word. Blocks 1.. poll
//      that word and consume each piece as it arrives: all-gather copies it out into the
//      device result; reduce-scatter sums the sources in rank order 0..W-1 in fp32 and
//      rounds once (round to nearest even).
//
//   sccl_*_direct (GPU-direct publish, same-host peers mapped here; docs/PROTOCOL.md):
//      one launch, two roles. Blocks [0, npub) execute this rank's publish-triggered
//      streams themselves, piece by piece in order: each item's sub-range goes from the
//      input straight into the peer's mapped region, and the last block to finish a
//      (stream, piece) writes the peer's flag word (system fence, then a system-scope
//      release store); then the own copies and the ring entry, as *_publish does. Blocks
//      npub.. are the wait kernel (poller + consumers), so the wire's two directions
//      overlap: this rank reads piece c of its peers while it still writes piece c + 1.
//
// Progress word (device memory, monotonic across launches of one data plane). The poller
// walks units u(c, k, i) = (c * maxw + k) * W + i + 1 in order (piece c, wait-word index k,
// source i): once it passed u, flag word k of every source <= i is satisfied for piece c.
//   seq * PROG_STRIDE + u       units up to u are ready
//   seq * PROG_STRIDE + FAILED  the wait failed (abort or timeout): every block exits
// Each wait word carries one part of the piece (root share, direction half: the `parts`
// table, PART_* codes), so the all-gather copies source i's part k out as soon as it came,
// and the reduce-scatter reduces part k once every source's word k came (when every source
// splits its pieces the same way; else piece by piece).
// Device state: state[0] = progress word, state[1] = dead (1 once any wait failed; later
// waits fail at once, so a failed communicator cannot hang a stream).
//
// Failure record (mapped host memory in the control block, see cuda.py GPU_* offsets):
//   status[0] code (ABORT_*; written last), status[1] detail = source << 32 | word << 8 |
//   piece (word = flag word index, 0xFFFF if none), status[2] seq.

typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

#define PIECES 8
#define ALIGN 16
#define RING_ENTRIES 256
#define RING_ENTRY_BYTES 64
#define ENT_TAG 0
#define ENT_SEQ 8
#define ENT_SLICE 16
#define ENT_LO 24
#define ENT_HI 32
#define ENT_OP 40
#define ENT_PIECE 44
#define ENT_CHUNK 48
#define ENT_GRANULE 52
#define FLAG_STRIDE 16
#define PROG_STRIDE 65536ull
#define FAILED 65535ull
#define ABORT_TIMEOUT 1ull
#define ABORT_PEER 3ull
#define NO_WORD 0xFFFFull
#define UNROLL 4
#define BATCH 8  // reduce-scatter: sources loaded together when world <= BATCH
#define MAX_DIRECT 32  // GPU-executed streams per op (direct table)
#define DT_STREAM 4    // u64 per stream row of the direct table
#define DT_ITEM 6      // u64 per item row of the direct table

// ---------------------------------------------------------------- geometry (geometry.py)

__device__ __forceinline__ u64 round_up(u64 x, u64 m) { return (x + m - 1) / m * m; }

// Piece c of a slice of S bytes, steps a multiple of granule g (finalize: a row).
__device__ __forceinline__ void piece_bounds_g(u64 S, int c, u64 g, u64* lo, u64* hi) {
  u64 step = round_up((S + PIECES - 1) / PIECES, g);
  u64 l = c * step;
  *lo = l < S ? l : S;
  u64 h = (u64)(c + 1) * step;
  *hi = (c == PIECES - 1) ? S : (h < S ? h : S);
}
__device__ __forceinline__ void piece_bounds(u64 S, int c, u64* lo, u64* hi) {
  piece_bounds_g(S, c, ALIGN, lo, hi);
}

// Parts (geometry.py Part), packed: root | roots << 2 | half << 4 | halves << 6; 0 = none.
#define PART_NONE 0u
__device__ __forceinline__ u64 part_split(u64 lo, u64 hi) {
  const u64 n = hi - lo;
  const u64 h = round_up((n + 1) / 2, ALIGN);
  return lo + (n < h ? n : h);
}
__device__ __forceinline__ void part_range(u32 part, u64* lo, u64* hi) {
  const u32 root = part & 3u, roots = (part >> 2) & 3u, half = (part >> 4) & 3u,
            halves = (part >> 6) & 3u;
  if (roots == 2) {
    const u64 h = part_split(*lo, *hi);
    if (root == 0) *hi = h; else *lo = h;
  }
  if (halves == 2) {
    const u64 h = part_split(*lo, *hi);
    if (half == 0) *hi = h; else *lo = h;
  }
}
// The bytes of `part` of piece [*lo, *hi) below L (the rest is padding, never moved): the
// twin of _cut in cuda.py.
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
#else
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
__device__ __forceinline__ void st_volatile_u64(u64* p, u64 v) { *(volatile u64*)p = v; }
__device__ __forceinline__ void st_volatile_u32(u32* p, u32 v) { *(volatile u32*)p = v; }

__device__ __forceinline__ u64 globaltimer() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void nanosleep(u32 ns) { asm volatile("nanosleep.u32 %0;" ::"r"(ns)); }

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

// ---------------------------------------------------------------- publish

// One thread: write publish-ring entry `index` (every field, a system fence, then the tag
// that hands it to the proxy).
__device__ __forceinline__ void write_entry(u8* ring, u64 index, u64 seq, u64 S, u64 lo, u64 hi,
                                            u32 op, u32 piece, u32 chunk, u32 granule) {
  u8* ent = ring + (index % RING_ENTRIES) * RING_ENTRY_BYTES;
  st_volatile_u64((u64*)(ent + ENT_SEQ), seq);
  st_volatile_u64((u64*)(ent + ENT_SLICE), S);
  st_volatile_u64((u64*)(ent + ENT_LO), lo);
  st_volatile_u64((u64*)(ent + ENT_HI), hi);
  st_volatile_u32((u32*)(ent + ENT_OP), op);
  st_volatile_u32((u32*)(ent + ENT_PIECE), piece);
  st_volatile_u32((u32*)(ent + ENT_CHUNK), chunk);
  st_volatile_u32((u32*)(ent + ENT_GRANULE), granule);
  __threadfence_system();
  st_release_sys((u64*)(ent + ENT_TAG), index + 1);
}

// Called by every thread of a block after its share of piece c is written. The last of
// `bpp` blocks to get here writes ring entry `index`.
// chunk: CHUNK_ALL (-1: every chunk of the piece; the proxy sends it), or CHUNK_DIRECT (-2:
// every chunk, and this data plane already executed its publish-triggered streams).
#define CHUNK_ALL 0xFFFFFFFFu
#define CHUNK_DIRECT 0xFFFFFFFEu
__device__ __forceinline__ void finish_piece(u32* counter, u32 bpp, u8* ring, u64 index, u64 seq,
                                             u64 S, u32 op, int c, u32 chunk = CHUNK_ALL) {
  __threadfence_system();  // this thread's data writes before the count (and the tag)
  __syncthreads();
  if (threadIdx.x == 0) {
    u32 old = atomicAdd(counter, 1u);
    if (old == bpp - 1) {
      __threadfence();  // acquire the other blocks' counts (and, cumulatively, their data)
      *counter = 0;     // ready for the launch that reuses this counter
      u64 lo, hi;
      piece_bounds(S, c, &lo, &hi);
      write_entry(ring, index, seq, S, lo, hi, op, (u32)c, chunk, ALIGN);
    }
  }
}

// Copy + publish. Chunk j (j < nchunks) of the input is src + j * src_stride (L bytes);
// it goes to dst + j * dst_stride (and, if dst2, also to dst2: all-gather's own slice of
// the result). Grid: PIECES * bpp blocks, piece c served by blocks [c * bpp, (c+1) * bpp).
// nchunks == 0: nothing to copy (zero-copy reduce-scatter input), publish only.
extern "C" __global__ void __launch_bounds__(512) sccl_publish(
    const u8* src, u64 src_stride, u8* dst, u64 dst_stride, u8* dst2, u64 nchunks, u64 L, u64 S,
    u8* ring, u64 first_index, u64 seq, u64 op, u32* counters, u64 bpp) {
  const int c = blockIdx.x / (u32)bpp;
  const u32 b = blockIdx.x % (u32)bpp;
  if (c >= PIECES) return;
  u64 lo, hi;
  piece_bounds(S, c, &lo, &hi);
  const u64 a = lo < L ? lo : L;
  const u64 e = hi < L ? hi : L;
  if (e > a) {
    for (u64 j = 0; j < nchunks; ++j)
      team_copy<false>(dst + j * dst_stride + a, j == 0 && dst2 ? dst2 + a : (u8*)0,
                       src + j * src_stride + a, e - a, b, (u32)bpp);
  }
  finish_piece(counters + c, (u32)bpp, ring, first_index + c, seq, S, (u32)op, c);
}

// ---------------------------------------------------------------- waits

struct WaitArgs {
  const u64* flags;     // this rank's flag words (mapped)
  const u64* abort_w;   // this rank's abort word (mapped)
  u64* status;          // failure record (mapped): code, detail, seq
  const int* waits;     // [W][maxw]: flag words per source, -1 padded
  const int* parts;     // [W + 1][maxw]: part of the piece word k of source i carries (row i);
                        // row W: the parts the reduce-scatter reduces after word k (PART_*)
  u64* state;           // device: progress, dead
  u64 seq;
  int rank, world, maxw;
  u64 timeout_ns;
};

// Progress unit of (piece c, wait-word index k, source i).
__device__ __forceinline__ u64 unit(const WaitArgs& w, int c, int k, int i) {
  return (u64)((c * w.maxw + k) * w.world + i + 1);
}

__device__ void record_failure(const WaitArgs& w, u64 code, u64 source, u64 word, u64 piece) {
  if (ld_relaxed_sys(w.status) == 0) {
    st_volatile_u64(w.status + 1, (source << 32) | ((word & 0xFFFF) << 8) | (piece & 0xFF));
    st_volatile_u64(w.status + 2, w.seq);
    __threadfence_system();
    st_volatile_u64(w.status, code);
    __threadfence_system();
  }
  st_volatile_u64(w.state + 1, 1);
  st_release_gpu(w.state, w.seq * PROG_STRIDE + FAILED);
}

// One thread: wait until source i's wait word k carries piece c (nothing to wait for when
// the source is this rank or has no word k). False: the abort word was set or the timeout
// (from t0) passed; the failure is recorded.
__device__ bool wait_word(const WaitArgs& w, int c, int k, int i, u64 t0) {
  const int word = i == w.rank ? -1 : w.waits[i * w.maxw + k];
  if (word < 0) return true;
  const u64 value = w.seq * FLAG_STRIDE + c + 1;
  u32 spins = 0;
  while (ld_acquire_sys(w.flags + word) < value) {
    const u64 code = ld_relaxed_sys(w.abort_w);
    if (code) {
      record_failure(w, code, (u64)i, (u64)word, (u64)c);
      return false;
    }
    if (globaltimer() - t0 > w.timeout_ns) {
      record_failure(w, ABORT_TIMEOUT, (u64)i, (u64)word, (u64)c);
      return false;
    }
    if (++spins > 64) nanosleep(spins > 4096 ? 2000 : 100);
  }
  return true;
}

// One thread: fail at once if an earlier wait of this data plane failed.
__device__ bool earlier_wait_failed(const WaitArgs& w) {
  if (!*(volatile u64*)(w.state + 1)) return false;
  record_failure(w, ABORT_PEER, 0xFFFFFFFFull, NO_WORD, 0xFF);
  return true;
}

// One thread: wait for every (word index, source) of piece c in order and relay progress
// to the device word: every unit (c, k, i) with a word, and (c, k, world - 1) for every k.
// False: the wait failed (recorded; the progress word then says FAILED).
__device__ bool relay_piece(const WaitArgs& w, int c, u64 t0) {
  const u64 base = w.seq * PROG_STRIDE;
  for (int k = 0; k < w.maxw; ++k) {
    for (int i = 0; i < w.world; ++i) {
      if (!wait_word(w, c, k, i, t0)) return false;
      const int word = i == w.rank ? -1 : w.waits[i * w.maxw + k];
      if (word >= 0 || i == w.world - 1) st_release_gpu(w.state, base + unit(w, c, k, i));
    }
  }
  return true;
}

// One thread: wait for every (piece, word index, source) in order and relay progress.
__device__ void poller(const WaitArgs& w) {
  if (earlier_wait_failed(w)) return;
  const u64 t0 = globaltimer();
  for (int c = 0; c < PIECES; ++c)
    if (!relay_piece(w, c, t0)) return;
}

// Consumer blocks: thread 0 waits until the progress word reaches `need`, the block then
// proceeds. Returns false if the wait failed (every consumer then exits).
__device__ __forceinline__ bool wait_progress(const WaitArgs& w, u64 need, u64* seen, u64 t0) {
  __shared__ int ok;
  if (threadIdx.x == 0) {
    const u64 base = w.seq * PROG_STRIDE;
    u64 p = *seen;
    int r = 1;
    u32 spins = 0;
    while (p < base + need || p >= base + FAILED) {
      if (p >= base + FAILED) { r = 0; break; }
      if (++spins > 16) {
        nanosleep(200);
        // Backstop: the poller records the timeout; if it cannot (never scheduled), give
        // up a little later on our own.
        if ((spins & 1023) == 0 && globaltimer() - t0 > w.timeout_ns + 2000000000ull) {
          record_failure(w, ABORT_TIMEOUT, 0xFFFFFFFFull, NO_WORD, 0xFF);
          r = 0;
          break;
        }
      }
      p = ld_acquire_gpu(w.state);
    }
    *seen = p;
    ok = r;
  }
  __syncthreads();
  const bool r = ok;
  __syncthreads();
  return r;
}

#define WAIT_PARAMS                                                                        \
  const u64 *flags, const u64 *abort_w, u64 *status, const int *waits, const int *parts,   \
      u64 maxw, u64 *state, u64 seq, u64 rank, u64 world, u64 timeout_ns
#define WAIT_ARGS_INIT                                                                      \
  WaitArgs w;                                                                               \
  w.flags = flags; w.abort_w = abort_w; w.status = status; w.waits = waits;                 \
  w.parts = parts; w.state = state; w.seq = seq; w.rank = (int)rank; w.world = (int)world;  \
  w.maxw = (int)maxw; w.timeout_ns = timeout_ns;

// sccl_wait_piece: the poller for piece c alone (one thread). The copy-engine data plane
// ("ce" mode) launches one per piece on a stream of its own and has the copying stream wait
// (cuStreamWaitValue64) for the progress word to reach each unit it copies: the copies
// never queue behind a kernel, and this kernel keeps the waits' abort and GPU-clock timeout.
// A failure sets the progress word to FAILED, which releases every such stream wait of the
// collective (its copies then move stale bytes, and the host raises at the next call).
extern "C" __global__ void sccl_wait_piece(u64 piece, WAIT_PARAMS) {
  WAIT_ARGS_INIT
  if (threadIdx.x != 0 || earlier_wait_failed(w)) return;
  relay_piece(w, (int)piece, globaltimer());
}

// All-gather wait + copy-out, run by blocks blk = 0..nblk-1 of the launch (blk 0 polls).
// slot: AG slot of this seq (block i = rank i's slice, S bytes apart). dst: result + dst_off
// (rank i's bytes at dst + i * dst_stride), or null (zero-copy: only wait).
__device__ void ag_wait(const u8* slot, u8* dst, u64 dst_stride, u64 L, u64 S, const WaitArgs& w,
                        u32 blk, u32 nblk) {
  if (blk == 0) {
    if (threadIdx.x == 0) poller(w);
    return;
  }
  if (w.world < 2) return;
  const u32 b = blk - 1, nb = nblk - 1;
  u64 seen = 0;
  const u64 t0 = globaltimer();
  if (!dst) {  // zero-copy: the launch completes once every piece arrived
    wait_progress(w, unit(w, PIECES - 1, w.maxw - 1, w.world - 1), &seen, t0);
    return;
  }
  for (int c = 0; c < PIECES; ++c) {
    u64 lo, hi;
    piece_bounds(S, c, &lo, &hi);
    for (int k = 0; k < w.maxw; ++k) {
      for (int i = 0; i < w.world; ++i) {
        const u32 part = i == w.rank ? PART_NONE : (u32)w.parts[i * w.maxw + k];
        if (part == PART_NONE) continue;
        if (!wait_progress(w, unit(w, c, k, i), &seen, t0)) return;
        u64 a = lo, e = hi;
        part_cut(part, L, &a, &e);
        if (e > a) team_copy<true>(dst + i * dst_stride + a, (u8*)0, slot + i * S + a, e - a, b, nb);
      }
    }
  }
}

// Grid: 1 poller block + consumer blocks.
extern "C" __global__ void __launch_bounds__(512) sccl_ag_wait(
    const u8* slot, u8* dst, u64 dst_stride, u64 L, u64 S, WAIT_PARAMS) {
  WAIT_ARGS_INIT
  ag_wait(slot, dst, dst_stride, L, S, w, blockIdx.x, gridDim.x);
}

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

// Sum bytes [a, e) of the piece over sources in rank order: source i's bytes are at
// recv + i * S (pinned, 16-aligned), except the own source at own (device input or own
// send slot; own_sys says which). Writes dst[a, e).
template <class E>
__device__ void team_reduce(u8* dst, const u8* recv, const u8* own, bool own_sys, u64 S, u64 a,
                            u64 e, int rank, int world, u32 b, u32 nb) {
  const int VEC = 16 / sizeof(typename E::T);
  const u64 n = e - a;
  const u64 units = n / 16;
  const u64 tid = (u64)b * blockDim.x + threadIdx.x;
  const u64 nthreads = (u64)nb * blockDim.x;
  for (u64 u = tid; u < units; u += nthreads) {
    const u64 off = a + 16 * u;
    float acc[VEC];
    if (world <= BATCH) {
      // Every source's load in flight at once, then the sum in rank order.
      V16 v[BATCH];
#pragma unroll
      for (int i = 0; i < BATCH; ++i)
        if (i < world) v[i] = i == rank ? ld_any16(own + off, own_sys) : ld_sys16(recv + i * S + off);
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
    } else {
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
    }
    st_any16(dst + off, pack<E>(acc));
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
    const u32 r = (u32)E::store(acc);
    for (int q = 0; q < (int)sizeof(T); ++q) dst[off + q] = (u8)(r >> (8 * q));
  }
}

// Finalize (sccl_finalize_direct): the own chunk is computed in the same launch, so the
// consumers wait until gate[c] (bumped once by each of the launch's publish blocks after
// its share of own piece c) reaches target (wrap-safe u32 compare). Returns false if the
// wait failed or ran past the timeout (recorded like a flag wait's).
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
          if (p >= w.seq * PROG_STRIDE + FAILED) { r = 0; break; }
          if (globaltimer() - t0 > w.timeout_ns + 2000000000ull) {
            record_failure(w, ABORT_TIMEOUT, 0xFFFFFFFFull, NO_WORD, 0xFF);
            r = 0;
            break;
          }
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

#define RS_KERNEL(NAME, E)                                                                   \
  extern "C" __global__ void __launch_bounds__(512) NAME(                                    \
      const u8* recv, const u8* own, u64 own_sys, u8* dst, u64 L, u64 S, WAIT_PARAMS) {      \
    WAIT_ARGS_INIT                                                                           \
    rs_wait<E>(recv, own, own_sys, dst, L, S, w, blockIdx.x, gridDim.x);                     \
  }

RS_KERNEL(sccl_rs_wait_bf16, BF16)
RS_KERNEL(sccl_rs_wait_f16, F16)
RS_KERNEL(sccl_rs_wait_f32, F32)

// Copy-engine data plane ("ce" mode): the rank-order sum of the part that wait word k of
// piece c carries (unit = c * maxw + k; reduce parts: row `world` of the parts table, see
// rs_wait), once the copy engines staged it (stage: source i's chunk at stage + i * S,
// device memory; own as in rs_wait). Launched on a stream of its own behind an event
// recorded after the unit's staging copies, so it waits for nothing itself and runs while
// the next unit travels.
#define RS_SUM_UNIT_KERNEL(NAME, E)                                                          \
  extern "C" __global__ void __launch_bounds__(512) NAME(                                    \
      u64 unit, const u8* stage, const u8* own, u64 own_sys, u8* dst, u64 L, u64 S,          \
      u64 rank, u64 world, const int* reduce_parts, u64 maxw) {                              \
    const u32 part = (u32)reduce_parts[unit % maxw];                                         \
    if (part == PART_NONE) return;                                                           \
    u64 a, e;                                                                                \
    piece_bounds(S, (int)(unit / maxw), &a, &e);                                             \
    part_cut(part, L, &a, &e);                                                               \
    if (e > a)                                                                               \
      team_reduce<E>(dst, stage, own, own_sys != 0, S, a, e, (int)rank, (int)world,          \
                     blockIdx.x, gridDim.x);                                                 \
  }

RS_SUM_UNIT_KERNEL(sccl_rs_sum_unit_bf16, BF16)
RS_SUM_UNIT_KERNEL(sccl_rs_sum_unit_f16, F16)
RS_SUM_UNIT_KERNEL(sccl_rs_sum_unit_f32, F32)

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

#define FIN_CLAIM 256  // counters per set before the claim counter (items <= 7 * 8 here)

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
                                            u64 first_index, u64 seq, u64 S, u64 RB, u32 op,
                                            int c, u64 j) {
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
      write_entry(ring, index, seq, S, lo, hi, op, (u32)c, (u32)j, (u32)RB);
    }
  }
}

template <bool FP8>
__device__ __forceinline__ void fin_body(const FinArgs& a, u64 Rr, u64 row_lo, u64 rows,
                                         u64 rows_pad, u64 world, u64 rank, u8* send, u8* own, u8* ring,
                                         u64 first_index, u64 seq, u64 op, u32* counters) {
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
    fin_publish(counters, x, items, ring, first_index, seq, S, RB, (u32)op, c, j);
  }
  const u64 tbase = rank * Rr + row_lo;
  const u64 n = rows * upr;
  for (u64 u = tid; u < n; u += nthreads) {
    const u64 r = u / upr, cu = u - r * upr;
    st_any16(own + r * RB + cu * 16, fin_unit<FP8>(a, tbase + r, cu));
  }
}

// Grid: any number of blocks (all resident for the best overlap: the host launches at most
// one per SM), 512 threads or fewer.
extern "C" __global__ void __launch_bounds__(512) sccl_finalize(
    const u8* y, const float* scales, const int* pos, const float* wts, const u8* shared,
    u32* bad, u64 T, u64 topk, u64 H, u64 R, u64 fp8, u64 Rr, u64 row_lo, u64 rows, u64 rows_pad,
    u64 world, u64 rank, u8* send, u8* own, u8* ring, u64 first_index, u64 seq, u64 op,
    u32* counters) {
  FinArgs a;
  a.y = y; a.scales = scales; a.pos = pos; a.wts = wts; a.shared = shared; a.bad = bad;
  a.T = T; a.topk = topk; a.H = H; a.R = R; a.fp8 = fp8;
  if (fp8)
    fin_body<true>(a, Rr, row_lo, rows, rows_pad, world, rank, send, own, ring, first_index, seq,
                   op, counters);
  else
    fin_body<false>(a, Rr, row_lo, rows, rows_pad, world, rank, send, own, ring, first_index,
                    seq, op, counters);
}

// ---------------------------------------------------------------- self-test helpers

// piece_bounds of the kernels, for the drift test against plan/geometry.py.
extern "C" __global__ void sccl_piece_bounds(const u64* sizes, u64 n, u64* out) {
  for (u64 k = blockIdx.x * (u64)blockDim.x + threadIdx.x; k < n; k += (u64)gridDim.x * blockDim.x)
    for (int c = 0; c < PIECES; ++c) piece_bounds(sizes[k], c, out + (k * PIECES + c) * 2, out + (k * PIECES + c) * 2 + 1);
}

// ---------------------------------------------------------------- GPU-direct publish
//
// Same-host peers whose regions are mapped into this process (shm transport): this data
// plane executes its own publish-triggered streams (docs/PROTOCOL.md "GPU-direct") instead
// of the proxy's copy workers. The stream table (device memory, built by cuda.py from the
// plan, static per op) in u64 words:
//   [0]                                     number of streams ns (<= MAX_DIRECT)
//   [1 + s * DT_STREAM + 0, 1, 2]           peer's flag word (device pointer), first item, items
//   [1 + ns * DT_STREAM + t * DT_ITEM + ..]  item t: source chunk, peer region base (device
//                                           pointer), slot stride, slots, block, part (PART_*)
// Item t of stream s, piece c: bytes part_range(piece_bounds(S, c), part), cut at L, go from
// src + chunk * src_stride to base + (seq % slots) * stride + block * S (+ the same offset).
// Streams go in table order within a piece, pieces in order; every block takes a share of
// every item. The last block to finish (stream s, piece c) writes the stream's flag
// (seq * 16 + c + 1) after a system fence, with a system-scope release store: one writer
// per flag word, as with the proxy. Then piece c's own copies (all-gather: own slice of the
// device result, and the own AG block when the result stays there) and the ring entry
// (chunk CHUNK_DIRECT: the proxy skips these streams for this collective and runs the rest).
//
// counters: [MAX_DIRECT][PIECES] per (stream, piece), then [PIECES] for the ring entries.

struct PubArgs {
  const u8* src;
  u64 src_stride, src_sys, L, S;
  const u64* dtab;
  u8* own_dst;  // own AG block of the slot (or null)
  u8* dst2;     // own slice of the device result (or null)
  u8* ring;
  u64 first_index, seq, op;
  u32* counters;
};

__device__ __forceinline__ void arrive_flag(u32* counter, u32 n, u64* flag, u64 value) {
  __threadfence_system();  // this thread's data writes before the count (and the flag)
  __syncthreads();
  if (threadIdx.x == 0) {
    u32 old = atomicAdd(counter, 1u);
    if (old == n - 1) {
      __threadfence();  // acquire the other blocks' counts (and, cumulatively, their data)
      *counter = 0;     // ready for the launch that reuses this counter
      __threadfence_system();
      st_release_sys(flag, value);
    }
  }
}

__device__ __forceinline__ void copy_any(u8* dst, u8* dst2, const u8* src, u64 n, bool sys, u32 b,
                                         u32 nb) {
  if (sys) team_copy<true>(dst, dst2, src, n, b, nb);
  else team_copy<false>(dst, dst2, src, n, b, nb);
}

__device__ void direct_publish(const PubArgs& p, u32 b, u32 nb) {
  const u64 ns = p.dtab[0];
  const u64* items = p.dtab + 1 + ns * DT_STREAM;
  for (int c = 0; c < PIECES; ++c) {
    u64 lo, hi;
    piece_bounds(p.S, c, &lo, &hi);
    for (u64 s = 0; s < ns; ++s) {
      const u64* row = p.dtab + 1 + s * DT_STREAM;
      for (u64 t = row[1]; t < row[1] + row[2]; ++t) {
        const u64* m = items + t * DT_ITEM;
        u64 a = lo, e = hi;
        part_cut((u32)m[5], p.L, &a, &e);
        if (e > a) {
          u8* d = (u8*)m[1] + (p.seq % m[3]) * m[2] + m[4] * p.S + a;
          copy_any(d, (u8*)0, p.src + m[0] * p.src_stride + a, e - a, p.src_sys != 0, b, nb);
        }
      }
      arrive_flag(p.counters + s * PIECES + c, nb, (u64*)row[0], p.seq * FLAG_STRIDE + c + 1);
    }
    const u64 a = lo < p.L ? lo : p.L;
    const u64 e = hi < p.L ? hi : p.L;
    if ((p.own_dst || p.dst2) && e > a)
      copy_any(p.own_dst ? p.own_dst + a : p.dst2 + a, p.own_dst && p.dst2 ? p.dst2 + a : (u8*)0,
               p.src + a, e - a, p.src_sys != 0, b, nb);
    finish_piece(p.counters + MAX_DIRECT * PIECES + c, nb, p.ring, p.first_index + c, p.seq, p.S,
                 (u32)p.op, c, CHUNK_DIRECT);
  }
}

#define DIRECT_PARAMS                                                                       \
  const u8 *src, u64 src_stride, u64 src_sys, u64 L, u64 S, const u64 *dtab, u8 *own_dst,   \
      u8 *dst2, u8 *ring, u64 first_index, u64 op, u32 *counters, u64 npub
#define PUB_ARGS_INIT                                                                       \
  PubArgs p;                                                                                \
  p.src = src; p.src_stride = src_stride; p.src_sys = src_sys; p.L = L; p.S = S;            \
  p.dtab = dtab; p.own_dst = own_dst; p.dst2 = dst2; p.ring = ring;                         \
  p.first_index = first_index; p.seq = seq; p.op = op; p.counters = counters;

// Grid: npub publish blocks, then (optionally) 1 poller + consumer blocks of the wait.
extern "C" __global__ void __launch_bounds__(256, 2) sccl_ag_direct(
    DIRECT_PARAMS, const u8* slot, u8* dst, u64 dst_stride, WAIT_PARAMS) {
  WAIT_ARGS_INIT
  if (blockIdx.x < npub) {
    PUB_ARGS_INIT
    direct_publish(p, blockIdx.x, (u32)npub);
  } else {
    ag_wait(slot, dst, dst_stride, L, S, w, blockIdx.x - (u32)npub, gridDim.x - (u32)npub);
  }
}

#define RS_DIRECT_KERNEL(NAME, E)                                                            \
  extern "C" __global__ void __launch_bounds__(256, 2) NAME(                                 \
      DIRECT_PARAMS, const u8* recv, const u8* own, u64 own_sys, u8* dst, WAIT_PARAMS) {     \
    WAIT_ARGS_INIT                                                                           \
    if (blockIdx.x < npub) {                                                                 \
      PUB_ARGS_INIT                                                                          \
      direct_publish(p, blockIdx.x, (u32)npub);                                              \
    } else {                                                                                 \
      rs_wait<E>(recv, own, own_sys, dst, L, S, w, blockIdx.x - (u32)npub,                   \
                 gridDim.x - (u32)npub);                                                     \
    }                                                                                        \
  }

RS_DIRECT_KERNEL(sccl_rs_direct_bf16, BF16)
RS_DIRECT_KERNEL(sccl_rs_direct_f16, F16)
RS_DIRECT_KERNEL(sccl_rs_direct_f32, F32)

// ---------------------------------------------------------------- MoE finalize, GPU-direct

// sccl_finalize_direct: the finalize when this rank's reduce-scatter streams run on the GPU
// (GPU-direct, see sccl_rs_direct_*): the publish blocks compute each row unit straight into
// the peer's mapped receive region (or a ring neighbour's staging block), item by item of
// the direct table, piece by piece; after each (stream, piece) the last block writes the
// stream's flag, and after each piece one ring entry (chunk -2: the proxy only relays).
// The own chunk's rows of piece c go to `own` (device memory), then gate[c] is bumped;
// the launch's other blocks run the reduce-scatter wait (1 poller + consumers), which
// reduces piece c once every source's piece arrived and gate[c] reached gate_target.
template <bool FP8>
__device__ void fin_direct_publish(const FinArgs& a, u64 Rr, u64 row_lo, u64 rows, u64 rows_pad,
                                   u64 rank, const u64* dtab, u8* own, u8* ring, u64 first_index,
                                   u64 seq, u64 op, u32* counters, u32* gate, u32 b, u32 nb) {
  const u64 RB = 2 * a.H, S = rows_pad * RB, L = rows * RB;
  const u64 ns = dtab[0];
  const u64* items = dtab + 1 + ns * DT_STREAM;
  const u64 tid = (u64)b * blockDim.x + threadIdx.x;
  const u64 nthreads = (u64)nb * blockDim.x;
  for (int c = 0; c < PIECES; ++c) {
    u64 lo, hi;
    piece_bounds(S, c, &lo, &hi);  // row pieces: rows_pad is a multiple of 8
    for (u64 s = 0; s < ns; ++s) {
      const u64* row = dtab + 1 + s * DT_STREAM;
      for (u64 t = row[1]; t < row[1] + row[2]; ++t) {
        const u64* m = items + t * DT_ITEM;
        u64 x = lo, e = hi;
        part_range((u32)m[5], &x, &e);
        if (e > L) e = L;  // padding rows are never read: not sent
        if (e <= x) continue;
        u8* d = (u8*)m[1] + (seq % m[3]) * m[2] + m[4] * S;
        const u64 tb = m[0] * Rr + row_lo;  // token row of chunk m[0]'s local row 0
        for (u64 off = x + 16 * tid; off < e; off += 16 * nthreads) {
          const u64 lr = off / RB;
          st16(d + off, fin_unit<FP8>(a, tb + lr, (off - lr * RB) / 16));
        }
      }
      arrive_flag(counters + s * PIECES + c, nb, (u64*)row[0], seq * FLAG_STRIDE + c + 1);
    }
    const u64 e = hi < L ? hi : L;
    const u64 tb = rank * Rr + row_lo;
    for (u64 off = (lo < L ? lo : L) + 16 * tid; off < e; off += 16 * nthreads) {
      const u64 lr = off / RB;
      st_any16(own + off, fin_unit<FP8>(a, tb + lr, (off - lr * RB) / 16));
    }
    __threadfence();  // this thread's own rows before the bump
    __syncthreads();
    if (threadIdx.x == 0) atomicAdd(gate + c, 1u);
    finish_piece(counters + MAX_DIRECT * PIECES + c, nb, ring, first_index + c, seq, S, (u32)op,
                 c, CHUNK_DIRECT);
  }
}

// Grid: npub publish blocks, then 1 poller + consumer blocks (all resident: 2 per SM).
extern "C" __global__ void __launch_bounds__(256, 2) sccl_finalize_direct(
    const u8* y, const float* scales, const int* pos, const float* wts, const u8* shared,
    u32* bad, u64 T, u64 topk, u64 H, u64 R, u64 fp8, u64 Rr, u64 row_lo, u64 rows, u64 rows_pad,
    const u64* dtab, u8* ring, u64 first_index, u64 op, u32* counters, u64 npub, u32* gate,
    u64 gate_target, const u8* recv, u8* own, u8* dst, WAIT_PARAMS) {
  WAIT_ARGS_INIT
  if (blockIdx.x < npub) {
    FinArgs a;
    a.y = y; a.scales = scales; a.pos = pos; a.wts = wts; a.shared = shared; a.bad = bad;
    a.T = T; a.topk = topk; a.H = H; a.R = R; a.fp8 = fp8;
    if (fp8)
      fin_direct_publish<true>(a, Rr, row_lo, rows, rows_pad, rank, dtab, own, ring, first_index,
                               seq, op, counters, gate, blockIdx.x, (u32)npub);
    else
      fin_direct_publish<false>(a, Rr, row_lo, rows, rows_pad, rank, dtab, own, ring,
                                first_index, seq, op, counters, gate, blockIdx.x, (u32)npub);
  } else {
    rs_wait<BF16>(recv, own, 0, dst, rows * 2 * H, rows_pad * 2 * H, w, blockIdx.x - (u32)npub,
                  gridDim.x - (u32)npub, gate, (u32)gate_target);
  }
}
