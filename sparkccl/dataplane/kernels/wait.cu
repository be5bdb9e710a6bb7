// Waits: the poller, the progress word, the all-gather wait.
#pragma once
#include "common.cuh"

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
  u64 ubase;  // units before this wait's first: a second wait of the same collective on the
              // one progress word (the fused all-reduce's all-gather part after its
              // reduce-scatter part, allreduce_fused.cu) counts on from where the first ends
  bool root1_idle;  // protocol.h root1_idle of the collective's slice: root 1's words unwaited
};

// Source i's wait word k, or -1 where there is nothing to wait for: this rank, no such word,
// or root 1's word of a collective that leaves root 1 idle (protocol.h root1_idle).
__device__ __forceinline__ int waited_word(const WaitArgs& w, int i, int k) {
  const int word = i == w.rank ? -1 : w.waits[i * w.maxw + k];
  return word >= 0 && w.root1_idle && flag_word_root((u64)word) == 1 ? -1 : word;
}

// Progress unit of (piece c, wait-word index k, source i).
__device__ __forceinline__ u64 unit(const WaitArgs& w, int c, int k, int i) {
  return w.ubase + (u64)((c * w.maxw + k) * w.world + i + 1);
}

// Fail-stop (mode GPU_FAIL_STOP, the default): the record is published; give the host's
// watchdog a bounded time to print it, and trap. The trap makes the context unusable, so
// nothing queued after this collective runs, and every later synchronization of the process
// raises: a failed collective's output is never consumed as valid. The watchdog answers
// ACK_HOLD once it printed the report, then ACK_GO once this process may trap (its turn of
// the GPU's trap lock: two processes time-slicing a GPU that trap at once can wedge the
// driver); HOLD extends the wait to HOLD_WAIT_NS. Without any ack (a host thread that cannot
// run) the trap comes after ACK_WAIT_NS and the host reports at its next call instead.
__device__ SCCL_COLD void stop_after_report(const WaitArgs& w) {
  const u64 t0 = globaltimer();
  for (;;) {
    const u64 ack = ld_acquire_sys(w.status + 3);
    if (ack != 0 && ack != ACK_HOLD) break;  // GO
    if (globaltimer() - t0 >= (ack == ACK_HOLD ? HOLD_WAIT_NS : ACK_WAIT_NS)) break;
    nanosleep(2000);
  }
  __trap();
}

__device__ SCCL_COLD void record_failure(const WaitArgs& w, u64 code, u64 source, u64 word,
                                         u64 piece) {
  if (ld_relaxed_sys(w.status) == 0) {
    st_volatile_u64(w.status + 1, (source << 32) | ((word & 0xFFFF) << 8) | (piece & 0xFF));
    st_volatile_u64(w.status + 2, w.seq);
    __threadfence_system();
    st_volatile_u64(w.status, code);
    __threadfence_system();
  }
  st_volatile_u64(w.state + 1, 1);
  st_release_gpu(w.state, w.seq * PROG_STRIDE + FAILED);
  __threadfence_system();  // the mode as of the abort word seen (close() changes it first)
  if (ld_relaxed_sys(w.status + 4) != GPU_FAIL_POISON) stop_after_report(w);
}

// The flag values a poller read last, by (source, word index) (i * maxw + k < FLAG_SEEN):
// a flag says its piece and every one before it, so a value read once answers the waits
// for those pieces without another read of host memory (1.4 us each on an H200,
// benchmarks/sysmem_sync.cu). Where a sender hands off a whole slice at once, the first
// read of each word answers all of its pieces.
#define FLAG_SEEN 64
struct FlagsSeen {
  u64 v[FLAG_SEEN];
};

