// One-shot all-reduce (the decode regime; docs/PROTOCOL.md "All-reduce", "One shot on
// CUDA"): one launch per all-reduce. On the wire it is an all-gather of this rank's whole
// vector (op AG: the same streams, relays, flag words, values and ring entries; only the
// entries' call word, a.call, says all-reduce, for the peers' check), and the wait role sums
// the W vectors where they landed instead of copying them out:
//
//   blocks [0, npub): the publish role. GPU-direct (a.dtab != 0): direct.cu's direct_publish
//      writes the vector straight into the peers' AG slots and hands it off (flags and ring
//      entries, chunk CHUNK_DIRECT). Proxy path (dtab == 0): publish.cu's publish_role copies
//      it into this rank's block of AG slot seq % 3 and writes one ring entry per piece for
//      the proxy (a slice of at most ONE_HANDOFF_SLICE: one entry for all eight, CHUNK_WHOLE,
//      its fields written by block 0 before its arrival, its tag by the last block to arrive,
//      one fence between: the proxy then posts it in one go).
//   block npub: the poller (wait.cu), which relays the peers' flags to the progress word.
//   blocks npub + 1 ..: the consumers. Once every source's vector is there (a slice of at
//      most ONE_HANDOFF_SLICE: one wait, for the last unit; larger: piece by piece), the
//      rank-order fp32 sum over the AG slot's blocks (this rank's own term read from src),
//      AVG divided once, rounded once, straight into dst: reduce_scatter.cu's team_reduce,
//      the reduce-scatter's very sum, so both regimes give the same bits.
//
// In place (dst overlaps src, a.gate != 0): the consumers also wait until every publish
// block has read src (each bumps every word of the gate once; the target is the device
// state's STATE_GATE + npub, which the state's advance then moves by npub: the finalize's
// gate words and rule, kernels/finalize.cu, so both keep one count).
//
// The device state advances (seq + 1, ring + PIECES) as soon as every block read it: for a
// one-hand-off slice by the poller once it relayed the flags (advance_early), the LL way by
// its hand-off block (allreduce_ll); a larger slice's by the last block to finish. So a
// captured all-reduce replays with fresh numbers (docs/PROTOCOL.md "Sequence state").
//
// Small vectors between GPU-direct peers of a mesh take the LL way instead (a.ll != 0,
// allreduce_ll below): no flag words, poller or fence between the stores and the sum.
#pragma once
#include "direct.cu"


// Thread 0 of a publish block, after the block's reads of src: bump every gate word.
__device__ __forceinline__ void allreduce_src_read(u32* gate) {
  __syncthreads();  // (every thread's loads of src returned: their stores used them)
  if (!gate || threadIdx.x != 0) return;
  __threadfence();
  for (int c = 0; c < PIECES; ++c) atomicAdd(gate + c, 1u);
}

// The poller of a one-hand-off slice (one thread): its consumers wait for the last unit
// only, so every source's every wait word is waited for at the last piece's value, all of
// them at once (wait_all_words) (a flag
// says its piece and every one before it) and the last unit is released once. (wait.cu's
// poller releases every unit on the way, a gpu-scope release store each, on the path
// between the flags' arrival and the sum.) A failure is recorded at piece 7.
__device__ void poll_whole_slice(const WaitArgs& w) {
  if (earlier_wait_failed(w)) return;
  const u64 t0 = globaltimer();
  FlagsSeen seen = {};
  if (!wait_all_words(w, PIECES - 1, t0, seen)) return;
  TL_STAMP(w.state, w.seq, TL_SEEN);
  st_release_gpu(w.state, w.seq * PROG_STRIDE + unit(w, PIECES - 1, w.maxw - 1, w.world - 1));
}

// A one-hand-off slice's state advance (the poller's thread, once its relay is done): as
// soon as every other block counted itself in (each once it read the state: seq, ring
// index, gate), not by the last block to finish, whose fence and count came after the sum
// (the LL way's early advance, allreduce_ll). Blocks of this launch, all resident (the
// consumers already wait for this poller). A failed plane need not wait (nothing is
// published on it; seq still moves on as the host expects).
__device__ void advance_early(u64* state, const WaitArgs& w, u64 gate_add) {
  u32* const read = (u32*)(state + STATE_EXITS);
  const u64 t0 = globaltimer();
  for (u32 spins = 1; ld_acquire_gpu32(read) < gridDim.x - 1 && !plane_failed(state); ++spins)
    if (!still_waiting(w, spins, t0, (u64)w.rank, NO_WORD, PIECES - 1)) break;
  st_volatile_u64(state + STATE_EXITS, 0);  // (ready for the next launch)
  advance_state(state, PIECES, gate_add);
}

