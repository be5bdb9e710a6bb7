// Publish: copy the input into the send region, hand each piece to the proxy.
#pragma once
#include "common.cuh"
#include "wait.cu"

// ---------------------------------------------------------------- publish

// One thread: write the fields of publish-ring entry `index` but its tag, once the proxy
// freed it. False if that wait failed (recorded): nothing written, no tag to write then.
// call: the entry's call word for piece 0 (protocol.h call_word: op, dtype, kind, padding;
// the host builds it per collective shape), which the peers compare with their own call.
// fields_only: the fields of an entry whose room is known (hand_off: the room for the last
// entry of a hand-off is room for every one before it, as the proxy's tail only grows).
// clock: the device state's STATE_CLOCK, read once per hand-off (a read of device memory
// the next store waits for: one per entry took ~0.3 us each).
__device__ __forceinline__ void fields_only(u8* ring, u64 clock, u64 index, u64 seq, u64 S,
                                            u64 lo, u64 hi, u64 call, u32 piece, u32 chunk,
                                            u32 granule) {
  u8* ent = ring + (index % RING_ENTRIES) * RING_ENTRY_BYTES;
  st_volatile_u64((u64*)(ent + ENT_SEQ), seq);
  st_volatile_u64((u64*)(ent + ENT_SLICE), S);
  st_volatile_u64((u64*)(ent + ENT_LO), lo);
  st_volatile_u64((u64*)(ent + ENT_HI), hi);
  st_volatile_u64((u64*)(ent + ENT_OP), call | (u64)piece << CALL_PIECE_SHIFT);
  st_volatile_u32((u32*)(ent + ENT_CHUNK), chunk);
  st_volatile_u32((u32*)(ent + ENT_GRANULE), granule);
  // The proxy's clock, for its publish -> post figure: the stamp is the last write before
  // the tag's.
  if (clock) st_volatile_u64((u64*)(ent + ENT_PUBLISH_NS), globaltimer() + clock);
}
__device__ __forceinline__ bool entry_fields(u8* ring, u64* state, u64 index, u64 seq, u64 S,
                                             u64 lo, u64 hi, u64 call, u32 piece, u32 chunk,
                                             u32 granule) {
  if (!ring_room(ring, state, index, seq, piece)) return false;
  fields_only(ring, state[STATE_CLOCK], index, seq, S, lo, hi, call, piece, chunk, granule);
  return true;
}

__device__ __forceinline__ u64* entry_tag(u8* ring, u64 index) {
  return (u64*)(ring + (index % RING_ENTRIES) * RING_ENTRY_BYTES + ENT_TAG);
}

// One thread: write publish-ring entry `index` (every field, then the tag, by a release
// store that hands it to the proxy), once the proxy freed it (nothing if that wait failed).
__device__ __forceinline__ void write_entry(u8* ring, u64* state, u64 index, u64 seq, u64 S,
                                            u64 lo, u64 hi, u64 call, u32 piece, u32 chunk,
                                            u32 granule) {
  if (!entry_fields(ring, state, index, seq, S, lo, hi, call, piece, chunk, granule)) return;
  // The release is the system fence: every field (and, through the blocks' counts in
  // last_block_arrives, the piece's data) is visible before the tag. (A fence of its own
  // before it cost a second wait for host memory per entry.)
  st_release_sys(entry_tag(ring, index), index + 1);
}

// Clock calibration (sparkccl/dataplane/clock.py calibrate): round k waits for the host's go[k],
// then writes %globaltimer to stamp[k]; the host's clock when it wrote go[k] and when it saw
// the stamp bracket it. Gives up after timeout_ns (the host then sets every go word).
extern "C" __global__ void sccl_clock_probe(const u64* go, u64* stamp, u64 rounds,
                                            u64 timeout_ns) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  const u64 t0 = globaltimer();
  for (u64 k = 0; k < rounds; ++k) {
    while (ld_acquire_sys(go + k) == 0)
      if (globaltimer() - t0 > timeout_ns) return;
    st_release_sys(stamp + k, globaltimer());
  }
}

