// Piece and half arithmetic: a copy of sparkccl/plan/geometry.py (the reference).
// tests/test_native.py compares both over many sizes so they cannot drift.
#pragma once
#include <cstdint>
#include <algorithm>
#include <utility>

namespace sparkccl {
namespace geom {

constexpr int PIECES = 8;
constexpr uint64_t ALIGN = 16;
constexpr uint64_t FLAG_STRIDE = 16;

inline uint64_t round_up(uint64_t x, uint64_t m) { return (x + m - 1) / m * m; }

// Bytes per piece: ceil(slice / 8) rounded up to the granule (granule > 0).
inline uint64_t piece_step(uint64_t slice, uint64_t granule) {
  return round_up((slice + PIECES - 1) / PIECES, granule);
}

inline std::pair<uint64_t, uint64_t> piece_bounds(uint64_t slice, int piece, uint64_t granule) {
  uint64_t step = piece_step(slice, granule);
  uint64_t lo = std::min<uint64_t>(slice, uint64_t(piece) * step);
  uint64_t hi = piece == PIECES - 1 ? slice : std::min<uint64_t>(slice, uint64_t(piece + 1) * step);
  return {lo, hi};
}

inline uint64_t split_point(uint64_t lo, uint64_t hi) {
  uint64_t n = hi - lo;
  return lo + std::min<uint64_t>(n, round_up((n + 1) / 2, ALIGN));
}

inline std::pair<uint64_t, uint64_t> sub_range(uint64_t lo, uint64_t hi, int root, int roots,
                                               int half, int halves) {
  if (roots == 2) {
    uint64_t h = split_point(lo, hi);
    if (root == 0) hi = h; else lo = h;
  }
  if (halves == 2) {
    uint64_t h = split_point(lo, hi);
    if (half == 0) hi = h; else lo = h;
  }
  return {lo, hi};
}

inline uint64_t flag_value(uint64_t seq, int piece) { return seq * FLAG_STRIDE + uint64_t(piece) + 1; }

}  // namespace geom
}  // namespace sparkccl
