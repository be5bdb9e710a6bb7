// GPU-direct publish: this rank writes the peers' mapped regions and flags itself.
#pragma once
#include "publish.cu"
#include "reduce_scatter.cu"

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
// every item. The last block to finish piece c hands it off (hand_off): the ring entry's
// fields (chunk CHUNK_DIRECT: the proxy skips these streams for this collective and runs
// the rest), one system fence, then every stream's flag (seq * 16 + c + 1; one writer per
// flag word, as with the proxy) and the entry's tag. Then piece c's own copies (all-gather:
// own slice of the device result, and the own AG block when the result stays there).
// A slice of at most ONE_HANDOFF_SLICE bytes is handed off once, after its last piece:
// the flags then carry the last piece's value, which says every piece before it too.
//
// counters: [PIECES], one per hand-off (a piece's streams are handed off together).

struct PubArgs {
  const u8* src;
  u64 src_stride, src_sys, L, S;
  const u64* dtab;
  u8* own_dst;  // own AG block of the slot (or null)
  u8* dst2;     // own slice of the device result (or null)
  u8* ring;
  u64* state;
  u64 first_index, seq, call;  // call: the ring entries' call word (publish.cu entry_fields)
  bool sized;                  // call_sized(call): each chunk cut at its length
  u32* counters;  // this seq's set
};

// The entries' fields of pieces c0..c1 (not their tags) once the ring has room for them;
// false (the failure recorded) if that wait failed: then no tag may be written.
__device__ __forceinline__ bool hand_off_fields(u8* ring, u64* state, u64 first_index, u64 seq,
                                                u64 S, u64 call, int c0, int c1, u32 chunk) {
  // One wait for ring room, for the last entry: it is room for every entry before it (the
  // proxy's tail only grows; each wait was an acquire, ~0.4 us apiece, one after another).
  if (!ring_room(ring, state, first_index + c1, seq, (u32)c1)) return false;
  // CHUNK_WHOLE (c0 == 0): one entry, at piece 0's index, for pieces 0..c1 (protocol.h)
  const bool whole = chunk == (u32)CHUNK_WHOLE;
  const u64 clock = state[STATE_CLOCK];
  for (int c = whole ? c1 : c0; c <= c1; ++c) {  // (the entry of piece c: first_index + c)
    u64 lo, hi;
    piece_bounds(S, c, &lo, &hi);
    fields_only(ring, clock, first_index + (whole ? 0 : c), seq, S, whole ? 0 : lo, hi, call,
                (u32)c, chunk, ALIGN);
  }
  return true;
}

// Whether stream s of direct table dtab (ns streams) goes on root 1 (its items' part).
__device__ __forceinline__ bool stream_on_root1(const u64* dtab, u64 ns, u64 s) {
  const u64 first = dtab[1 + s * DT_STREAM + DT_FIRST];
  const u64 part = dtab[1 + ns * DT_STREAM + first * DT_ITEM + DT_PART];
  return (part & 3u) == 1;
}

// Once the fields and the data are ordered before them: each stream's flag (none on an idle
// root 1: protocol.h root1_idle), then the tags.
__device__ __forceinline__ void hand_off_tags(const u64* dtab, u8* ring, u64* state,
                                              u64 first_index, u64 seq, u64 S, int c0, int c1,
                                              u32 chunk, bool room) {
  const u64 ns = dtab ? dtab[0] : 0;
  const bool idle1 = root1_idle(S, ALIGN);
  for (u64 s = 0; s < ns; ++s)
    if (!(idle1 && stream_on_root1(dtab, ns, s)))
      st_relaxed_sys((u64*)dtab[1 + s * DT_STREAM + DT_FLAG], seq * FLAG_STRIDE + c1 + 1);
  const bool whole = chunk == (u32)CHUNK_WHOLE;
  for (int c = whole ? c1 : c0; c <= c1 && room; ++c) {
    const u64 index = first_index + (whole ? 0 : c);
    st_relaxed_sys(entry_tag(ring, index), index + 1);
  }
  TL_STAMP(state, seq, TL_HANDED);
}

