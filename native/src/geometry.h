// Piece and half arithmetic: defined once in sparkccl/include/sparkccl/protocol.h (shared
// with the kernels); here the pair-returning forms the native layer calls.
// tests/test_native.py compares them with sparkccl/plan/geometry.py over many sizes.
#pragma once
#include <cstdint>
#include <utility>

#include <sparkccl/protocol.h>

namespace sparkccl {
namespace geom {

inline std::pair<uint64_t, uint64_t> piece_bounds(uint64_t slice, int piece, uint64_t granule) {
  const Range r = piece_range(slice, piece, granule);
  return {r.lo, r.hi};
}

inline std::pair<uint64_t, uint64_t> sub_range(uint64_t lo, uint64_t hi, int root, int roots,
                                               int half, int halves) {
  const Range r = part_range(Range{lo, hi}, unsigned(root), unsigned(roots), unsigned(half),
                             unsigned(halves));
  return {r.lo, r.hi};
}

}  // namespace geom
}  // namespace sparkccl
