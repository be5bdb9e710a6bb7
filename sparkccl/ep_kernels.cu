// The one-box MoE finalize as a kernel of its own, for ExpertParallel.combine on a token's
// home rank (sparkccl/ep_cuda.py): row t = shared[t] + sum_k w[t, k] * y[pos[t * topk + k]],
// each 16-byte unit computed by the data plane's fin_unit (finalize.cu), so the rows are the
// same bits as the finalize fused into the reduce-scatter and as its CPU twin. No flags, no
// ring, no host work: it runs wherever the stream is, captured in a CUDA graph included.
#pragma once
#include "finalize.cu"

extern "C" __global__ void __launch_bounds__(256) sccl_ep_finalize(
    const u8* y, const float* scales, const int* pos, const float* wts, const u8* shared,
    u32* bad, u64 T, u64 topk, u64 H, u64 R, u64 fp8, u8* out) {
  const FinArgs a = {y, scales, pos, wts, shared, bad, T, topk, H, R, fp8};
  const u64 upr = H / 8;  // 16-byte output units per row
  const u64 n = T * upr;
  const u64 nthreads = (u64)gridDim.x * blockDim.x;
  for (u64 u = (u64)blockIdx.x * blockDim.x + threadIdx.x; u < n; u += nthreads) {
    const u64 t = u / upr, cu = u - t * upr;
    st16(out + t * 2 * H + cu * 16, fp8 ? fin_unit<true>(a, t, cu) : fin_unit<false>(a, t, cu));
  }
}

// ---------------------------------------------------------------- dispatch: pack and unpack
//
// ExpertParallel.dispatch on CUDA (sparkccl/ep_cuda.py): sccl_ep_pack builds the all-to-all's
// send blocks from the tokens and their top-k ids, sccl_ep_unpack (low-latency mode) selects
// this rank's entries from the received blocks. The torch path of expert_parallel.py is the
// specification: the same bytes everywhere it defines them. Every block of a destination
// (pack) or local expert (unpack) redoes that index's scan (cheap: a few thousand ids), so
// one launch needs no grid-wide sync; the extra blocks (blockIdx.y) only split the copies.

#define EP_THREADS 256
#define EP_MAX_TOPK 16
#define EP_UNROLL 4

// Exclusive prefix sum of v over the block (any blockDim.x <= EP_THREADS, all threads call
// it); *total = the block's sum. sh: 2 * blockDim.x words, free again on return.
__device__ __forceinline__ u64 ep_block_scan(u64 v, u64* sh, u64* total) {
  const unsigned tid = threadIdx.x, nt = blockDim.x;
  u64* a = sh;
  u64* b = sh + nt;
  a[tid] = v;
  __syncthreads();
  for (unsigned off = 1; off < nt; off <<= 1) {
    u64 s = a[tid];
    if (tid >= off) s += a[tid - off];
    b[tid] = s;
    __syncthreads();  // every read of a is done before a becomes the next step's b
    u64* t = a;
    a = b;
    b = t;
  }
  const u64 incl = a[tid];
  *total = a[nt - 1];
  __syncthreads();  // sh is reused by the caller's next scan
  return incl - v;
}

// The block's 16-byte units 0..n-1, unit i copied *from -> *to where at(i, &from, &to) says
// so: EP_UNROLL loads in flight per thread before their stores (the accesses are volatile
// asm, kept in program order), as a prefill's thousands of 14 KiB rows need.
template <class At>
__device__ __forceinline__ void ep_copy16(u64 n, At at) {
  const u64 nt = blockDim.x;
  for (u64 i0 = threadIdx.x; i0 < n; i0 += EP_UNROLL * nt) {
    V16 v[EP_UNROLL];
    u8* to[EP_UNROLL];
#pragma unroll
    for (int k = 0; k < EP_UNROLL; ++k) {
      const u8* from = nullptr;
      to[k] = nullptr;
      if (i0 + k * nt < n && at(i0 + k * nt, &from, &to[k])) v[k] = ld_dev16(from);
      else to[k] = nullptr;
    }
#pragma unroll
    for (int k = 0; k < EP_UNROLL; ++k)
      if (to[k]) st16(to[k], v[k]);
  }
}

