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
constexpr int OP_RS = 1;          // Op.RS
constexpr int REGION_RS_SEND = 1;  // Region.RS_SEND: block j = the chunk for rank j
constexpr int REGION_RS_RECV = 2;  // Region.RS_RECV

inline uint64_t num_flag_words(int world) {
  return uint64_t(NUM_OPS) * uint64_t(world) * CHANNELS * MAX_ROOTS;
}
static_assert(NUM_OPS * CHANNELS * MAX_ROOTS == FLAG_WORDS_PER_RANK, "flag words per rank");

// Words after FLAGS_OFFSET: the flag words, then the call words (protocol.h CALL_SLOTS).
inline uint64_t flag_section_words(int world) {
  return num_flag_words(world) + uint64_t(world) * CALL_SLOTS * CALL_ENTRY_WORDS;
}

// The word index (from FLAGS_OFFSET) of source's call entry for seq.
inline uint64_t call_entry_word(int world, int source, uint64_t seq) {
  return num_flag_words(world) + (uint64_t(source) * CALL_SLOTS + seq % CALL_SLOTS) * CALL_ENTRY_WORDS;
}

// The LL area (sparkccl/layout.py ll_area): its byte offset from the flag words (FLAGS_OFFSET),
// page-aligned after the call words, and its size.
inline uint64_t ll_area_from_flags(int world) {
  const uint64_t end = FLAGS_OFFSET + flag_section_words(world) * FLAG_BYTES;
  return (end + PAGE - 1) / PAGE * PAGE - FLAGS_OFFSET;
}
inline uint64_t ll_area_bytes(int world) { return LL_SLOTS * uint64_t(world) * LL_SOURCE_BYTES; }
// Source's block of collective seq within the LL area (slot seq % LL_SLOTS).
inline uint64_t ll_block_offset(uint64_t seq, int source, int world) {
  return (seq % LL_SLOTS * uint64_t(world) + uint64_t(source)) * LL_SOURCE_BYTES;
}

}  // namespace layout
}  // namespace sparkccl