template <class E>
__device__ void allreduce_consume(const AllReduceArgs& a, const u8* slot, const WaitArgs& w,
                                  u32 blk, u32 nblk, u32 gate_target, u64 gate_add) {
  if (blk == 0) {
    if (threadIdx.x == 0) {
      if (a.S <= ONE_HANDOFF_SLICE) {
        poll_whole_slice(w);
        advance_early(w.state, w, gate_add);
      } else {
        poller(w);
      }
    }
    return;
  }
  const u32 b = blk - 1, nb = nblk - 1;
  const u8* own = (const u8*)a.src;
  u8* dst = (u8*)a.dst;
  const bool avg = a.avg != 0;
  u64 seen = 0;
  const u64 t0 = globaltimer();
  if (a.gate && !wait_gate(w, (const u32*)a.gate + PIECES - 1, gate_target, t0)) return;
  if (a.S <= ONE_HANDOFF_SLICE) {  // one wait for the last unit, then one sum of L bytes
    if (!wait_progress(w, unit(w, PIECES - 1, w.maxw - 1, w.world - 1), &seen, t0)) return;
    if (b == 0 && threadIdx.x == 0) TL_STAMP(w.state, w.seq, TL_RELEASED);
    team_reduce<E>(dst, slot, own, false, a.S, 0, a.L, w.rank, w.world, b, nb, avg);
    if (b == 0 && threadIdx.x == 0) TL_STAMP(w.state, w.seq, TL_SUMMED);
    return;
  }
  for (int c = 0; c < PIECES; ++c) {
    u64 lo, hi;
    piece_bounds(a.S, c, &lo, &hi);
    // Piece c of every source: its last unit (every word of every source) has passed.
    if (!wait_progress(w, unit(w, c, w.maxw - 1, w.world - 1), &seen, t0)) return;
    const u64 e = hi < a.L ? hi : a.L;
    if (e > lo) team_reduce<E>(dst, slot, own, false, a.S, lo, e, w.rank, w.world, b, nb, avg);
  }
}

// ---------------------------------------------------------------- LL (a.ll != 0)
//
// GPU-direct peers, every one of them mapped (a mesh on one host), and a vector of L bytes,
// L x (world - 1) <= LL_MAX_BYTES (cuda.py ll_for): the data carries its own flags
// (docs/PROTOCOL.md "One shot, LL"). Line i of a source's block (16 bytes at 16 i) holds its
// data bytes [8 i, 8 i + 8) as {4 data bytes, flag} x 2, flag = (u32)(seq + 1). Thread t takes
// lines i = t, t + T, ...: it stores line i of src to every peer's LL area (slot seq %
// LL_SLOTS, block of this rank), then reads line i of every source in its own area until
// both flags say seq, and sums them with its own 8 bytes in rank order (sum_sources,
// reduce_scatter.cu: the same bits as every other regime). A warp's stores and reads are then
// 512 contiguous bytes each (a thread taking two lines 16 bytes apart made every store and
// read half a sector's worth of PCIe transaction: twice as many of them). No fence, no flag
// word, no poller between the stores and the sum. Each line is read and written by one
// thread, so dst may be src (not a partial overlap: the host copies src first then). The
// last block hands off the eight ring entries (chunk CHUNK_DIRECT: the proxy posts nothing;
// the peers' checks of the call see them as for any collective) and the AG flag words, as
// direct_publish would, off the path of the sum.
//
// Through the proxy (a.ll_proxy, an opt-in: a mesh whose peers are not mapped, e.g. one GPU
// a host), each thread stores its lines once, into this rank's own block of its own LL area,
// and the entries say CHUNK_LL: the proxy waits until every line carries f (no fence here),
// then posts them into each peer's LL area (Transport::put_lines), and the peers read them
// as above (docs/PROTOCOL.md "One shot, LL, through the proxy").

