// Byte layout of the control segment: defined once in sparkccl/include/sparkccl/protocol.h
// (shared with the kernels and read by sparkccl/layout.py); here only what the native
// layer adds on top.
#pragma once
#include <cstdint>

#include <sparkccl/protocol.h>

namespace sparkccl {
namespace layout {

// Not in the protocol header but fixed by the plan model (sparkccl/plan/model.py).
constexpr int NUM_OPS = 2;       // Op.AG, Op.RS
constexpr int NUM_REGIONS = 3;   // Region.AG, RS_SEND, RS_RECV
constexpr int CHANNELS = 2;
constexpr int MAX_ROOTS = 2;

inline uint64_t num_flag_words(int world) {
  return uint64_t(NUM_OPS) * uint64_t(world) * CHANNELS * MAX_ROOTS;
}

}  // namespace layout
}  // namespace sparkccl
