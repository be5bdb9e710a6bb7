// The CPU twin of ExpertParallel.dispatch's host work (sparkccl/expert_parallel.py,
// docs/EXPERT_PARALLEL.md): the send blocks before the all-to-all and the per-expert rows
// after it. The torch path there stays the reference (tests compare the two field by field);
// on 2 cores shared by every rank its many small ops cost several ms per call, a single pass
// here costs the row copies. Pointers are addresses from tensor.data_ptr(); the Python side
// checks shapes, dtypes and the routing first. One dispatch block (BlockLayout): its first 8
// bytes the int64 count of its bytes that carry data (x_off + its tokens * row_bytes: the
// all-to-all is sized), from idx_off Pd rows of 1 + K int32 (token index, top-k ids; -1: no
// token), from scales_off Pd rows of scale_bytes, from x_off Pd rows of row_bytes. The send
// side writes the blocks range by range into the all-to-all's send slot (ep_fill_blocks); the
// receive side moves each source's rows as they land (ep_unpack_rows), once every source's
// ids are in (ep_unpack_plan).
#include <nanobind/nanobind.h>
#include <nanobind/stl/tuple.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <tuple>
#include <vector>

namespace nb = nanobind;
using namespace nb::literals;

namespace sparkccl {
namespace {

template <class T>
T* ptr(uint64_t a) {
  return reinterpret_cast<T*>(static_cast<uintptr_t>(a));
}

void need(bool ok, const char* what) {
  if (!ok) throw std::invalid_argument(what);
}

// The owner rank of entry g (W: refused, g < 0). Ids >= E never reach here: the Python side
// refuses them on CPU, or masks them to -1 (device checks).
inline int64_t owner_of(const int32_t* owner, int64_t E, int64_t W, int32_t g) {
  if (g < 0) return W;
  need(g < E, "ep: expert id out of range");
  return owner[g];
}

// counts[d] = tokens of this rank that go to rank d (once each), counts[W + d] = its top-k
// entries that name an expert on d: what high-throughput's capacities are gathered from.
void ep_counts(uint64_t idx_a, int64_t n, int64_t K, uint64_t owner_a, int64_t E, int64_t W,
               uint64_t counts_a) {
  need(n >= 0 && K >= 1 && W >= 1 && E >= 1, "ep_counts: bad sizes");
  need(counts_a && (!n || (idx_a && owner_a)), "ep_counts: null pointer");
  const int32_t* idx = ptr<const int32_t>(idx_a);
  const int32_t* owner = ptr<const int32_t>(owner_a);
  int32_t* counts = ptr<int32_t>(counts_a);
  std::memset(counts, 0, size_t(2 * W) * 4);
  std::vector<int64_t> seen(size_t(W) + 1, -1);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t k = 0; k < K; ++k) {
      const int64_t d = owner_of(owner, E, W, idx[t * K + k]);
      if (d == W) continue;
      ++counts[W + d];
      if (seen[d] != t) seen[d] = t, ++counts[d];
    }
}

// pos[t * K + k] = d * Pc + (the entry's rank among this rank's entries to d, in (t, k)
// order), W * Pc for a refused entry or one past Pc; rowtok[d * Pd + r] = the token in row r
// of the block for d (-1 past its tokens): what ep_fill_blocks then copies, group by group,
// straight into the all-to-all's send slot. Returns (entries past Pc, the first one's
// owner, that owner's entry count) for the caller's combine_rows refusal.
std::tuple<int64_t, int64_t, int64_t> ep_plan(uint64_t idx_a, int64_t n, int64_t K,
                                              uint64_t owner_a, int64_t E, int64_t W,
                                              int64_t Pd, int64_t Pc, uint64_t pos_a,
                                              uint64_t rowtok_a) {
  need(n >= 0 && K >= 1 && W >= 1 && E >= 1 && Pd >= 1 && Pc >= 1, "ep_plan: bad sizes");
  need(rowtok_a && (!n || (idx_a && owner_a && pos_a)), "ep_plan: null pointer");
  const int32_t* idx = ptr<const int32_t>(idx_a);
  const int32_t* owner = ptr<const int32_t>(owner_a);
  int32_t* pos = ptr<int32_t>(pos_a);
  int32_t* rowtok = ptr<int32_t>(rowtok_a);
  for (int64_t i = 0; i < W * Pd; ++i) rowtok[i] = -1;
  std::vector<int64_t> rows(size_t(W), 0), ents(size_t(W) + 1, 0), seen(size_t(W) + 1, -1);
  int64_t over = 0, over_d = -1;
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t d = owner_of(owner, E, W, idx[t * K + k]);
      int64_t p = W * Pc;
      if (d < W) {
        const int64_t nth = ents[d]++;
        if (nth < Pc) {
          p = d * Pc + nth;
        } else if (over++ == 0) {
          over_d = d;
        }
      }
      pos[t * K + k] = int32_t(p);
      if (d == W || seen[d] == t) continue;
      seen[d] = t;
      const int64_t r = rows[d]++;
      need(r < Pd, "ep_plan: more tokens to one rank than the block's rows");
      rowtok[d * Pd + r] = int32_t(t);
    }
  }
  return {over, over_d, over_d >= 0 ? ents[over_d] : 0};
}