// Data bytes [8 i, 8 i + 8) of src in the first two words (bytes past L read as zero).
__device__ __forceinline__ V16 ll_own_line(const u8* src, u64 L, u64 i) {
  const u64 off = 8 * i;
  if (off + 8 <= L && (((u64)src + off) & 7) == 0) {
    const u64 v = *(const u64*)(src + off);
    return V16{(u32)v, (u32)(v >> 32), 0, 0};
  }
  u32 w[2] = {0, 0};
  for (u64 k = off; k < L && k < off + 8; ++k) w[(k - off) / 4] |= (u32)src[k] << (8 * ((k - off) % 4));
  return V16{w[0], w[1], 0, 0};
}

__device__ __forceinline__ bool ll_complete(V16 line, u32 f) { return line.y == f && line.w == f; }

template <class E>
__device__ void allreduce_ll(const AllReduceArgs& a, const WaitArgs& w, u64* state) {
  const u64* ll = (const u64*)a.ll;
  const u32 nb = gridDim.x - 1;  // (the last block hands off)
  // The next collective's state is written as soon as every block has read this one's (its
  // seq, and the hand-off block its ring index), not by the last block to finish: that
  // took a fence and a count behind the sum. Each data block counts itself in once its
  // threads read the state; the hand-off block waits for all of them (blocks of this
  // launch, all resident) and advances it. Nothing here reads the state's seq or ring
  // again. (The LL way does not use the hand-off counters: this seq's set counts blocks.)
  u32* const read = (u32*)a.counters + (w.seq % COUNTER_SETS) * PIECES;
  if (blockIdx.x == nb) {
    const u64 first = state_word(state, STATE_RING);
    __syncthreads();  // (every thread read the state before it moves on)
    if (threadIdx.x == 0 && !plane_failed(state)) {  // (one thread: nothing of its block's
      hand_off_entries((const u64*)a.dtab, (u8*)a.ring, state, first,  // to order first)
                       w.seq, a.S, a.call, 0, PIECES - 1,
                       (u32)(a.ll_proxy ? CHUNK_LL : CHUNK_DIRECT));
      TL_STAMP(state, w.seq, TL_EXIT);  // (whichever of the two threads ends last stamps last)
    }
    if (threadIdx.x == (blockDim.x > 1 ? 1u : 0u)) {
      const u64 t0 = globaltimer();
      // (a failed collective may have left a count behind, and a failed wait here fails the
      // plane: on a failed plane nothing is published, so the advance need not wait; seq
      // still moves on as the host expects, as it does for every collective)
      for (u32 spins = 1; ld_acquire_gpu32(read) < nb && !plane_failed(state); ++spins)
        if (!still_waiting(w, spins, t0, (u64)w.rank, NO_WORD, PIECES - 1)) break;
      st_volatile_u32(read, 0);  // (ready for seq + COUNTER_SETS)
      advance_state(state, PIECES, 0);
      TL_STAMP(state, w.seq, TL_EXIT);
    }
    return;
  }
  __syncthreads();  // every thread of the block read the state (WAIT_ARGS_INIT)
  if (threadIdx.x == 0) red_release_gpu(read, 1);
  if (plane_failed(state)) {  // publish nothing; the first thread records why (as a poller)
    if (blockIdx.x == 0 && threadIdx.x == 0) earlier_wait_failed(w);
    return;
  }
  const u8* src = (const u8*)a.src;
  u8* dst = (u8*)a.dst;
  const u32 f = (u32)(w.seq + 1);
  const u64 slot = (w.seq % LL_SLOTS) * (u64)w.world * LL_SOURCE_BYTES;
  const u64 lines = (a.L + 7) / 8;
  const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x, nthreads = (u64)nb * blockDim.x;
  if (a.ll_proxy) {  // once, into this rank's own block: the proxy posts the slice's S / 8
    u8* const own = (u8*)ll[w.rank] + slot + (u64)w.rank * LL_SOURCE_BYTES;  // lines (CHUNK_LL)
    for (u64 i = tid; i < a.S / 8; i += nthreads) {
      const V16 v = ll_own_line(src, a.L, i);
      st_ll16(own + 16 * i, V16{v.x, f, v.y, f});
    }
  } else {
    for (u64 i = tid; i < lines; i += nthreads) {
      const V16 v = ll_own_line(src, a.L, i);
      for (int d = 0; d < w.world; ++d) {
        if (d == w.rank) continue;
        st_ll16((u8*)ll[d] + slot + (u64)w.rank * LL_SOURCE_BYTES + 16 * i, V16{v.x, f, v.y, f});
      }
    }
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) TL_STAMP(state, w.seq, TL_STORED);
  const u8* mine = (const u8*)ll[w.rank] + slot;
  const u64 t0 = globaltimer();
  // Through the proxy the lines come from a host thread (or NIC) into host memory, and each
  // read of them crosses PCIe (GPU-direct on one GPU they sit in its L2): a thousand threads
  // polling a line each put as many small reads in flight at a time (H200, 8 KiB world 2:
  // 67-76 us a call, against 39-40 us this way). So one thread per block waits for every
  // source's last line (the copies store lines in order, so the others are there by then, or
  // nearly: each thread still checks its own below), then the block reads its lines.
  if (a.ll_proxy && lines) {
    if (threadIdx.x == 0) {
      for (int s = 0; s < w.world; ++s) {
        if (s == w.rank) continue;
        const u8* at = mine + (u64)s * LL_SOURCE_BYTES + 16 * (lines - 1);
        for (u32 spins = 1; !ll_complete(ld_sys16(at), f); ++spins) {
          const int word = w.waits[s * w.maxw];
          if (plane_failed(state) ||
              !still_waiting(w, spins, t0, (u64)s, word < 0 ? NO_WORD : (u64)word, PIECES - 1))
            break;  // (the threads' own reads below find the plane failed)
        }
      }
    }
    __syncthreads();
  }
  for (u64 i = tid; i < lines; i += nthreads) {
    V16 line[BATCH];  // (LL needs world <= BATCH; ~f: not read yet)
#pragma unroll
    for (int s = 0; s < BATCH; ++s) line[s] = V16{0, ~f, 0, ~f};
    for (u32 spins = 1;; ++spins) {  // every source's line read together, again while short
      int short_at = -1;
#pragma unroll
      for (int s = 0; s < BATCH; ++s) {
        if (s < w.world && s != w.rank && !ll_complete(line[s], f)) {
          const u8* at = mine + (u64)s * LL_SOURCE_BYTES + 16 * i;
          line[s] = a.ll_proxy ? ld_sys16(at) : ld_ll16(at);  // (a CPU thread or NIC wrote
                                                               // it: ld.cv, cached lines stale)
          if (!ll_complete(line[s], f)) short_at = s;
        }
      }
      if (short_at < 0) break;
      if (spins % ABORT_EVERY == 0 && plane_failed(state)) return;  // another thread failed
      // (a failure names the source's first AG wait word: its connection)
      const int word = w.waits[short_at * w.maxw];
      if (!still_waiting(w, spins, t0, (u64)short_at, word < 0 ? NO_WORD : (u64)word, PIECES - 1))
        return;
    }
    if (i == 0) TL_STAMP(state, w.seq, TL_RELEASED);
    V16 v[BATCH];  // (each source's data words, this rank's own at rank; the upper 8 bytes 0)
#pragma unroll
    for (int s = 0; s < BATCH; ++s)
      if (s < w.world)
        v[s] = s == w.rank ? ll_own_line(src, a.L, i) : V16{line[s].x, line[s].z, 0, 0};
    const V16 r = sum_sources<E>(v, w.world, a.avg != 0);
    const u64 off = 8 * i;
    if (off + 8 <= a.L && (((u64)dst + off) & 7) == 0) {
      *(u64*)(dst + off) = (u64)r.x | (u64)r.y << 32;
    } else {
      const u32 rw[2] = {r.x, r.y};
      for (u64 k = off; k < a.L && k < off + 8; ++k) dst[k] = (u8)(rw[(k - off) / 4] >> (8 * ((k - off) % 4)));
    }
    if (i == 0) TL_STAMP(state, w.seq, TL_SUMMED);
  }
#ifdef SCCL_TIMELINE  // (the block that ends last stamps last; a measurement build only)
  __syncthreads();
  if (threadIdx.x == 0) TL_STAMP(state, w.seq, TL_EXIT);
#endif
}