// Called by every thread of a block after its writes of a piece. True in thread 0 of the
// last of the n blocks of the piece to get here; every block's writes are then visible to
// what that thread writes next (the tag of a ring entry, a flag word).
__device__ __forceinline__ bool last_block_arrives(u32* counter, u32 n) {
  __threadfence_system();  // this thread's data writes before the count (and what follows)
  __syncthreads();
  if (threadIdx.x != 0) return false;
  if (atomicAdd(counter, 1u) != n - 1) return false;
  __threadfence();  // acquire the other blocks' counts (and, cumulatively, their data)
  *counter = 0;     // ready for the launch that reuses this counter
  return true;
}

// Called by every thread of a block after its share of piece c is written. The last of
// `bpp` blocks to get here writes ring entry `index`.
// chunk: CHUNK_ALL (-1: every chunk of the piece; the proxy sends it), or CHUNK_DIRECT (-2:
// every chunk, and this data plane already executed its publish-triggered streams).
__device__ __forceinline__ void finish_piece(u32* counter, u32 bpp, u8* ring, u64* state,
                                             u64 index, u64 seq, u64 S, u64 call, int c,
                                             u32 chunk = (u32)CHUNK_ALL) {
  if (last_block_arrives(counter, bpp)) {
    u64 lo, hi;
    piece_bounds(S, c, &lo, &hi);
    write_entry(ring, state, index, seq, S, lo, hi, call, (u32)c, chunk, ALIGN);
  }
}

// Copy + publish. Chunk j (j < nchunks) of the input is src + j * src_stride (L bytes; a
// sized all-to-all's, the length its first 8 bytes say: call_sized);
// it goes to dst + j * dst_stride (dst: slotted by dst_code, see slot_at; and, if dst2,
// also to dst2: all-gather's own slice of the result). Grid: PIECES * bpp blocks, piece c
// served by blocks [c * bpp, (c+1) * bpp). nchunks == 0: nothing to copy (zero-copy
// reduce-scatter input), publish only. counters: COUNTER_SETS sets of PIECES, by seq.
// publish_role: the same for block `block` of a grid whose first PIECES * bpp blocks publish
// (sccl_ag_proxy, sccl_rs_proxy_*).
__device__ __forceinline__ void publish_role(const PublishArgs& a, u32 block) {
  const u8* const src = (const u8*)a.src;
  u8* const dst2 = (u8*)a.dst2;
  u8* const ring = (u8*)a.ring;
  u64* const state = (u64*)a.state;
  u32* counters = (u32*)a.counters;
  const u64 bpp = a.bpp, L = a.L, S = a.S;
  const int c = block / (u32)bpp;
  const u32 b = block % (u32)bpp;
  if (c >= PIECES || plane_failed(state)) return;  // (the proxy may still send this slot)
  const u64 seq = state_word(state, STATE_SEQ);
  const u64 first_index = state_word(state, STATE_RING);
  u8* const dst = slot_at((u8*)a.dst, a.dst_code, seq);
  counters += (seq % COUNTER_SETS) * PIECES;
  u64 lo, hi;
  piece_bounds(S, c, &lo, &hi);
  const u64 x = lo < L ? lo : L;
  const u64 e = hi < L ? hi : L;
  const bool sized = call_sized(a.call);
  __shared__ u64 ends[SIZED_CHUNKS];
  if (sized && e > x) read_chunk_ends(ends, src, a.src_stride, a.nchunks, L, false);
  if (e > x) {
    for (u64 j = 0; j < a.nchunks; ++j) {
      const u64 end = sized ? chunk_end(ends, j, src, a.src_stride, L, false) : L;
      const u64 ej = e < end ? e : end;
      if (ej > x)
        team_copy<false>(dst + j * a.dst_stride + x, j == 0 && dst2 ? dst2 + x : (u8*)0,
                         src + j * a.src_stride + x, ej - x, b, (u32)bpp);
    }
  }
  finish_piece(counters + c, (u32)bpp, ring, state, first_index + c, seq, S, a.call, c);
}

// The publish role alone (its one parameter: protocol.h kargs::PublishArgs, by value).
extern "C" __global__ void __launch_bounds__(512) sccl_publish(const PublishArgs a) {
  publish_role(a, blockIdx.x);
}

// Queued after every other kernel of a collective on its stream where its last kernel does
// not advance the state itself (modes split and ce: kernels on other streams; a phase
// alone): see advance_state.
extern "C" __global__ void sccl_advance(u64* state, u64 entries, u64 gate_add) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  advance_state(state, entries, gate_add);
}