// The sections (header, ids, scales, rows) in this order, apart, inside the block.
bool fits(int64_t idx_off, int64_t scales_off, int64_t x_off, int64_t nbytes, int64_t Pd,
          int64_t K, int64_t scale_bytes, int64_t row_bytes) {
  return idx_off >= 8 && scales_off >= idx_off + Pd * (K + 1) * 4 &&
         x_off >= scales_off + Pd * scale_bytes && nbytes >= x_off + Pd * row_bytes;
}

// Bytes [lo, hi) of a block (counted from its start) that fall in its section of `nrows`
// rows of `rb` bytes at `sec`: row r's bytes from src(r) (nullptr: left as they are).
template <class F>
void fill_section(uint8_t* blk, int64_t sec, int64_t rb, int64_t nrows, int64_t lo, int64_t hi,
                  F src) {
  const int64_t a = std::max(lo, sec), b = std::min(hi, sec + nrows * rb);
  for (int64_t r = a < b ? (a - sec) / rb : nrows; r < nrows && sec + r * rb < b; ++r) {
    const int64_t s = sec + r * rb;
    const int64_t x0 = std::max(a, s), x1 = std::min(b, s + rb);
    if (const uint8_t* p = src(r)) std::memcpy(blk + x0, p + (x0 - s), size_t(x1 - x0));
  }
}

// Bytes [lo, hi) of every dispatch block j (BlockLayout: its header; ids -1 past the block's
// tokens) at dst + j * stride + lo, from ep_plan's rowtok. Rows and scales past a block's
// tokens and the padding between sections are not written (never read; the rows past its
// tokens do not travel).
void ep_fill_blocks(uint64_t x_a, int64_t row_bytes, uint64_t sc_a, int64_t scale_bytes,
                    uint64_t idx_a, int64_t n, int64_t K, uint64_t rowtok_a, int64_t W,
                    int64_t Pd, int64_t nbytes, int64_t idx_off, int64_t scales_off,
                    int64_t x_off, uint64_t dst_a, int64_t stride, int64_t lo, int64_t hi) {
  need(K >= 1 && W >= 1 && Pd >= 1 && row_bytes > 0 && scale_bytes >= 0 && lo >= 0 &&
           lo <= hi && hi <= nbytes,
       "ep_fill_blocks: bad sizes");
  need(fits(idx_off, scales_off, x_off, nbytes, Pd, K, scale_bytes, row_bytes),
       "ep_fill_blocks: block layout does not fit");
  need(dst_a && rowtok_a && (!n || (x_a && idx_a && (!scale_bytes || sc_a))),
       "ep_fill_blocks: null pointer");
  const uint8_t* x = ptr<const uint8_t>(x_a);
  const uint8_t* sc = ptr<const uint8_t>(sc_a);
  const int32_t* idx = ptr<const int32_t>(idx_a);
  const int32_t* rowtok = ptr<const int32_t>(rowtok_a);
  const int64_t cols = K + 1;
  int32_t ids[1 + 16 + 1];
  need(cols <= 17, "ep_fill_blocks: topk above 16");
  for (int64_t j = 0; j < W; ++j) {
    uint8_t* blk = ptr<uint8_t>(dst_a) + j * stride;
    const int32_t* tok = rowtok + j * Pd;
    auto token = [&](int64_t r) -> int64_t {
      const int64_t t = tok[r];
      need(t < n, "ep_fill_blocks: token out of range");
      return t;
    };
    if (lo < 8) {  // the header: the block's rows are its first tokens' (rowtok >= 0)
      int64_t rows = 0;
      while (rows < Pd && tok[rows] >= 0) ++rows;
      const int64_t head = x_off + rows * row_bytes;  // (little-endian, as the host)
      std::memcpy(blk + lo, reinterpret_cast<const uint8_t*>(&head) + lo,
                  size_t(std::min<int64_t>(hi, 8) - lo));
    }
    fill_section(blk, x_off, row_bytes, Pd, lo, hi, [&](int64_t r) -> const uint8_t* {
      const int64_t t = token(r);
      return t < 0 ? nullptr : x + t * row_bytes;
    });
    if (scale_bytes)
      fill_section(blk, scales_off, scale_bytes, Pd, lo, hi, [&](int64_t r) -> const uint8_t* {
        const int64_t t = token(r);
        return t < 0 ? nullptr : sc + t * scale_bytes;
      });
    fill_section(blk, idx_off, cols * 4, Pd, lo, hi, [&](int64_t r) -> const uint8_t* {
      const int64_t t = token(r);
      if (t < 0) {
        for (int64_t i = 0; i < cols; ++i) ids[i] = -1;
      } else {
        ids[0] = int32_t(t);
        std::memcpy(ids + 1, idx + t * K, size_t(K) * 4);
      }
      return reinterpret_cast<const uint8_t*>(ids);
    });
  }
}