// Top-k id k of token t, as torch's .to(torch.int32) makes it (int64 ids wrap).
__device__ __forceinline__ int ep_id(const void* idx, u64 idx64, u64 i) {
  return idx64 ? (int)((const long long*)idx)[i] : ((const int*)idx)[i];
}

// Whether expert v (0 <= v < E) lives on rank `target`: a table in the block's shared memory
// where E fits, filled once per block, so that a scanned row's K lookups are not K trips to
// global memory one after another; owner[] itself above EP_OWN_MAX experts.
#define EP_OWN_MAX 8192
struct EpOwned {
  const int* owner;
  const u8* tab;  // tab[v] = owner[v] == target, or null
  u64 target;
  __device__ __forceinline__ bool operator()(int v) const {
    return tab ? tab[v] != 0 : (u64)owner[v] == target;
  }
};
// Every thread of the block calls it (a __syncthreads inside).
__device__ __forceinline__ EpOwned ep_owned(const int* owner, u64 E, u64 target, u8* tab) {
  const bool fits = E <= EP_OWN_MAX;
  if (fits)
    for (u64 v = threadIdx.x; v < E; v += blockDim.x) tab[v] = (u64)owner[v] == target;
  __syncthreads();
  return EpOwned{owner, fits ? tab : nullptr, target};
}

// A row's K ids into registers, all loads issued before any is used (ids past K: -1).
template <class Load>
__device__ __forceinline__ void ep_ids(u64 K, int* v, Load load) {
#pragma unroll
  for (int k = 0; k < EP_MAX_TOPK; ++k) v[k] = (u64)k < K ? load((u64)k) : -1;
}