// Pieces c0..c1 of a GPU-direct publish are written by every one of the n blocks: the last
// to arrive hands them off. Each step that waits for host memory costs 0.6-1.4 us on an
// H200 (benchmarks/sysmem_sync.cu), so all of it sits behind one system fence: first the
// ring entries' fields (they depend on nothing written here), then the fence, which orders
// every block's data (through the counter) and those fields before what follows, then
// each stream's flag and the entries' tags. (A flag and a tag per piece, each behind its
// own release, took four such waits per piece.) dtab: the direct table, or null where
// nothing goes to the peers (a failed data plane: sccl_finalize_direct).
__device__ __forceinline__ void hand_off_entries(const u64* dtab, u8* ring, u64* state,
                                                 u64 first_index, u64 seq, u64 S, u64 call,
                                                 int c0, int c1, u32 chunk) {
  TL_STAMP(state, seq, TL_WRITTEN);
  const bool room = hand_off_fields(ring, state, first_index, seq, S, call, c0, c1, chunk);
  __threadfence_system();
  hand_off_tags(dtab, ring, state, first_index, seq, S, c0, c1, chunk, room);
}
__device__ __forceinline__ void hand_off(u32* counter, u32 n, const u64* dtab, u8* ring,
                                         u64* state, u64 first_index, u64 seq, u64 S, u64 call,
                                         int c0, int c1, u32 chunk = (u32)CHUNK_DIRECT) {
  if (threadIdx.x == 0) TL_STAMP(state, seq, TL_STORED);
  if (!last_block_arrives(counter, n)) return;
  hand_off_entries(dtab, ring, state, first_index, seq, S, call, c0, c1, chunk);
}

// hand_off with the entries' fields written ahead, by thread 0 of the block `writer` says
// (one of the n) before it arrives: its arrival's system fence orders them with its data,
// and the last block to arrive stores the tags after its acquire of the count, with no
// fence of its own (one wait for host memory fewer: the one-shot all-reduce's proxy path).
// A failed wait for ring room is recorded before the writer arrives, so the last block
// finds the plane failed and writes no tag.
__device__ __forceinline__ void hand_off_fields_first(u32* counter, u32 n, bool writer, u8* ring,
                                                      u64* state, u64 first_index, u64 seq,
                                                      u64 S, u64 call, int c0, int c1,
                                                      u32 chunk) {
  if (threadIdx.x == 0) {
    TL_STAMP(state, seq, TL_STORED);
    if (writer) hand_off_fields(ring, state, first_index, seq, S, call, c0, c1, chunk);
  }
  if (!last_block_arrives(counter, n)) return;
  TL_STAMP(state, seq, TL_WRITTEN);
  hand_off_tags((const u64*)0, ring, state, first_index, seq, S, c0, c1, chunk,
                !plane_failed(state));
}

__device__ __forceinline__ void copy_any(u8* dst, u8* dst2, const u8* src, u64 n, bool sys, u32 b,
                                         u32 nb) {
  if (sys) team_copy<true>(dst, dst2, src, n, b, nb);
  else team_copy<false>(dst, dst2, src, n, b, nb);
}

// The publish of a slice handed off once (S <= ONE_HANDOFF_SLICE), spread as work items:
// (item, piece, sub-block of SUB_BYTES), one per warp at a time, every lane a few 16-byte
// units loaded together before they are stored. Each work item's bounds (the piece, the
// item's part of it, cut at L: a chain of 64-bit integer steps) are worked out by its warp
// alone. (Walked by every thread over every item and piece, those chains came one after
// the other: an 8 KiB all-reduce at world 2 spent 8-13 us publishing on an H200, the
// copying itself well under 1 us; benchmarks/decode_latency.py --timeline.)
#define SUB_BYTES 2048u  // 32 lanes x 4 units of 16 bytes