// Between two reads of flag words in host memory that did not yet say what a wait needs:
// every ABORT_EVERY-th time, the abort word and the clock (false: the failure recorded); a
// nap once the wait is long. (The abort word is host memory too, and its read came after
// the flag's: read every time, it doubled the time a flag took to be seen.)
#define ABORT_EVERY 8
__device__ __forceinline__ bool still_waiting(const WaitArgs& w, u32 spins, u64 t0, u64 source,
                                              u64 word, u64 c) {
  if (spins % ABORT_EVERY == 0) {
    const u64 code = ld_relaxed_sys(w.abort_w);
    if (code) {
      record_failure(w, code, source, word, c);
      return false;
    }
    if (globaltimer() - t0 > w.timeout_ns) {
      record_failure(w, ABORT_TIMEOUT, source, word, c);
      return false;
    }
  }
  if (spins > 64) nanosleep(spins > 4096 ? 2000 : 100);
  return true;
}

// One thread: wait until source i's wait word k carries piece c (nothing to wait for when
// the source is this rank or has no word k). False: the abort word was set or the timeout
// (from t0) passed; the failure is recorded.
__device__ bool wait_word(const WaitArgs& w, int c, int k, int i, u64 t0, FlagsSeen& seen) {
  const int word = waited_word(w, i, k);
  if (word < 0) return true;
  const u64 value = w.seq * FLAG_STRIDE + c + 1;
  const int at = i * w.maxw + k;
  u64* last = at < FLAG_SEEN ? &seen.v[at] : (u64*)0;
  if (last && *last >= value) return true;  // (that read was an acquire too)
  u32 spins = 0;
  u64 v;
  while ((v = ld_acquire_sys(w.flags + word)) < value) {
    if (!still_waiting(w, ++spins, t0, (u64)i, (u64)word, (u64)c)) return false;
  }
  if (last) *last = v;
  return true;
}

// One thread: wait until every source's every wait word carries piece c (wait_word for all
// of them at once). Each pass reads every word still short together, relaxed, so their
// reads of host memory are in flight at once: one round trip per pass, not one per word
// (1.4 us each on an H200; acquire reads would be ordered one after the other). The fence
// after the last read makes them acquires (a relaxed read then fence.sc is an acquire
// pattern of the PTX memory model). Values are kept in `seen` as wait_word keeps them.
#define WORDS_AT_ONCE 8
__device__ bool wait_all_words(const WaitArgs& w, int c, u64 t0, FlagsSeen& seen) {
  const int n = w.world * w.maxw;
  if (n > FLAG_SEEN) {  // (more words than the cache: one at a time)
    for (int k = 0; k < w.maxw; ++k)
      for (int i = 0; i < w.world; ++i)
        if (!wait_word(w, c, k, i, t0, seen)) return false;
    return true;
  }
  const u64 value = w.seq * FLAG_STRIDE + c + 1;
  for (u32 spins = 1;; ++spins) {
    int short_at = -1;  // a word still short of the value (the failure names it)
    for (int first = 0; first < n; first += WORDS_AT_ONCE) {
      u64 v[WORDS_AT_ONCE];
#pragma unroll
      for (int j = 0; j < WORDS_AT_ONCE; ++j) {
        const int at = first + j;
        const int word = at < n ? waited_word(w, at / w.maxw, at % w.maxw) : -1;
        v[j] = word >= 0 && seen.v[at] < value ? ld_relaxed_sys(w.flags + word) : ~0ull;
      }
#pragma unroll
      for (int j = 0; j < WORDS_AT_ONCE; ++j) {
        const int at = first + j;
        if (v[j] == ~0ull) continue;
        if (v[j] > seen.v[at]) seen.v[at] = v[j];
        if (v[j] < value) short_at = at;
      }
    }
    if (short_at < 0) break;
    const int i = short_at / w.maxw;
    if (!still_waiting(w, spins, t0, (u64)i, (u64)w.waits[short_at], (u64)c)) return false;
  }
  __threadfence_system();
  return true;
}