// Pack. Block x = destination d (0..W-1), y = which of gridDim.y shares of d's rows it copies.
// Per token t (thread), the cleaned ids (out of range, or equal to an earlier k: -1), the
// owner of each, hit = some id on d, cnt = its ids on d; a block scan gives t's row in d's
// block (tokens in order) and each entry's rank nth among this rank's entries on d in (t, k)
// order: pos[t * K + k] = d * Pc + nth (limit and nth >= Pc: W * Pc, counted in *overflow).
// Block (0, 0) also writes pos = W * Pc and bad[] = 1 for refused entries (counted in
// *bad_count), bad[] = 0 elsewhere. counts (non-null): only count, [d] = d's tokens,
// [W + d] = d's entries, nothing else written. Row r of d's block (BlockLayout: the ids
// section at idx_off, the scales at scales_off, the rows at x_off): ids [t, id_0 ..
// id_{K-1}], its scales (4-byte words), the token's row bytes (16-byte units); ids of rows
// past d's tokens are -1 (their row bytes and scales are left as they are). The block's
// first 8 bytes: x_off + its tokens * row_bytes, the bytes the sized all-to-all sends.
extern "C" __global__ void __launch_bounds__(EP_THREADS) sccl_ep_pack(
    const void* idx, u64 idx64, const int* owner, u64 n, u64 K, u64 E, u64 W, u64 Pd, u64 Pc,
    u64 limit, const u8* x, const u8* xs, u64 row_bytes, u64 scale_bytes, u8* send,
    u64 block_bytes, u64 scales_off, u64 idx_off, u64 x_off, int* pos, u8* bad, u64* bad_count,
    u64* overflow, int* counts) {
  __shared__ u64 sh[2 * EP_THREADS];
  __shared__ int tok[EP_THREADS];
  __shared__ u8 own_tab[EP_OWN_MAX];
  const unsigned tid = threadIdx.x, nt = blockDim.x;
  const u64 d = blockIdx.x, share = blockIdx.y, shares = gridDim.y;
  const bool lead = share == 0;
  const EpOwned on_d = ep_owned(owner, E, d, own_tab);
  u8* blk = send + d * block_bytes;
  int* ids = (int*)(blk + idx_off);
  const u64 upr = row_bytes / 16, spr = scale_bytes / 4;
  u64 rows = 0, ents = 0;  // d's tokens and entries before this tile
  u64 nbad = 0, nover = 0;
  for (u64 t0 = 0; t0 < n; t0 += nt) {
    const u64 t = t0 + tid;
    int cid[EP_MAX_TOPK], raw[EP_MAX_TOPK];
    u64 hit = 0, cnt = 0;
    if (t < n) {
      ep_ids(K, raw, [&](u64 k) { return ep_id(idx, idx64, t * K + k); });
      for (u64 k = 0; k < K; ++k) {
        const int v = raw[k];
        bool b = v < 0 || (u64)v >= E;
        for (u64 j = 0; j < k; ++j) b = b || raw[j] == v;
        cid[k] = b ? -1 : v;
        if (!b && on_d(v)) ++cnt;
      }
      hit = cnt ? 1 : 0;
    }
    u64 tile;
    const u64 ex = ep_block_scan((hit << 32) | cnt, sh, &tile);
    const u64 row = rows + (ex >> 32), nth0 = ents + (ex & 0xffffffffull);
    const u64 tile_rows = tile >> 32;
    if (t < n && !counts) {
      if (hit) tok[ex >> 32] = (int)t;
      if (lead) {
        u64 nth = nth0;
        for (u64 k = 0; k < K; ++k) {
          const int v = cid[k];
          if (v >= 0 && on_d(v)) {
            const bool over = limit && nth >= Pc;
            nover += over;
            pos[t * K + k] = (int)(over ? W * Pc : d * Pc + nth);
            ++nth;
          }
          if (d == 0) {  // refused entries have no destination: block (0, 0) takes them
            bad[t * K + k] = v < 0;
            if (v < 0) {
              pos[t * K + k] = (int)(W * Pc);
              ++nbad;
            }
          }
        }
      }
      if (hit && row < Pd && row % shares == share) {
        int* r = ids + row * (K + 1);
        r[0] = (int)t;
        for (u64 k = 0; k < K; ++k) r[k + 1] = cid[k];
      }
    }
    __syncthreads();  // tok[] complete
    if (!counts) {
      // this share's rows of the tile: j = j0, j0 + shares, ... (row = rows + j)
      const u64 j0 = (share + shares - rows % shares) % shares;
      const u64 mine = j0 < tile_rows ? (tile_rows - j0 + shares - 1) / shares : 0;
      ep_copy16(mine * upr, [&](u64 i, const u8** from, u8** to) {  // (32-bit: see unpack)
        const u32 jj = (u32)i / (u32)upr, u = (u32)i - jj * (u32)upr;
        const u64 j = j0 + (u64)jj * shares, r = rows + j;
        *from = x + (u64)tok[j] * row_bytes + (u64)u * 16;
        *to = blk + x_off + r * row_bytes + (u64)u * 16;
        return r < Pd;
      });
      for (u64 i = tid; i < mine * spr; i += nt) {
        const u32 jj = (u32)i / (u32)spr, w = (u32)i - jj * (u32)spr;
        const u64 j = j0 + (u64)jj * shares, r = rows + j;
        if (r < Pd)
          ((u32*)(blk + scales_off + r * scale_bytes))[w] =
              ((const u32*)(xs + (u64)tok[j] * scale_bytes))[w];
      }
    }
    __syncthreads();  // tok[] is rewritten by the next tile
    rows += tile_rows;
    ents += tile & 0xffffffffull;
  }
  if (counts) {
    if (lead && tid == 0) {
      counts[d] = (int)rows;
      counts[W + d] = (int)ents;
    }
    return;
  }
  if (lead) {
    if (tid == 0) *(u64*)blk = x_off + (rows < Pd ? rows : Pd) * row_bytes;
    for (u64 i = rows * (K + 1) + tid; i < Pd * (K + 1); i += nt) ids[i] = -1;
    if (nbad) atomicAdd((unsigned long long*)bad_count, (unsigned long long)nbad);
    if (nover) atomicAdd((unsigned long long*)overflow, (unsigned long long)nover);
  }
}