// Bytes [lo, hi) of every block j of `rows` rows of row_bytes, row i of block j being
// src row index[j * rows + i], at dst + j * stride + lo: combine's send blocks gathered
// from the expert outputs, group by group, straight into the all-to-all's send slot
// (stride may be below a block's bytes: a slice of the blocks, base shifted back by its start).
// src_rows == 0: nothing to gather (no row of the blocks is read).
void ep_fill_rows(uint64_t src_a, int64_t src_rows, int64_t row_bytes, uint64_t index_a,
                  int64_t rows, int64_t W, uint64_t dst_a, int64_t stride, int64_t lo,
                  int64_t hi) {
  need(src_rows >= 0 && row_bytes > 0 && rows >= 1 && W >= 1 && lo >= 0 && lo <= hi &&
           hi <= rows * row_bytes,
       "ep_fill_rows: bad sizes");
  if (!src_rows) return;
  need(src_a && index_a && dst_a, "ep_fill_rows: null pointer");
  const uint8_t* src = ptr<const uint8_t>(src_a);
  const int64_t* index = ptr<const int64_t>(index_a);
  for (int64_t j = 0; j < W; ++j)
    fill_section(ptr<uint8_t>(dst_a) + j * stride, 0, row_bytes, rows, lo, hi,
                 [&](int64_t r) -> const uint8_t* {
                   const int64_t i = index[j * rows + r];
                   need(i >= 0 && i < src_rows, "ep_fill_rows: index out of range");
                   return src + i * row_bytes;
                 });
}

struct Recv {
  const uint8_t* got;
  int64_t W, nbytes, idx_off, Pd, K, E, rank;
  const int32_t* owner;
  const int32_t* local;
  // The local expert of received entry (s, p, k), or -1 when it is not this rank's.
  int64_t expert(int64_t s, int64_t p, int64_t k, int32_t* token) const {
    const int32_t* ids = reinterpret_cast<const int32_t*>(got + s * nbytes + idx_off) + p * (K + 1);
    const int32_t g = ids[1 + k];
    if (g < 0) return -1;
    need(g < E, "ep_unpack: received expert id out of range");
    if (owner[g] != rank) return -1;
    if (token) *token = ids[0];
    return local[g];
  }
};

Recv recv_of(uint64_t got_a, int64_t W, int64_t nbytes, int64_t idx_off, int64_t Pd, int64_t K,
             uint64_t owner_a, uint64_t local_a, int64_t E, int64_t rank) {
  need(W >= 1 && Pd >= 1 && K >= 1 && E >= 1 && idx_off >= 0 &&
           nbytes >= idx_off + Pd * (K + 1) * 4,
       "ep_unpack: bad sizes");
  need(got_a && owner_a && local_a, "ep_unpack: null pointer");
  return Recv{ptr<const uint8_t>(got_a), W, nbytes, idx_off, Pd, K, E, rank,
              ptr<const int32_t>(owner_a), ptr<const int32_t>(local_a)};
}