template <class E>
__device__ __forceinline__ void allreduce_one_shot(const AllReduceArgs& a) {
  wait_previous_grid();  // (launched early where the plane says so: allreduce_engine.py)
  let_next_grid_start();
  const WaitParams* wp = (const WaitParams*)a.wp;
  WAIT_ARGS_INIT(a.S)
  if (a.ll) {
    if (blockIdx.x == 0 && threadIdx.x == 0) TL_STAMP(state, w.seq, TL_ENTER);
    allreduce_ll<E>(a, w, state);  // (it advances the state itself)
    return;
  }
  const u32 npub = (u32)a.npub;
  const u32 gate_target = (u32)state_word(state, STATE_GATE) + npub;
  const u64 gate_add = a.gate ? npub : 0;
  // A one-hand-off slice: every block reads the state here, then counts itself in, and the
  // poller advances it early (advance_early); a larger one: the last block to finish.
  const bool early = a.S <= ONE_HANDOFF_SLICE;
  const u64 first_index = state_word(state, STATE_RING);
  u8* slot = slot_at((u8*)a.slot, a.slot_code, w.seq);
  u32* counters = (u32*)a.counters;
  if (blockIdx.x == 0 && threadIdx.x == 0) TL_STAMP(state, w.seq, TL_ENTER);
  if (early) {
    __syncthreads();  // (every thread of the block read the state)
    if (threadIdx.x == 0 && blockIdx.x != npub) red_release_gpu((u32*)(state + STATE_EXITS), 1);
  }
  if (blockIdx.x < npub) {
    if (a.dtab) {
      PubArgs p;
      p.src = (const u8*)a.src; p.src_stride = 0; p.src_sys = 0; p.L = a.L; p.S = a.S;
      p.dtab = (const u64*)a.dtab; p.own_dst = (u8*)0; p.dst2 = (u8*)0; p.ring = (u8*)a.ring;
      p.state = state; p.first_index = first_index; p.seq = w.seq;
      p.call = a.call; p.sized = false;
      p.counters = counters + (w.seq % COUNTER_SETS) * PIECES;
      direct_publish(p, blockIdx.x, npub);
    } else if (a.S <= ONE_HANDOFF_SLICE) {
      // The proxy path, one hand-off: every block copies its share of the vector into the
      // own AG block; block 0 writes one entry's fields for the eight pieces (CHUNK_WHOLE)
      // beside its copy, and the last block to arrive its tag, all behind the arrivals'
      // fence: the proxy reads one entry and posts the slice in one go (docs/PROTOCOL.md
      // "Streams").
      if (!plane_failed(state)) {
        team_copy<false>(slot + w.rank * a.S, (u8*)0, (const u8*)a.src, a.L, blockIdx.x, npub);
        hand_off_fields_first(counters + (w.seq % COUNTER_SETS) * PIECES, npub,
                              blockIdx.x == 0, (u8*)a.ring, state, first_index, w.seq, a.S,
                              a.call, 0, PIECES - 1, (u32)CHUNK_WHOLE);
      }
    } else {
      PublishArgs pub;
      pub.src = a.src; pub.src_stride = 0;
      pub.dst = a.slot + w.rank * a.S; pub.dst_code = a.slot_code; pub.dst_stride = a.S;
      pub.dst2 = 0; pub.nchunks = 1; pub.L = a.L; pub.S = a.S;
      pub.ring = a.ring; pub.state = (u64)state; pub.call = a.call;
      pub.counters = (u64)counters; pub.bpp = npub / PIECES;
      publish_role(pub, blockIdx.x);
    }
    allreduce_src_read((u32*)a.gate);
  } else {
    allreduce_consume<E>(a, slot, w, blockIdx.x - npub, gridDim.x - npub, gate_target,
                         gate_add);
  }
  if (!early) {
    last_block_advances(state, PIECES, gate_add);
    return;
  }
#ifdef SCCL_TIMELINE  // (the block that ends last stamps last; a measurement build only)
  __syncthreads();
  if (threadIdx.x == 0) TL_STAMP(state, w.seq, TL_EXIT);
#endif
}

#define ALLREDUCE_KERNEL(NAME, E)                                                            \
  extern "C" __global__ void __launch_bounds__(256, 2) NAME(const AllReduceArgs a) {         \
    allreduce_one_shot<E>(a);                                                                \
  }

ALLREDUCE_KERNEL(sccl_allreduce_bf16, BF16)
ALLREDUCE_KERNEL(sccl_allreduce_f16, F16)
ALLREDUCE_KERNEL(sccl_allreduce_f32, F32)