// Unpack. Block x = local expert e (global id experts[e]), y = which of gridDim.y shares of
// e's rows it copies. Over the received rows (s, p) in order (source s's block, row p; ids
// [token, id_0 ..]), an entry is "mine" when its id's owner is this rank: a block scan gives,
// per row that names e (at k; at most once, ids are distinct per row), rank_in (e's rows
// before it) and nth_in (source s's mine entries before (p, k), the row the source numbered
// for it). Received row i = base + rank_in takes the token's row bytes, scales, (s, token,
// k); feed[s * Pc + nth_in] = i (not past Pc when limit). Block (e, 0) writes counts[e];
// block (0, 0) writes ret_counts[s] = min(source s's mine entries, Pc) (the rows combine
// returns to s) and feed = 0 at the rows no entry takes (each source's rows past those).
// Low-latency (offsets null): base = e * cap, and -1 in e's src_* past the count.
// High-throughput: base = offsets[e] (packed rows; the host sized them from a count_only
// launch, which writes counts[e] and nothing else, with no scan: one sum per block).
extern "C" __global__ void __launch_bounds__(EP_THREADS) sccl_ep_unpack(
    const u8* got, u64 block_bytes, u64 scales_off, u64 idx_off, u64 x_off, const int* owner,
    const int* experts, u64 rank, u64 E, u64 W, u64 Pd, u64 K, u64 cap, u64 Pc, u64 limit,
    u64 row_bytes, u64 scale_bytes, u8* rx, u8* xs, int* counts, int* src_rank,
    int* src_token, int* src_k, long long* feed, const long long* offsets, u64 count_only,
    long long* ret_counts) {
  __shared__ u64 sh[2 * EP_THREADS];
  __shared__ u64 srx[EP_THREADS], srs[EP_THREADS];  // e's rows of the tile: got offsets
  __shared__ u64 mexs[EP_THREADS];
  __shared__ u8 own_tab[EP_OWN_MAX];
  const unsigned tid = threadIdx.x, nt = blockDim.x;
  const u64 e = blockIdx.x, share = blockIdx.y, shares = gridDim.y;
  const bool lead = share == 0;
  const int ge = experts[e];
  if (count_only) {
    u64 c = 0, total;
    for (u64 q = tid; q < W * Pd; q += nt) {
      const int* r = (const int*)(got + q / Pd * block_bytes + idx_off) + q % Pd * (K + 1);
      for (u64 k = 0; k < K; ++k)
        if (r[k + 1] == ge) {
          ++c;
          break;
        }
    }
    ep_block_scan(c, sh, &total);
    if (lead && tid == 0) counts[e] = (int)total;
    return;
  }
  const u64 base = offsets ? (u64)offsets[e] : e * cap;
  const u64 upr = row_bytes / 16, spr = scale_bytes / 4;
  const EpOwned is_mine = ep_owned(owner, E, rank, own_tab);
  // The received rows g = s * Pd + p of every source, nt to a tile (a tile may span
  // sources: one scan per tile, not one per source). nth_in counts source s's mine entries
  // from its first row: within the tile, the exclusive sum at that row (mexs[], shared);
  // where s began in an earlier tile, carry = its mine entries there (only the tile's first
  // source can have).
  u64 have = 0;   // e's rows before this tile
  u64 carry = 0;  // mine entries, in earlier tiles, of the source of this tile's first row
  const u64 rows_all = W * Pd;
  for (u64 g0 = 0; g0 < rows_all; g0 += nt) {
    const u64 g = g0 + tid, s = g / Pd, p = g - s * Pd;
    u64 has = 0, m = 0, before = 0;  // before: mine entries of the row ahead of e's
    int kk = -1, token = -1;
    if (g < rows_all) {
      const int* r = (const int*)(got + s * block_bytes + idx_off) + p * (K + 1);
      int v[EP_MAX_TOPK];
      token = r[0];
      ep_ids(K, v, [&](u64 k) { return r[k + 1]; });
      for (u64 k = 0; k < K; ++k) {
        if (v[k] >= 0 && (u64)v[k] < E && is_mine(v[k])) {
          if (v[k] == ge && kk < 0) {
            kk = (int)k;
            before = m;
          }
          ++m;
        }
      }
      has = kk >= 0;
    }
    u64 tile;
    const u64 ex = ep_block_scan((has << 32) | m, sh, &tile);
    const u64 mex = ex & 0xffffffffull;
    mexs[tid] = mex;
    if (has) {  // (the row's offsets in got, so that the copies below divide by nothing wide)
      srx[ex >> 32] = s * block_bytes + x_off + p * row_bytes;
      srs[ex >> 32] = s * block_bytes + scales_off + p * scale_bytes;
    }
    __syncthreads();  // mexs[], srx[], srs[] complete
    const u64 first = s * Pd;  // source s's first row
    const u64 from_s = first >= g0 ? mex - mexs[first - g0] : carry + mex;
    const u64 rank_in = have + (ex >> 32);
    const u64 nth_in = from_s + before;
    const u64 tile_rows = tile >> 32;
    if (has) {
      const u64 i = base + rank_in;
      if (rank_in % shares == share) {
        src_rank[i] = (int)s;
        src_token[i] = token;
        src_k[i] = kk;
        if (!limit || nth_in < Pc) feed[s * Pc + nth_in] = (long long)i;
      }
    }
    if (e == 0 && lead && g < rows_all && p == Pd - 1) {  // source s's last row
      const u64 held = from_s + m;
      ret_counts[s] = (long long)(held < Pc ? held : Pc);
    }
    const u64 j0 = (share + shares - have % shares) % shares;
    const u64 mine = j0 < tile_rows ? (tile_rows - j0 + shares - 1) / shares : 0;
    // (unit indices within a tile's rows fit 32 bits: 32-bit divisions, a few instructions
    // where a 64-bit one is a call of ~70, per 16-byte unit)
    ep_copy16(mine * upr, [&](u64 i, const u8** from, u8** to) {
      const u32 jj = (u32)i / (u32)upr, u = (u32)i - jj * (u32)upr;
      const u64 j = j0 + (u64)jj * shares;
      *from = got + srx[j] + (u64)u * 16;
      *to = rx + (base + have + j) * row_bytes + (u64)u * 16;
      return true;
    });
    for (u64 i = tid; i < mine * spr; i += nt) {
      const u32 jj = (u32)i / (u32)spr, w = (u32)i - jj * (u32)spr;
      const u64 j = j0 + (u64)jj * shares;
      ((u32*)(xs + (base + have + j) * scale_bytes))[w] = ((const u32*)(got + srs[j]))[w];
    }
    // the carry into the next tile: the mine entries so far of the source of its first row
    const u64 g_end = g0 + nt < rows_all ? g0 + nt : rows_all;  // (this tile's rows end)
    const u64 s_next = g_end / Pd, first_next = s_next * Pd;
    const u64 tile_m = tile & 0xffffffffull;
    carry = first_next >= g_end ? 0
            : first_next >= g0 ? tile_m - mexs[first_next - g0] : carry + tile_m;
    __syncthreads();  // srx[], srs[], mexs[] are rewritten by the next tile
    have += tile_rows;
  }
  if (e == 0 && lead) {  // feed = 0 at the rows no entry takes: source s's from ret_counts[s]
    __syncthreads();  // (this block's ret_counts[] written, by each source's last row: Pd >= 1)
    for (u64 s = 0; s < W; ++s)
      for (u64 q = (u64)ret_counts[s] + tid; q < Pc; q += nt) feed[s * Pc + q] = 0;
  }
  if (lead) {
    if (tid == 0) counts[e] = (int)have;
    for (u64 i = have + tid; !offsets && i < cap; i += nt) {
      src_rank[e * cap + i] = -1;
      src_token[e * cap + i] = -1;
      src_k[e * cap + i] = -1;
    }
  }
}