// From every source's ids (in `got` already; its rows need not be): counts[e] (int64 [El])
// the received entries of local expert e, and cur[s * El + e] (int64 [W * El]) the out row
// of source s's first entry of e: the received entries go in (local expert, source, token)
// order, local expert e's i-th at base[e] + i (high-throughput: the prefix of counts;
// low-latency: e * cap). Also sets up the outputs: feed (int64 [W * Pc]) all 0, and
// low-latency src_* (int32 [El * cap]) all -1 (the rows past the counts keep that).
void ep_unpack_plan(uint64_t got_a, int64_t W, int64_t nbytes, int64_t idx_off, int64_t Pd,
                    int64_t K, uint64_t owner_a, uint64_t local_a, int64_t E, int64_t rank,
                    int64_t El, bool ll, int64_t cap, int64_t Pc, uint64_t counts_a,
                    uint64_t cur_a, uint64_t feed_a, uint64_t src_rank_a, uint64_t src_token_a,
                    uint64_t src_k_a) {
  const Recv r = recv_of(got_a, W, nbytes, idx_off, Pd, K, owner_a, local_a, E, rank);
  need(El >= 1 && Pc >= 1 && (!ll || cap >= 1), "ep_unpack_plan: bad sizes");
  need(counts_a && cur_a && feed_a && (!ll || (src_rank_a && src_token_a && src_k_a)),
       "ep_unpack_plan: null pointer");
  int64_t* counts = ptr<int64_t>(counts_a);
  int64_t* cur = ptr<int64_t>(cur_a);
  std::memset(cur, 0, size_t(W * El) * 8);
  for (int64_t s = 0; s < W; ++s)
    for (int64_t p = 0; p < Pd; ++p)
      for (int64_t k = 0; k < K; ++k) {
        const int64_t e = r.expert(s, p, k, nullptr);
        if (e >= 0) ++cur[s * El + e];
      }
  int64_t rows = 0;
  for (int64_t e = 0; e < El; ++e) {
    int64_t at = ll ? e * cap : rows, n = 0;
    for (int64_t s = 0; s < W; ++s) {
      const int64_t c = cur[s * El + e];
      cur[s * El + e] = at;
      at += c;
      n += c;
    }
    need(!ll || n <= cap, "ep_unpack: more rows for an expert than world * max_tokens");
    counts[e] = n;
    rows += n;
  }
  std::memset(ptr<int64_t>(feed_a), 0, size_t(W * Pc) * 8);
  if (ll)
    for (int64_t i = 0; i < El * cap; ++i)
      ptr<int32_t>(src_rank_a)[i] = ptr<int32_t>(src_token_a)[i] = ptr<int32_t>(src_k_a)[i] = -1;
}

// Rows [p0, p1) of source s's block (ids, scales and rows in `got`): each entry of this
// rank's at out row cur[s * El + e]++ (row bytes, scales, src_* = (s, token, k)), and
// feed[s * Pc + nth[s]++] = that row (source s's entries held here in (token, k) order; past
// Pc: refused by the home rank). Called for each source's rows in order, from ep_unpack_plan's
// cur and nth[s] = 0: the same rows as one pass over every block.
void ep_unpack_rows(uint64_t got_a, int64_t W, int64_t nbytes, int64_t idx_off,
                    int64_t scales_off, int64_t x_off, int64_t row_bytes, int64_t scale_bytes,
                    int64_t Pd, int64_t K, uint64_t owner_a, uint64_t local_a, int64_t E,
                    int64_t rank, int64_t El, int64_t Pc, int64_t rows, int64_t s, int64_t p0,
                    int64_t p1, uint64_t cur_a, uint64_t nth_a, uint64_t rx_a, uint64_t xs_a,
                    uint64_t src_rank_a, uint64_t src_token_a, uint64_t src_k_a,
                    uint64_t feed_a) {
  const Recv r = recv_of(got_a, W, nbytes, idx_off, Pd, K, owner_a, local_a, E, rank);
  need(fits(idx_off, scales_off, x_off, nbytes, Pd, K, scale_bytes, row_bytes) && El >= 1 &&
           Pc >= 1 && rows >= 0 && 0 <= s && s < W && 0 <= p0 && p0 <= p1 && p1 <= Pd,
       "ep_unpack_rows: bad sizes");
  need(cur_a && nth_a && feed_a &&
           (!rows || (rx_a && (!scale_bytes || xs_a) && src_rank_a && src_token_a && src_k_a)),
       "ep_unpack_rows: null pointer");
  int64_t* cur = ptr<int64_t>(cur_a) + s * El;
  int64_t& nth = ptr<int64_t>(nth_a)[s];
  uint8_t* rx = ptr<uint8_t>(rx_a);
  uint8_t* xs = ptr<uint8_t>(xs_a);
  int64_t* feed = ptr<int64_t>(feed_a);
  const uint8_t* blk = r.got + s * nbytes;
  for (int64_t p = p0; p < p1; ++p)
    for (int64_t k = 0; k < K; ++k) {
      int32_t token = -1;
      const int64_t e = r.expert(s, p, k, &token);
      if (e < 0) continue;
      const int64_t i = cur[e]++;
      need(i < rows, "ep_unpack_rows: more entries than the receive rows");
      std::memcpy(rx + i * row_bytes, blk + x_off + p * row_bytes, size_t(row_bytes));
      if (scale_bytes)
        std::memcpy(xs + i * scale_bytes, blk + scales_off + p * scale_bytes,
                    size_t(scale_bytes));
      ptr<int32_t>(src_rank_a)[i] = int32_t(s);
      ptr<int32_t>(src_token_a)[i] = token;
      ptr<int32_t>(src_k_a)[i] = int32_t(k);
      if (nth < Pc) feed[s * Pc + nth] = i;
      ++nth;
    }
}

}  // namespace