// One thread: wait until publish-ring entry `index` is free (the proxy consumed entry
// index - RING_ENTRIES), watching the abort word and the timeout like every wait. The GPU
// does the ring's backpressure because the host no longer knows the indices of a captured
// collective (docs/PROTOCOL.md "Sequence state"). False: the failure is recorded.
__device__ bool ring_room(u8* ring, u64* state, u64 index, u64 seq, u32 piece) {
  u8* ctl = ring - RING_OFFSET;
  const u64* tail = (const u64*)(ctl + CTL_RING_TAIL);
  // Signed: a tail ahead of every index (benchmarks/kernel_roofline.py, no proxy) is room.
  // A tail read before (by any thread) is a lower bound of today's: where it already leaves
  // room, the read of host memory (a PCIe round trip, ~1 us, before every entry) is saved.
  // The acquire pairs with the release below, which follows the acquire of the proxy's tail
  // store: the proxy read the entry before this thread overwrites it.
  if ((i64)(index - ld_acquire_gpu(state + STATE_TAIL)) < (i64)RING_ENTRIES) return true;
  const u64 seen = ld_acquire_sys(tail);
  st_release_gpu(state + STATE_TAIL, seen);  // (an older value stored over it: still a bound)
  if ((i64)(index - seen) < (i64)RING_ENTRIES) return true;
  WaitArgs w = {};
  w.abort_w = (const u64*)(ctl + CTL_ABORT);
  w.status = (u64*)(ctl + CTL_GPU_STATUS);
  w.state = state;
  w.seq = seq;
  w.timeout_ns = state_word(state, STATE_TIMEOUT);
  const u64 t0 = globaltimer();
  u32 spins = 0;
  while ((i64)(index - ld_acquire_sys(tail)) >= (i64)RING_ENTRIES) {
    const u64 code = ld_relaxed_sys(w.abort_w);
    if (code || globaltimer() - t0 > w.timeout_ns) {
      record_failure(w, code ? code : ABORT_TIMEOUT, NO_SOURCE, NO_WORD, piece);
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
__device__ bool relay_piece(const WaitArgs& w, int c, u64 t0, FlagsSeen& seen) {
  const u64 base = w.seq * PROG_STRIDE;
  for (int k = 0; k < w.maxw; ++k) {
    for (int i = 0; i < w.world; ++i) {
      if (!wait_word(w, c, k, i, t0, seen)) return false;
      if (waited_word(w, i, k) >= 0 || i == w.world - 1)
        st_release_gpu(w.state, base + unit(w, c, k, i));
    }
  }
  return true;
}

// One thread: wait for every (piece, word index, source) in order and relay progress.
__device__ void poller(const WaitArgs& w) {
  if (earlier_wait_failed(w)) return;
  const u64 t0 = globaltimer();
  FlagsSeen seen = {};
  for (int c = 0; c < PIECES; ++c)
    if (!relay_piece(w, c, t0, seen)) return;
  TL_STAMP(w.state, w.seq, TL_SEEN);
}

// One thread of a block that waits for another block of its launch (the progress word, a
// gate): true once the abort word is set or the timeout passed by 2 s (recorded). The
// block it waits for normally records first and so names the piece; this bounds the wait
// when that block never runs.
__device__ SCCL_COLD bool backstop_failed(const WaitArgs& w, u64 t0) {
  const u64 code = ld_relaxed_sys(w.abort_w);
  if (code) {
    record_failure(w, code, 0xFFFFFFFFull, NO_WORD, 0xFF);
    return true;
  }
  if (globaltimer() - t0 > w.timeout_ns + 2000000000ull) {
    record_failure(w, ABORT_TIMEOUT, 0xFFFFFFFFull, NO_WORD, 0xFF);
    return true;
  }
  return false;
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
        // Backstop: the poller records the abort or the timeout; if it cannot (never
        // scheduled), give up on our own, at the abort word (checked less often than the
        // poller does, which so records first, naming the piece) or a little after the
        // timeout.
        if ((spins & 1023) == 0 && backstop_failed(w, t0)) {
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

// The wait role's parameters: its constant block (protocol.h kargs::WaitParams, one per
// data plane and op, built by the host from the header's offsets), and the two values that
// differ per launch (see last_block_advances).
#define WAIT_PARAMS const WaitParams *wp, u64 adv_entries, u64 adv_gate
#define WAIT_ARGS_INIT(SLICE)                                                               \
  WaitArgs w;                                                                               \
  u64* const state = (u64*)wp->state;                                                       \
  w.flags = (const u64*)wp->flags; w.abort_w = (const u64*)wp->abort_w;                     \
  w.status = (u64*)wp->status; w.waits = (const int*)wp->waits;                             \
  w.parts = (const int*)wp->parts; w.state = state; w.seq = state_word(state, STATE_SEQ);   \
  w.rank = (int)wp->rank; w.world = (int)wp->world;                                         \
  w.maxw = (int)wp->maxw; w.timeout_ns = wp->timeout_ns; w.ubase = 0;                      \
  w.root1_idle = root1_idle((SLICE), ALIGN);

// WAIT_PARAMS adv_entries, adv_gate: see last_block_advances (0 in sccl_wait_piece).
// A kernel whose struct argument x carries them (protocol.h kargs: wp, adv_entries,
// adv_gate fields) declares what WAIT_PARAMS would, for WAIT_ARGS_INIT.
#define WAIT_PARAMS_OF(x)                                                                   \
  const WaitParams* const wp = (const WaitParams*)(x).wp;                                   \
  const u64 adv_entries = (x).adv_entries, adv_gate = (x).adv_gate;

// sccl_wait_piece: the poller for piece c alone (one thread). The copy-engine data plane
// ("ce" mode) launches one per piece on a stream of its own and has the copying stream wait
// (cuStreamWaitValue64) for the progress word to reach each unit it copies: the copies
// never queue behind a kernel, and this kernel keeps the waits' abort and GPU-clock timeout.
// A failure sets the progress word to FAILED, which releases every such stream wait of the
// collective: in mode GPU_FAIL_STOP this kernel then traps, so the copies never complete as
// a success; in mode GPU_FAIL_POISON sccl_poison, queued after them, overwrites the output.
extern "C" __global__ void sccl_wait_piece(u64 piece, u64 S, WAIT_PARAMS) {
  WAIT_ARGS_INIT(S)
  if (threadIdx.x != 0 || earlier_wait_failed(w)) return;
  FlagsSeen seen = {};
  relay_piece(w, (int)piece, globaltimer(), seen);
}

// sccl_fail_guard (one thread; mode "ce" in GPU_FAIL_STOP, on the caller's stream after the
// collective's joins): fail, and so trap, if this data plane failed. The caller's stream only
// waited for values; once the host released those waits (cuda.py _release_waits: the kernels
// that would have failed never ran), the copies after them moved whatever had arrived, and
// nothing queued after the collective may read that as a result.
extern "C" __global__ void sccl_fail_guard(WAIT_PARAMS) {
  WAIT_ARGS_INIT(0)  // (it waits for no word)
  if (blockIdx.x == 0 && threadIdx.x == 0) earlier_wait_failed(w);
}

// All-gather wait + copy-out, run by blocks blk = 0..nblk-1 of the launch (blk 0 polls).
// slot: AG slot of this seq (block i = rank i's slice, S bytes apart). dst: result + dst_off
// (rank i's bytes at dst + i * dst_stride), or null (zero-copy: only wait).
// The all-to-all's receiver is this copy-out too, with the reduce-scatter's WaitParams (w:
// its flag words and per-source parts) and slot the RS recv slot (source i's block for this
// rank at i * S); own (its own block, in device memory, or pinned where own_sys) goes to
// dst + rank * dst_stride first, while the peers' blocks travel (docs/PROTOCOL.md
// "All-to-all"). The all-gather's own block is its publish role's (own null).
// sized (a sized all-to-all, call_sized): each block is copied up to the length its first 8
// bytes say; a source's is read once its piece 0 is in (from piece 1 on; piece 0 is copied
// whole), for the first SIZED_CHUNKS sources (the rest are copied whole).
__device__ void ag_wait(const u8* slot, u8* dst, u64 dst_stride, u64 L, u64 S, const WaitArgs& w,
                        u32 blk, u32 nblk, const u8* own = 0, u64 own_sys = 0,
                        bool sized = false) {
  if (blk == 0) {
    if (threadIdx.x == 0) poller(w);
    return;
  }
  const u32 b = blk - 1, nb = nblk - 1;
  if (own && dst) {
    const u64 n = sized ? sized_end(own, L, own_sys != 0) : L;
    if (own_sys) team_copy<true>(dst + w.rank * dst_stride, (u8*)0, own, n, b, nb);
    else team_copy<false>(dst + w.rank * dst_stride, (u8*)0, own, n, b, nb);
  }
  if (w.world < 2) return;
  u64 seen = 0;
  const u64 t0 = globaltimer();
  if (!dst) {  // zero-copy: the launch completes once every piece arrived
    wait_progress(w, unit(w, PIECES - 1, w.maxw - 1, w.world - 1), &seen, t0);
    return;
  }
  if (S <= ONE_HANDOFF_SLICE) {  // one wait for the last unit, then each source's L bytes
    if (!wait_progress(w, unit(w, PIECES - 1, w.maxw - 1, w.world - 1), &seen, t0)) return;
    for (int i = 0; i < w.world; ++i)
      if (i != w.rank)
        team_copy<true>(dst + i * dst_stride, (u8*)0, slot + i * S,
                        sized ? sized_end(slot + i * S, L, true) : L, b, nb);
    return;
  }
  __shared__ u64 ends[SIZED_CHUNKS];
  for (int c = 0; c < PIECES; ++c) {
    u64 lo, hi;
    piece_bounds(S, c, &lo, &hi);
    if (sized && c == 1) {  // every source's piece 0 is in: read the lengths once
      if (!wait_progress(w, unit(w, 0, w.maxw - 1, w.world - 1), &seen, t0)) return;
      read_chunk_ends(ends, slot, S, (u64)w.world, L, true);
    }
    for (int k = 0; k < w.maxw; ++k) {
      for (int i = 0; i < w.world; ++i) {
        const u32 part = i == w.rank ? PART_NONE : (u32)w.parts[i * w.maxw + k];
        if (part == PART_NONE) continue;
        if (!wait_progress(w, unit(w, c, k, i), &seen, t0)) return;
        u64 a = lo, e = hi;
        part_cut(part, sized && c > 0 && i < SIZED_CHUNKS ? ends[i] : L, &a, &e);
        if (e > a) team_copy<true>(dst + i * dst_stride + a, (u8*)0, slot + i * S + a, e - a, b, nb);
      }
    }
  }
}

// ag_wait of a protocol.h kargs::WaitRoleArgs (the slot `in`, the result `out`; the
// all-to-all's own block `own`, slotted by own_code, see slot_at).
// sized: see ag_wait (the GPU-direct kernel's call word says it; the wait role alone, in
// modes split and ce, copies every block whole).
__device__ __forceinline__ void ag_wait_role(const WaitRoleArgs& x, const WaitArgs& w, u32 blk,
                                             u32 nblk, bool sized = false) {
  ag_wait(slot_at((const u8*)x.in, x.in_code, w.seq), (u8*)x.out, x.out_stride, x.L, x.S, w,
          blk, nblk, slot_at((const u8*)x.own, x.own_code, w.seq), x.own_sys, sized);
}

// Grid: 1 poller block + consumer blocks. One parameter: protocol.h kargs::WaitRoleArgs.
extern "C" __global__ void __launch_bounds__(512) sccl_ag_wait(const WaitRoleArgs x) {
  WAIT_PARAMS_OF(x)
  WAIT_ARGS_INIT(x.S)
  ag_wait_role(x, w, blockIdx.x, gridDim.x);
  last_block_advances(state, adv_entries, adv_gate);
}

// Mode GPU_FAIL_POISON, queued on the caller's stream after every collective: once any wait
// of this data plane failed (state[1], set before the failing kernel ended), fill the
// collective's output (n ranges of L bytes, `stride` apart) with POISON_BYTE, so work queued
// after it reads NaN (or 0xFF bytes) rather than stale data. Reads one word otherwise.
extern "C" __global__ void sccl_poison(const u64* state, u8* dst, u64 stride, u64 n, u64 L) {
  if (!*(volatile const u64*)(state + 1)) return;
  const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  const u64 nthreads = (u64)gridDim.x * blockDim.x;
  for (u64 i = 0; i < n; ++i)
    for (u64 k = tid; k < L; k += nthreads) dst[i * stride + k] = (u8)POISON_BYTE;
}
