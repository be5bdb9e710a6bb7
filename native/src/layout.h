// Byte layout of the control segment: a mirror of sparkccl/layout.py.
// _native.layout() returns every constant below; tests/test_native.py checks they agree.
#pragma once
#include <cstdint>

namespace sparkccl {
namespace layout {

constexpr uint64_t PAGE = 4096;

// Control block (byte offsets from the start of the control segment).
constexpr uint64_t CTL_MAGIC = 0;        // u64: CTL_MAGIC_VALUE once initialised
constexpr uint64_t CTL_ABORT = 8;        // u64: 0 while healthy, else an ABORT_* code
constexpr uint64_t CTL_RING_HEAD = 16;   // u64: ring entries claimed by producers
constexpr uint64_t CTL_RING_TAIL = 24;   // u64: ring entries consumed by the proxy
constexpr uint64_t CTL_PID = 32;         // u64: owning process id
constexpr uint64_t CTL_ERROR = 1024;     // char[ERROR_BYTES]: text of the first failure
constexpr uint64_t ERROR_BYTES = 1024;
constexpr uint64_t CTL_BYTES = PAGE;
constexpr uint64_t CTL_MAGIC_VALUE = 0x5350524B43434C31ull;  // "SPRKCCL1"

constexpr uint64_t ABORT_NONE = 0;
constexpr uint64_t ABORT_TIMEOUT = 1;
constexpr uint64_t ABORT_TRANSPORT = 2;
constexpr uint64_t ABORT_PEER = 3;
constexpr uint64_t ABORT_USER = 4;

// Publish ring: RING_ENTRIES entries of RING_ENTRY_BYTES right after the control block.
constexpr uint64_t RING_OFFSET = CTL_BYTES;
constexpr uint64_t RING_ENTRIES = 256;
constexpr uint64_t RING_ENTRY_BYTES = 64;
constexpr uint64_t ENT_TAG = 0;       // u64: index + 1, written last (release)
constexpr uint64_t ENT_SEQ = 8;       // u64
constexpr uint64_t ENT_SLICE = 16;    // u64
constexpr uint64_t ENT_LO = 24;       // u64
constexpr uint64_t ENT_HI = 32;       // u64
constexpr uint64_t ENT_OP = 40;       // u32
constexpr uint64_t ENT_PIECE = 44;    // u32
constexpr uint64_t ENT_CHUNK = 48;    // i32: -1 = every chunk
constexpr uint64_t ENT_GRANULE = 52;  // u32

constexpr uint64_t FLAGS_OFFSET = RING_OFFSET + RING_ENTRIES * RING_ENTRY_BYTES;
constexpr uint64_t FLAG_BYTES = 8;

// Not in layout.py's constants but fixed by the plan model (sparkccl/plan/model.py).
constexpr int NUM_OPS = 2;       // Op.AG, Op.RS
constexpr int NUM_REGIONS = 3;   // Region.AG, RS_SEND, RS_RECV
constexpr int CHANNELS = 2;
constexpr int MAX_ROOTS = 2;

inline uint64_t num_flag_words(int world) {
  return uint64_t(NUM_OPS) * uint64_t(world) * CHANNELS * MAX_ROOTS;
}

}  // namespace layout
}  // namespace sparkccl