// A sized all-to-all (p.sized): item t's chunk's length, ends[t] for the first SIZED_CHUNKS
// items (read_item_ends: once per block, before its first copy; see read_chunk_ends), read
// from its chunk `from` where used for the rest; L otherwise.
__device__ __forceinline__ void read_item_ends(u64* ends, const PubArgs& p, const u64* items,
                                               u32 nitems) {
  if (!p.sized) return;
  for (u32 t = threadIdx.x; t < nitems && t < SIZED_CHUNKS; t += blockDim.x)
    ends[t] = sized_end(p.src + items[(u64)t * DT_ITEM + DT_CHUNK] * p.src_stride, p.L,
                        p.src_sys != 0);
  __syncthreads();
}
__device__ __forceinline__ u64 item_end(const u64* ends, const PubArgs& p, u32 t,
                                        const u8* from) {
  if (!p.sized) return p.L;
  return t < SIZED_CHUNKS ? ends[t] : sized_end(from, p.L, p.src_sys != 0);
}
__device__ __forceinline__ u32 direct_items(const u64* dtab) {
  const u64 ns = dtab[0];
  if (!ns) return 0;
  const u64* last = dtab + 1 + (ns - 1) * DT_STREAM;  // (items are numbered in row order)
  return (u32)(last[DT_FIRST] + last[DT_ITEMS]);
}
template <bool SRC_SYS>
__device__ void direct_publish_whole(const PubArgs& p, u32 b, u32 nb) {
  const u32 ns = (u32)p.dtab[0];
  if (!ns) return;
  const u32 nitems = direct_items(p.dtab);
  const u64* items = p.dtab + 1 + (u64)ns * DT_STREAM;
  __shared__ u64 ends[SIZED_CHUNKS];
  read_item_ends(ends, p, items, nitems);
  const u32 subs = (u32)((piece_step(p.S, ALIGN) + SUB_BYTES - 1) / SUB_BYTES);
  const u32 lanes = blockDim.x < 32 ? blockDim.x : 32;  // (the emulation: one thread a block)
  const u32 lane = threadIdx.x % lanes;
  const u32 team = (b * blockDim.x + threadIdx.x) / lanes, teams = nb * blockDim.x / lanes;
  const u32 work = nitems * PIECES * subs;
  for (u32 g = team; g < work; g += teams) {
    const u32 t = g / (PIECES * subs), c = g / subs % PIECES, k = g % subs;
    const u64* m = items + (u64)t * DT_ITEM;
    const u8* const from = p.src + m[DT_CHUNK] * p.src_stride;
    u64 a, e;
    piece_bounds(p.S, (int)c, &a, &e);
    part_cut((u32)m[DT_PART], item_end(ends, p, t, from), &a, &e);
    const u64 lo = a + (u64)k * SUB_BYTES;
    if (lo >= e) continue;
    const u64 hi = e < lo + SUB_BYTES ? e : lo + SUB_BYTES;
    u8* const to = (u8*)m[DT_BASE] + (p.seq % m[DT_SLOTS]) * m[DT_STRIDE] + m[DT_BLOCK] * p.S;
    u64 x = lo;
    if (((((u64)(to + lo)) | ((u64)(from + lo))) & 15) == 0) {
      const u32 units = (u32)((hi - lo) / 16);
      for (u32 u0 = lane; u0 < units; u0 += lanes * UNROLL) {
        V16 v[UNROLL];
#pragma unroll
        for (int j = 0; j < UNROLL; ++j)
          if (u0 + j * lanes < units)
            v[j] = SRC_SYS ? ld_sys16(from + lo + 16 * (u0 + j * lanes))
                           : ld_dev16(from + lo + 16 * (u0 + j * lanes));
#pragma unroll
        for (int j = 0; j < UNROLL; ++j)
          if (u0 + j * lanes < units) st16(to + lo + 16 * (u0 + j * lanes), v[j]);
      }
      x = lo + 16 * (u64)units;
    }
    for (x += lane; x < hi; x += lanes)  // (unaligned, or the last bytes below L)
      to[x] = SRC_SYS ? ld_sys8(from + x) : from[x];
  }
}