void bind_ep_cpu(nb::module_& m) {
  auto nogil = nb::call_guard<nb::gil_scoped_release>();
  m.def("ep_counts", &ep_counts, nogil, "idx_addr"_a, "n"_a, "K"_a, "owner_addr"_a, "E"_a,
        "W"_a, "counts_addr"_a,
        "EP dispatch: int32 [2W] tokens and top-k entries of this rank per destination.");
  m.def("ep_plan", &ep_plan, nogil, "idx_addr"_a, "n"_a, "K"_a, "owner_addr"_a, "E"_a, "W"_a,
        "Pd"_a, "Pc"_a, "pos_addr"_a, "rowtok_addr"_a,
        "EP dispatch: pos and each send block's tokens; returns (entries past Pc, the first "
        "one's owner or -1, that owner's entries).");
  m.def("ep_fill_blocks", &ep_fill_blocks, nogil, "x_addr"_a, "row_bytes"_a, "scales_addr"_a,
        "scale_bytes"_a, "idx_addr"_a, "n"_a, "K"_a, "rowtok_addr"_a, "W"_a, "Pd"_a,
        "nbytes"_a, "idx_off"_a, "scales_off"_a, "x_off"_a, "dst_addr"_a, "stride"_a, "lo"_a,
        "hi"_a, "EP dispatch: bytes [lo, hi) of every send block, at dst + j * stride + lo.");
  m.def("ep_fill_rows", &ep_fill_rows, nogil, "src_addr"_a, "src_rows"_a, "row_bytes"_a,
        "index_addr"_a, "rows"_a, "W"_a, "dst_addr"_a, "stride"_a, "lo"_a, "hi"_a,
        "EP combine: bytes [lo, hi) of every block of gathered rows, at dst + j * stride + lo.");
  m.def("ep_unpack_plan", &ep_unpack_plan, nogil, "got_addr"_a, "W"_a, "nbytes"_a,
        "idx_off"_a, "Pd"_a, "K"_a, "owner_addr"_a, "local_addr"_a, "E"_a, "rank"_a, "El"_a,
        "ll"_a, "cap"_a, "Pc"_a, "counts_addr"_a, "cur_addr"_a, "feed_addr"_a,
        "src_rank_addr"_a, "src_token_addr"_a, "src_k_addr"_a,
        "EP dispatch: int64 [El] received entries per local expert and [W * El] each "
        "source's first out row per expert, from the ids alone; feed 0, low-latency src_* -1.");
  m.def("ep_unpack_rows", &ep_unpack_rows, nogil, "got_addr"_a, "W"_a, "nbytes"_a,
        "idx_off"_a, "scales_off"_a, "x_off"_a, "row_bytes"_a, "scale_bytes"_a, "Pd"_a, "K"_a,
        "owner_addr"_a, "local_addr"_a, "E"_a, "rank"_a, "El"_a, "Pc"_a, "rows"_a, "s"_a,
        "p0"_a, "p1"_a, "cur_addr"_a, "nth_addr"_a, "rx_addr"_a, "xs_addr"_a,
        "src_rank_addr"_a, "src_token_addr"_a, "src_k_addr"_a, "feed_addr"_a,
        "EP dispatch: source s's received rows [p0, p1) to their experts' rows, src_*, feed.");
}

}  // namespace sparkccl