// The sized combine's plan of one dispatch (expert_parallel.py SizedCombine; the torch ops of
// ExpertParallel._sized_plan are its specification): feed2[d * (Pc + 1)] = 0 (the header
// row), feed2[d * (Pc + 1) + 1 + j] = feed[d * Pc + j]; header[d] = (1 + ret_counts[d]) * rb;
// pos2[i] = min(pos[i] + pos[i] / Pc + 1, W * (Pc + 1)) (pos >= 0). One launch where the
// torch ops take seven: a decode dispatch is a string of small launches.
extern "C" __global__ void __launch_bounds__(EP_THREADS) sccl_ep_sized_plan(
    const long long* feed, const long long* ret_counts, const int* pos, u64 W, u64 Pc, u64 n,
    u64 rb, long long* feed2, long long* header, int* pos2) {
  const u64 stride = (u64)gridDim.x * blockDim.x;
  const u64 i0 = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  for (u64 i = i0; i < W * (Pc + 1); i += stride) {
    const u64 d = i / (Pc + 1), j = i % (Pc + 1);
    feed2[i] = j == 0 ? 0 : feed[d * Pc + j - 1];
  }
  for (u64 i = i0; i < W; i += stride) header[i] = (1 + ret_counts[i]) * (long long)rb;
  const long long cap = (long long)(W * (Pc + 1));
  for (u64 i = i0; i < n; i += stride) {
    const long long p = pos[i], q = p + p / (long long)Pc + 1;
    pos2[i] = (int)(q < cap ? q : cap);
  }
}