__device__ void direct_publish(const PubArgs& p, u32 b, u32 nb) {
  if (plane_failed(p.state)) return;  // nothing to the peers, no ring entry (see plane_failed)
  const u64 ns = p.dtab[0];
  const u64* items = p.dtab + 1 + ns * DT_STREAM;
  if (p.S <= ONE_HANDOFF_SLICE) {  // one hand-off, after the last piece
    if (p.src_sys) direct_publish_whole<true>(p, b, nb);
    else direct_publish_whole<false>(p, b, nb);
    hand_off(p.counters + PIECES - 1, nb, p.dtab, p.ring, p.state, p.first_index, p.seq, p.S,
             p.call, 0, PIECES - 1);
    if (p.own_dst || p.dst2)  // (every piece's own bytes: [0, L) in one team copy)
      copy_any(p.own_dst ? p.own_dst : p.dst2, p.own_dst && p.dst2 ? p.dst2 : (u8*)0, p.src, p.L,
               p.src_sys != 0, b, nb);
    return;
  }
  __shared__ u64 ends[SIZED_CHUNKS];
  read_item_ends(ends, p, items, direct_items(p.dtab));
  for (int c = 0; c < PIECES; ++c) {
    u64 lo, hi;
    piece_bounds(p.S, c, &lo, &hi);
    for (u64 s = 0; s < ns; ++s) {
      const u64* row = p.dtab + 1 + s * DT_STREAM;
      for (u64 t = row[DT_FIRST]; t < row[DT_FIRST] + row[DT_ITEMS]; ++t) {
        const u64* m = items + t * DT_ITEM;
        const u8* const from = p.src + m[DT_CHUNK] * p.src_stride;
        u64 a = lo, e = hi;
        part_cut((u32)m[DT_PART], item_end(ends, p, (u32)t, from), &a, &e);
        if (e > a) {
          u8* d = (u8*)m[DT_BASE] + (p.seq % m[DT_SLOTS]) * m[DT_STRIDE] + m[DT_BLOCK] * p.S + a;
          copy_any(d, (u8*)0, from + a, e - a, p.src_sys != 0, b, nb);
        }
      }
    }
    hand_off(p.counters + c, nb, p.dtab, p.ring, p.state, p.first_index, p.seq, p.S, p.call, c, c);
    const u64 a = lo < p.L ? lo : p.L;
    const u64 e = hi < p.L ? hi : p.L;
    if ((p.own_dst || p.dst2) && e > a)
      copy_any(p.own_dst ? p.own_dst + a : p.dst2 + a, p.own_dst && p.dst2 ? p.dst2 + a : (u8*)0,
               p.src + a, e - a, p.src_sys != 0, b, nb);
  }
}

// The publish role's PubArgs of a protocol.h kargs::DirectArgs for collective seq: src and
// own_dst are slotted (src_code, own_dst_code: see slot_at); counters: COUNTER_SETS sets of
// PIECES, by seq.
__device__ __forceinline__ PubArgs direct_pub_args(const DirectArgs& x, u64* state, u64 seq) {
  PubArgs p;
  p.src = slot_at((const u8*)x.src, x.src_code, seq); p.src_stride = x.src_stride;
  p.src_sys = x.src_sys; p.L = x.wait.L; p.S = x.wait.S; p.dtab = (const u64*)x.dtab;
  p.own_dst = slot_at((u8*)x.own_dst, x.own_dst_code, seq); p.dst2 = (u8*)x.dst2;
  p.ring = (u8*)x.ring; p.state = state;
  p.first_index = state_word(state, STATE_RING); p.seq = seq; p.call = x.call;
  p.sized = call_sized(x.call);
  p.counters = (u32*)x.counters + (seq % COUNTER_SETS) * PIECES;
  return p;
}

// Grid: npub publish blocks, then (optionally) 1 poller + consumer blocks of the wait.
// One parameter: protocol.h kargs::DirectArgs, by value (the wait role in x.wait).
extern "C" __global__ void __launch_bounds__(256, 2) sccl_ag_direct(const DirectArgs x) {
  WAIT_PARAMS_OF(x.wait)
  WAIT_ARGS_INIT(x.wait.S)
  if (blockIdx.x == 0 && threadIdx.x == 0) TL_STAMP(state, w.seq, TL_ENTER);
  const u32 npub = (u32)x.npub;
  if (blockIdx.x < npub) direct_publish(direct_pub_args(x, state, w.seq), blockIdx.x, npub);
  else ag_wait_role(x.wait, w, blockIdx.x - npub, gridDim.x - npub, call_sized(x.call));
  last_block_advances(state, adv_entries, adv_gate);
}

#define RS_DIRECT_KERNEL(NAME, E)                                                            \
  extern "C" __global__ void __launch_bounds__(256, 2) NAME(const DirectArgs x) {            \
    WAIT_PARAMS_OF(x.wait)                                                                   \
    WAIT_ARGS_INIT(x.wait.S)                                                                 \
    const u32 npub = (u32)x.npub;                                                            \
    if (blockIdx.x < npub) direct_publish(direct_pub_args(x, state, w.seq), blockIdx.x, npub); \
    else rs_wait_role<E>(x.wait, w, blockIdx.x - npub, gridDim.x - npub);                    \
    last_block_advances(state, adv_entries, adv_gate);                                       \
  }

RS_DIRECT_KERNEL(sccl_rs_direct_bf16, BF16)
RS_DIRECT_KERNEL(sccl_rs_direct_f16, F16)
RS_DIRECT_KERNEL(sccl_rs_direct_f32, F32)
