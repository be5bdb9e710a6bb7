// The one definition of sparkccl's shared byte layout and piece geometry (docs/PROTOCOL.md).
//
// Three readers, one text:
//   * the native layer (native/src/layout.h, geometry.h include this file; CMake puts
//     sparkccl/include on the include path);
//   * the CUDA kernels (sparkccl/dataplane/kernels/common.cuh includes it; nvrtc.py inlines
//     it into the source NVRTC compiles, so its text is part of the kernels' cache key);
//   * Python (sparkccl/layout.py reads every `constexpr` line of this file at import time:
//     the header ships inside the package, so no build step and no native module is needed
//     to know the layout, and `sparkccl plan` stays pure Python).
//
// Rules that keep the Python reader simple: one `constexpr int|pu64 NAME = <expr>;` per line
// (upper-case names, unique across the namespaces below), expressions of integer literals,
// earlier names, + - * << and parentheses; the reader refuses anything else. Everything is
// plain C++17 without library headers, so NVRTC compiles it as it is.
#pragma once

#if defined(__CUDACC__)
#define SCCL_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define SCCL_HOST_DEVICE inline
#endif

// The kargs structs' field offsets are checked where the compiler has __builtin_offsetof:
// the host compilers (the native module, the kernels' emulation). NVRTC 13.0 (the one torch
// cu130 brings) has not; there the sizes alone are checked. Every field is a u64, so a
// struct has one layout on the host and on the device.
#if defined(__CUDACC_RTC__)
#define SCCL_OFFSET_IS(T, field, offset) true
#else
#define SCCL_OFFSET_IS(T, field, offset) (__builtin_offsetof(T, field) == (offset))
#endif

namespace sparkccl {

using pu64 = unsigned long long;

// ---------------------------------------------------------------- control segment layout
namespace layout {

constexpr pu64 PAGE = 4096;

// Control block (byte offsets from the start of the control segment).
constexpr pu64 CTL_MAGIC = 0;        // u64: CTL_MAGIC_VALUE once initialised
constexpr pu64 CTL_ABORT = 8;        // u64: 0 while healthy, else an ABORT_* code
constexpr pu64 CTL_RING_HEAD = 16;   // u64: ring entries claimed by producers (next index;
                                     // a CUDA data plane keeps it in STATE_RING instead)
constexpr pu64 CTL_RING_TAIL = 24;   // u64: ring entries consumed by the proxy
constexpr pu64 CTL_PID = 32;         // u64: owning process id (peers check it is alive)
// GPU failure record, written by a failing wait kernel (the code last).
constexpr pu64 CTL_GPU_STATUS = 40;  // u64: 0, or the ABORT_* code
constexpr pu64 CTL_GPU_DETAIL = 48;  // u64: source << 32 | flag word << 8 | piece
constexpr pu64 CTL_GPU_SEQ = 56;     // u64: seq of the failed wait
// Fail-stop handshake (docs/CONTRACT.md "Failure behaviour"): the host's watchdog sets ACK
// once it printed the failure; in mode GPU_FAIL_STOP the failing kernel waits (bounded) for
// it, then traps. MODE is written by the host before the first launch.
constexpr pu64 CTL_GPU_ACK = 64;     // u64: 0, then ACK_HOLD / ACK_GO (see ACK_WAIT_NS)
constexpr pu64 CTL_GPU_MODE = 72;    // u64: GPU_FAIL_STOP or GPU_FAIL_POISON
// A rank that ends without close() (at exit, or its communicator dropped) first waits until
// its proxy delivered every collective it issued, then writes N + 1 here: N collectives (seq
// 0..N-1), all delivered. A peer whose owner has exited then fails only once it is itself
// at seq N or later (Proxy::watch); 0 while the owner is here.
constexpr pu64 CTL_LEFT = 80;
constexpr pu64 CTL_ERROR = 1024;     // char[ERROR_BYTES]: NUL-terminated text of the first failure
constexpr pu64 ERROR_BYTES = 1024;
constexpr pu64 CTL_BYTES = PAGE;
constexpr pu64 CTL_MAGIC_VALUE = 0x5350524B43434C31ull;  // "SPRKCCL1"

constexpr pu64 ABORT_NONE = 0;
constexpr pu64 ABORT_TIMEOUT = 1;    // a data-plane wait ran past its timeout
constexpr pu64 ABORT_TRANSPORT = 2;  // a write or flag could not be delivered
constexpr pu64 ABORT_PEER = 3;       // a peer died or aborted
constexpr pu64 ABORT_USER = 4;       // close() or an explicit abort

// Publish ring: RING_ENTRIES entries of RING_ENTRY_BYTES right after the control block.
// tag = index + 1 is written last, after a release fence; the proxy consumes entries
// strictly in index order by polling the tag.
constexpr pu64 RING_OFFSET = CTL_BYTES;
constexpr pu64 RING_ENTRIES = 256;
constexpr pu64 RING_ENTRY_BYTES = 64;
constexpr pu64 ENT_TAG = 0;       // u64: index + 1
constexpr pu64 ENT_SEQ = 8;       // u64
constexpr pu64 ENT_SLICE = 16;    // u64: slice bytes (per-rank slice / chunk)
constexpr pu64 ENT_LO = 24;       // u64: piece bounds inside the slice
constexpr pu64 ENT_HI = 32;       // u64
// The call word: the u64 at ENT_OP says what the caller called, so that every peer can
// compare it with its own call before it trusts the bytes (the cross-rank check,
// sparkccl/dataplane/peer_check.py): one byte each of op, dtype, collective and piece, then
// the padding. Little-endian: byte ENT_OP + k of the entry is bits 8k.. of the word
// (call_word below; publishers write the word in one store).
constexpr pu64 ENT_OP = 40;       // u8: Op (what the proxy executes: AG or RS streams)
constexpr pu64 ENT_DTYPE = 41;    // u8: DTYPE_* of the caller's elements
constexpr pu64 ENT_KIND = 42;     // u8: KIND_*: the collective called, with its reduction
constexpr pu64 ENT_PIECE = 43;    // u8: piece (< PIECES)
constexpr pu64 ENT_PAD = 44;      // u32: zero bytes the collective carries past the caller's
                                  // data (S - the caller's bytes per rank; an all-reduce:
                                  // over its W chunks), so the caller's exact bytes cross
constexpr pu64 ENT_CHUNK = 48;    // i32: CHUNK_* below, or j = only chunk j (finalize)
constexpr pu64 ENT_GRANULE = 52;  // u32: piece step granule (16, or row bytes for finalize)
// u64: CLOCK_MONOTONIC ns when the CPU data plane published the entry (the proxy's
// publish -> first post latency); 0 from publishers without the host clock (GPU kernels).
constexpr pu64 ENT_PUBLISH_NS = 56;
constexpr pu64 CALL_DTYPE_SHIFT = 8;   // bit positions in the call word (ENT_OP's u64)
constexpr pu64 CALL_KIND_SHIFT = 16;
constexpr pu64 CALL_PIECE_SHIFT = 24;
constexpr pu64 CALL_PAD_SHIFT = 32;
// DTYPE_*: the caller's element type (torch dtypes, sparkccl/dataplane/peer_check.py);
// 0 from publishers that do not say (the native tests), OTHER for a dtype not listed.
constexpr int DTYPE_UNSAID = 0;
constexpr int DTYPE_F32 = 1;
constexpr int DTYPE_F16 = 2;
constexpr int DTYPE_BF16 = 3;
constexpr int DTYPE_F64 = 4;
constexpr int DTYPE_U8 = 5;
constexpr int DTYPE_I8 = 6;
constexpr int DTYPE_I16 = 7;
constexpr int DTYPE_I32 = 8;
constexpr int DTYPE_I64 = 9;
constexpr int DTYPE_BOOL = 10;
constexpr int DTYPE_F8E4M3 = 11;
constexpr int DTYPE_F8E5M2 = 12;
constexpr int DTYPE_C64 = 13;
constexpr int DTYPE_C128 = 14;
constexpr int DTYPE_U16 = 15;
constexpr int DTYPE_U32 = 16;
constexpr int DTYPE_U64 = 17;
constexpr int DTYPE_OTHER = 255;
// KIND_*: the collective the caller called (a reduction's op is part of it: an all-reduce
// of sums and one of averages must not meet); 0 from publishers that do not say.
constexpr int KIND_UNSAID = 0;
constexpr int KIND_ALL_GATHER = 1;
constexpr int KIND_REDUCE_SCATTER_SUM = 2;
constexpr int KIND_ALL_REDUCE_SUM = 3;
constexpr int KIND_ALL_REDUCE_AVG = 4;
constexpr int KIND_MOE_FINALIZE = 5;
constexpr int KIND_ALL_TO_ALL = 6;  // the reduce-scatter's wire, each source's block copied out
// An all-to-all whose chunks say their own length (geom::sized_bytes): only those bytes are
// published, posted and copied out.
constexpr int KIND_ALL_TO_ALL_SIZED = 7;
constexpr int CHUNK_ALL = -1;     // every chunk of the piece: the proxy sends it
constexpr int CHUNK_DIRECT = -2;  // the data plane sent the piece's publish streams itself
// The data plane wrote the collective's vector as LL lines into its own LL area (block of
// this rank, slot seq % LL_SLOTS; every piece's entry says so): the proxy posts the lines
// to each peer's LL area (Transport::put_lines) once it sees every line's flag, then the
// piece's flag as usual (docs/PROTOCOL.md "One shot, LL, through the proxy").
constexpr int CHUNK_LL = -3;
// Every chunk of pieces 0..piece at once (the proxy sends them, as CHUNK_ALL): one entry, at
// piece 0's ring index, that stands for the piece + 1 indices of those pieces (the proxy's
// tail moves past all of them). A slice handed off once (ONE_HANDOFF_SLICE, the proxy path)
// costs the GPU one entry's stores and the proxy one entry's reads, not eight.
constexpr int CHUNK_WHOLE = -4;

constexpr pu64 FLAGS_OFFSET = RING_OFFSET + RING_ENTRIES * RING_ENTRY_BYTES;
constexpr pu64 FLAG_BYTES = 8;
// Call words (docs/PROTOCOL.md "Call words"): right after the flag words (FLAG_WORDS_PER_RANK
// per rank of the world), per source rank s and seq slot seq % CALL_SLOTS, one entry of
// CALL_ENTRY_WORDS u64 that s's proxy writes here before the first flag of that seq on its
// connection to this rank: CALL_TAGGED = s's call word with the tag in its op and piece
// bytes, CALL_SLICE = its slice bytes | the tag << CALL_SLICE_TAG_SHIFT; the tag is seq + 1's
// low 16 bits (never 0 in a slot's first lap: zeroed memory is no entry). Each word carries
// the tag, so a word is trusted alone (no torn pair across two seqs). Words CALL_SIZED ..,
// written only for a sized all-to-all (KIND_ALL_TO_ALL_SIZED) on a plan with relays: the
// lengths of s's chunks, which the proxies that relay its parts cut them at
// (docs/PROTOCOL.md "Sized blocks"): chunk j's geom::sized_bytes in 16-byte units (rounded
// up) in word CALL_SIZED + j / 2, bits CALL_LEN_BITS * (j % 2) up, CALL_LEN_UNKNOWN where
// s's proxy did not read it (GPU-direct data, chunks from CALL_SIZED_CHUNKS on, lengths past
// the field: relays then forward the part whole), the tag above bit CALL_SLICE_TAG_SHIFT as
// in CALL_SLICE.
constexpr pu64 FLAG_WORDS_PER_RANK = 8;  // NUM_OPS * CHANNELS * MAX_ROOTS (native/src/layout.h)
constexpr pu64 CALL_SLOTS = 32;
constexpr pu64 CALL_TAGGED = 0;
constexpr pu64 CALL_SLICE = 1;
constexpr pu64 CALL_SIZED = 2;
constexpr pu64 CALL_SIZED_CHUNKS = 8;  // the plans' largest world
constexpr pu64 CALL_ENTRY_WORDS = 6;  // CALL_SIZED + CALL_SIZED_CHUNKS / 2
constexpr pu64 CALL_LEN_BITS = 24;
constexpr pu64 CALL_LEN_UNKNOWN = 0xFFFFFF;  // (1 << CALL_LEN_BITS) - 1
constexpr pu64 CALL_TAG_MASK = 0xFFFF;
constexpr pu64 CALL_SLICE_TAG_SHIFT = 48;

// The low-latency (LL) area of the control segment (docs/PROTOCOL.md "One shot, LL"): page-
// aligned after the call words, LL_SLOTS slots (seq % LL_SLOTS) of one LL_SOURCE_BYTES block
// per source rank, which that source's GPU writes directly (GPU-direct peers), or which its
// proxy copies there from the source's own block (the proxy path: CHUNK_LL). Each
// 16-byte line is two 8-byte halves {4 data bytes, the flag (u32)(seq + 1)}, each written
// at once, so a reader that sees a half's flag has its data: no fence, no separate flag.
// A source's vector of L bytes takes 2 L bytes of lines. The way is taken while L x (world - 1)
// <= LL_MAX_BYTES (what a reader polls across PCIe each round): measured on an H200 under MPS,
// LL beat the flag words at 8 KiB x 1 (13.7 vs 16.7 us) and lost at 16 KiB x 1 and 8 KiB x 3
// (benchmarks/decode_latency_h200.txt).
constexpr pu64 LL_SLOTS = 3;
constexpr pu64 LL_SOURCE_BYTES = 16 << 10;
constexpr pu64 LL_MAX_BYTES = 8 << 10;  // LL_SOURCE_BYTES / 2

static_assert(2 * LL_MAX_BYTES == LL_SOURCE_BYTES, "an LL line carries half its bytes");
static_assert(CTL_GPU_DETAIL == CTL_GPU_STATUS + 8 && CTL_GPU_SEQ == CTL_GPU_STATUS + 16,
              "the wait kernels write the GPU record as status[0..2]");
static_assert(CTL_GPU_ACK == CTL_GPU_STATUS + 24 && CTL_GPU_MODE == CTL_GPU_STATUS + 32,
              "the wait kernels read the handshake as status[3] (ack) and status[4] (mode)");
static_assert(CTL_PID + 8 <= CTL_GPU_STATUS && CTL_GPU_MODE + 8 <= CTL_LEFT &&
                  CTL_LEFT + 8 <= CTL_ERROR,
              "control block words overlap");
static_assert(CTL_ERROR + ERROR_BYTES <= CTL_BYTES, "the error text must fit the control block");
static_assert(RING_OFFSET % PAGE == 0 && FLAGS_OFFSET % PAGE == 0, "page-aligned sections");
static_assert(ENT_GRANULE + 4 <= ENT_PUBLISH_NS && ENT_PUBLISH_NS + 8 <= RING_ENTRY_BYTES,
              "ring entry fields must fit one entry");
static_assert(ENT_TAG % 8 == 0 && ENT_SEQ % 8 == 0 && ENT_SLICE % 8 == 0 && ENT_LO % 8 == 0 &&
              ENT_HI % 8 == 0 && ENT_PAD % 4 == 0 && ENT_CHUNK % 4 == 0 &&
              ENT_GRANULE % 4 == 0 && ENT_PUBLISH_NS % 8 == 0,
              "ring entry fields are naturally aligned");
static_assert((RING_ENTRIES & (RING_ENTRIES - 1)) == 0, "ring indices wrap by modulo");
static_assert(ENT_OP % 8 == 0 && ENT_DTYPE == ENT_OP + CALL_DTYPE_SHIFT / 8 &&
                  ENT_KIND == ENT_OP + CALL_KIND_SHIFT / 8 &&
                  ENT_PIECE == ENT_OP + CALL_PIECE_SHIFT / 8 &&
                  ENT_PAD == ENT_OP + CALL_PAD_SHIFT / 8 && ENT_PAD + 4 == ENT_CHUNK,
              "the call word is the u64 at ENT_OP: op, dtype, kind, piece bytes, then the u32 pad");

// The call word of a publish entry, piece 0 (a publisher ORs in piece << CALL_PIECE_SHIFT).
SCCL_HOST_DEVICE constexpr pu64 call_word(pu64 op, pu64 dtype, pu64 kind, pu64 pad) {
  return op | dtype << CALL_DTYPE_SHIFT | kind << CALL_KIND_SHIFT | pad << CALL_PAD_SHIFT;
}
static_assert(call_word(1, DTYPE_BF16, KIND_ALL_REDUCE_AVG, 20) == 0x1400040301ull,
              "call word packing");
static_assert(CALL_TAGGED < CALL_SIZED && CALL_SLICE < CALL_SIZED &&
                  CALL_ENTRY_WORDS == CALL_SIZED + CALL_SIZED_CHUNKS / 2 &&
                  CALL_LEN_UNKNOWN == (pu64(1) << CALL_LEN_BITS) - 1 &&
                  2 * CALL_LEN_BITS <= CALL_SLICE_TAG_SHIFT &&
                  (CALL_SLOTS & (CALL_SLOTS - 1)) == 0 && CALL_SLOTS <= CALL_TAG_MASK,
              "call entries: the call and slice words, then two lengths a word below the tag; "
              "slots wrap by modulo within the tag");

// A call entry's first two words (see CALL_SLOTS): seq's tag in the call word's op and
// piece bytes (the bytes every rank's calls may differ in), and above the slice's 48 bits.
SCCL_HOST_DEVICE constexpr pu64 call_tag(pu64 seq) { return (seq + 1) & CALL_TAG_MASK; }
SCCL_HOST_DEVICE constexpr pu64 call_tagged(pu64 call, pu64 seq) {
  return (call & ~(pu64(0xFF) | pu64(0xFF) << CALL_PIECE_SHIFT)) | (call_tag(seq) & 0xFF) |
         (call_tag(seq) >> 8) << CALL_PIECE_SHIFT;
}
SCCL_HOST_DEVICE constexpr pu64 call_slice(pu64 slice, pu64 seq) {
  return (slice & ((pu64(1) << CALL_SLICE_TAG_SHIFT) - 1)) | call_tag(seq) << CALL_SLICE_TAG_SHIFT;
}
static_assert(call_tagged(0x1400040301ull | 5ull << CALL_PIECE_SHIFT, 0x1233) == 0x1412040334ull &&
                  call_slice(48, 0x11233) == (0x1234ull << 48 | 48),
              "call entry tags");

}  // namespace layout

// ---------------------------------------------------------------- piece geometry
// Python twin (reference, with the same names): sparkccl/plan/geometry.py; tests compare
// both over many sizes.
namespace geom {

constexpr int PIECES = 8;         // each collective's slice is cut into this many pieces
constexpr pu64 ALIGN = 16;        // piece boundaries and half splits fall on multiples of it
constexpr pu64 FLAG_STRIDE = 16;  // flag value for (seq, piece c) is seq * FLAG_STRIDE + c + 1

static_assert(PIECES < FLAG_STRIDE, "a flag value must say its piece");

struct Range {
  pu64 lo, hi;
};

SCCL_HOST_DEVICE constexpr pu64 round_up(pu64 x, pu64 m) { return (x + m - 1) / m * m; }

// Bytes per piece: ceil(slice / PIECES) rounded up to the granule (16, or a row for finalize).
SCCL_HOST_DEVICE constexpr pu64 piece_step(pu64 slice, pu64 granule) {
  return round_up((slice + PIECES - 1) / PIECES, granule);
}

// Byte range [lo, hi) of piece `piece` within one slice.
SCCL_HOST_DEVICE constexpr Range piece_range(pu64 slice, int piece, pu64 granule) {
  const pu64 step = piece_step(slice, granule);
  const pu64 lo = piece * step;
  const pu64 hi = (pu64)(piece + 1) * step;
  return Range{lo < slice ? lo : slice, piece == PIECES - 1 ? slice : (hi < slice ? hi : slice)};
}

// Two roots pipeline a piece over two flag words (docs/PROTOCOL.md "Geometry"); a small
// piece split between them only costs more: each root's stream posts its halves of the
// eight pieces as as many small writes (not contiguous, so not one), and the reader waits for
// two flags. Pieces of at most this many bytes (slices up to 32 KiB) go whole on root 0
// (part_range). On the H200's proxy path an 8 KiB all-reduce at world 2 took 16.8-17.0 us
// split, 15.7-16.6 us so, and 13.4-14.2 us with one root (benchmarks/decode_latency_h200.txt
// section 11).
constexpr pu64 ROOT_SPLIT_MIN = 4096;

// Where [lo, hi) splits in two: at len/2 rounded up to ALIGN, clamped to the range.
SCCL_HOST_DEVICE constexpr pu64 split_point(pu64 lo, pu64 hi) {
  const pu64 n = hi - lo;
  const pu64 h = round_up((n + 1) / 2, ALIGN);
  return lo + (n < h ? n : h);
}

// The sub-range of a piece an item carries: first split between roots (root of roots),
// then that share between travel directions (half of halves); a count of 1: no split.
// A piece of at most ROOT_SPLIT_MIN bytes is not split between roots: root 0 carries it
// whole (below; root1_idle).
SCCL_HOST_DEVICE constexpr Range part_range(Range r, unsigned root, unsigned roots, unsigned half,
                                       unsigned halves) {
  if (roots == 2) {
    const pu64 h = r.hi - r.lo <= ROOT_SPLIT_MIN ? r.hi : split_point(r.lo, r.hi);
    if (root == 0) r.hi = h; else r.lo = h;
  }
  if (halves == 2) {
    const pu64 h = split_point(r.lo, r.hi);
    if (half == 0) r.hi = h; else r.lo = h;
  }
  return r;
}

// A collective whose slice's pieces all go whole on root 0 (piece 0, the largest, is at most
// ROOT_SPLIT_MIN bytes: a slice of at most 32 KiB at granule ALIGN) leaves root 1 idle: its
// streams send nothing for it, no call entry and no flag, and no reader waits for its flag
// words (docs/PROTOCOL.md "Geometry"). A flag alone on root 1 still cost the proxy path's
// 8 KiB all-reduce 2.2 us on the H200 (15.7-16.2 us against 13.7-14.0 us without it,
// benchmarks/decode_latency_h200.txt section 12). Every writer and reader decides it from
// the same (slice, granule) as its piece geometry.
SCCL_HOST_DEVICE constexpr bool root1_idle(pu64 slice, pu64 granule) {
  return piece_range(slice, 0, granule).hi <= ROOT_SPLIT_MIN;
}
// The root whose stream writes flag word `word` (flag_word: the root is its lowest digit).
SCCL_HOST_DEVICE constexpr unsigned flag_word_root(pu64 word) { return (unsigned)(word % 2); }

// KIND_ALL_TO_ALL_SIZED: the bytes of a chunk of L bytes that carry data, from its first 8
// bytes h (little-endian, counting themselves): h rounded up to ALIGN, at least ALIGN, at
// most L. Every clip (the publish copy, the proxy's writes, the copy-out) cuts a part's
// range at this instead of at L, so the bytes past it never travel.
SCCL_HOST_DEVICE constexpr pu64 sized_bytes(pu64 h, pu64 L) {
  if (h >= L) return L;  // (also keeps the rounding below from wrapping)
  const pu64 n = round_up(h < 8 ? 8 : h, ALIGN);
  return n < L ? n : L;
}

SCCL_HOST_DEVICE constexpr pu64 flag_value(pu64 seq, int piece) {
  return seq * FLAG_STRIDE + (pu64)piece + 1;
}

static_assert(piece_range(100, 6, ALIGN).lo == 96 && piece_range(100, 7, ALIGN).lo == 100,
              "piece geometry");
static_assert(split_point(0, 48) == 32 && split_point(16, 20) == 20, "split geometry");
static_assert(part_range(Range{64, 64 + ROOT_SPLIT_MIN}, 0, 2, 0, 1).hi == 64 + ROOT_SPLIT_MIN &&
                  part_range(Range{64, 64 + ROOT_SPLIT_MIN}, 1, 2, 0, 1).lo ==
                      64 + ROOT_SPLIT_MIN &&
                  part_range(Range{0, ROOT_SPLIT_MIN + 16}, 1, 2, 0, 1).lo ==
                      ROOT_SPLIT_MIN / 2 + 16,
              "root split geometry");
static_assert(root1_idle(8 * ROOT_SPLIT_MIN, ALIGN) && !root1_idle(8 * ROOT_SPLIT_MIN + 1, ALIGN) &&
                  !root1_idle(8 * 14336, 14336) && root1_idle(0, ALIGN),
              "idle root geometry");
static_assert(sized_bytes(0, 100) == 16 && sized_bytes(17, 100) == 32 && sized_bytes(99, 100) == 100 &&
                  sized_bytes(~0ull, 100) == 100 && sized_bytes(8, 5) == 5,
              "sized all-to-all geometry");

}  // namespace geom

// ---------------------------------------------------------------- CUDA data plane ABI
// Values the host code (sparkccl/dataplane/cuda*.py) and the kernels must agree on.
namespace gpu {

// Progress word = seq * PROG_STRIDE + unit; FAILED: the wait failed, every block exits.
constexpr pu64 PROG_STRIDE = 65536;
constexpr pu64 FAILED = PROG_STRIDE - 1;
constexpr pu64 NO_WORD = 0xFFFF;        // GPU record: no flag word
constexpr pu64 NO_SOURCE = 0xFFFFFFFF;  // GPU record: no source
constexpr int COUNTER_SETS = 4;         // publish counters are indexed by seq % COUNTER_SETS
constexpr int MAX_DIRECT = 32;          // GPU-executed streams per op (direct table)
constexpr int DT_STREAM = 4;            // u64 per stream row of the direct table
constexpr int DT_ITEM = 6;              // u64 per item row of the direct table
// The direct table's rows (kernels/direct.cu; built by sparkccl/dataplane/direct_tables.py):
// a stream row: its flag word at the peer (device pointer), its first item, its items;
constexpr int DT_FLAG = 0;
constexpr int DT_FIRST = 1;
constexpr int DT_ITEMS = 2;
// an item row: source chunk, the peer region's base (device pointer), slot stride, slots,
// destination block, the part of each piece it carries (PART_*).
constexpr int DT_CHUNK = 0;
constexpr int DT_BASE = 1;
constexpr int DT_STRIDE = 2;
constexpr int DT_SLOTS = 3;
constexpr int DT_BLOCK = 4;
constexpr int DT_PART = 5;
static_assert(DT_ITEMS < DT_STREAM && DT_PART < DT_ITEM, "direct table rows");
constexpr int FIN_CLAIM = 256;          // finalize: item counters per set, then the claim counter
constexpr int FIN_SET = FIN_CLAIM + 4;  // finalize counters per set
// Slices of at most this many bytes go in one hand-off: the GPU-direct publish writes every
// piece, then the flags and ring entries of all of them behind one system fence, and the
// wait roles wait for the last unit and move (or sum) the whole slice at once. Each
// hand-off of a piece is a chain of waits for host memory (0.6-1.4 us each on an H200,
// benchmarks/sysmem_sync.cu), which costs more than pipelining small pieces saves.
constexpr pu64 ONE_HANDOFF_SLICE = 512 << 10;
// What a failed wait does (CTL_GPU_MODE): STOP reports, then traps (the context is lost, so
// every later synchronization raises); POISON sets every output of the failed collective
// and of the ones queued after it to POISON_BYTE (NaN in every floating type).
constexpr pu64 GPU_FAIL_STOP = 0;
constexpr pu64 GPU_FAIL_POISON = 1;
constexpr pu64 POISON_BYTE = 0xFF;
// STOP: the kernel waits ACK_WAIT_NS for the host's ack, then traps. The watchdog writes
// ACK_HOLD once it printed the report: the kernel then waits up to HOLD_WAIT_NS (from the
// start of its wait) for ACK_GO, which the watchdog writes once it holds the GPU's trap lock
// (sparkccl/dataplane/trap_lock.py): processes time-slicing one GPU trap one at a time, as
// two traps at once can leave the driver wedged. Any other nonzero ack is GO.
constexpr pu64 ACK_WAIT_NS = 1500000000;
constexpr pu64 ACK_GO = 1;
constexpr pu64 ACK_HOLD = 2;
constexpr pu64 HOLD_WAIT_NS = 30000000000ull;
// Device state of a CUDA data plane (u64 words in device memory). The collective's seq and
// first publish-ring index live here, not in kernel arguments, so a captured CUDA graph
// replays with fresh values: every kernel of a collective reads them, and the last block of
// the collective's last kernel (or sccl_advance, queued last in modes split and ce) moves
// them on (stream order makes that a ticket; docs/PROTOCOL.md "Sequence state").
constexpr int STATE_PROGRESS = 0;  // progress word (see PROG_STRIDE)
constexpr int STATE_DEAD = 1;      // 1 once any wait of this data plane failed
constexpr int STATE_SEQ = 2;       // the next (or running) collective's seq
constexpr int STATE_RING = 3;      // its first publish-ring index
constexpr int STATE_GATE = 4;      // finalize gate bumps of every launch so far
constexpr int STATE_TIMEOUT = 5;   // the waits' timeout in ns (set once)
constexpr int STATE_EXITS = 6;     // blocks of the running last kernel that finished
constexpr int STATE_CLOCK = 7;     // CLOCK_MONOTONIC - %globaltimer (ns, mod 2^64): ring
                                   // entries carry publish stamps; 0: none (SPARKCCL_GPU_STAMPS)
constexpr int STATE_TAIL = 8;      // a ring tail the GPU read before: the proxy's tail only
                                   // grows, so it bounds the room without a read across PCIe
constexpr int STATE_TIMELINE = 9;  // device pointer to TL_CALLS x TL_POINTS u64 stamps, or 0:
                                   // kernels built with SCCL_TIMELINE stamp their steps there
                                   // (SPARKCCL_GPU_TIMELINE, dataplane/timeline.py)
constexpr int STATE_WORDS = 10;
// The timeline (a measurement aid, compiled in only with SCCL_TIMELINE): per collective seq,
// row seq % TL_CALLS of TL_POINTS %globaltimer stamps, each written by one thread when the
// step happens (the last writer wins where several blocks pass a step).
constexpr int TL_CALLS = 64;
constexpr int TL_POINTS = 8;
constexpr int TL_ENTER = 0;     // block 0 read the collective's seq
constexpr int TL_WRITTEN = 1;   // the last publish block's data is written and fenced
constexpr int TL_HANDED = 2;    // flags (GPU-direct) or ring entries (proxy path) stored
constexpr int TL_SEEN = 3;      // the poller saw every source's flag of the last piece
constexpr int TL_RELEASED = 4;  // consumer block 0 passed its wait for the last piece
constexpr int TL_SUMMED = 5;    // consumer block 0 finished its share of the result
constexpr int TL_EXIT = 6;      // the launch's last block is done (it advances the state)
constexpr int TL_STORED = 7;    // a publish block's stores issued, before its fence (the last)
// A slotted pointer argument: slot seq % slots of a region is base + (seq % slots) * stride;
// the kernel gets base and the code slots << SLOT_SHIFT | stride (code 0: not slotted).
constexpr int SLOT_SHIFT = 56;
static_assert(FAILED < PROG_STRIDE, "a failure is not a unit");

}  // namespace gpu

// ---------------------------------------------------------------- CUDA kernel arguments
// The kernels' argument structs, declared here once: the host
// (sparkccl/layout.py pack_struct) writes each field at its constant offset, and the
// static_asserts tie the offsets to the struct the kernels compile. Two kinds:
// * a block in device memory, written once (WaitParams): constants of the plane;
// * a struct passed by value as the kernel's one parameter (AllReduceArgs,
//   FusedAllReduceArgs, PublishArgs, ProxyArgs, FinalizeArgs, FinalizeDirectArgs,
//   WaitRoleArgs, DirectArgs, SumUnitArgs):
//   it carries the call's own pointers. Every field is a u64, so the struct's bytes are
//   the u64 words the host packs; the native LaunchPlan (native/src/cuda_ops.cpp) keeps
//   them as the launch's parameter buffer and patches a call's pointer at the field's byte
//   offset. Mode ce's OpProgram launches them the same way: its parameter words are
//   contiguous and the launch's first parameter pointer is the first word's, which is all
//   the driver reads for a kernel of one parameter (so a struct's first field is the word
//   the program sets per launch: DirectArgs src, WaitRoleArgs in, SumUnitArgs unit). Why
//   by value: the driver copies a launch's parameters when it is enqueued, so a plan-cache
//   hit costs the patch of a few words in host memory and one cuLaunchKernel, as
//   positional parameters did, and a CUDA graph's kernel node keeps its own copy (each
//   replay launches exactly what was captured). A block in device or pinned memory would
//   cost every call a copy ordered before the launch (or a ring of blocks, one per call in
//   flight), and a captured graph would read whatever the latest eager call left there.
// Every collective's kernel takes one of these. The small utility kernels keep five
// positional parameters or fewer (sccl_poison, sccl_advance, sccl_piece_bounds,
// sccl_clock_probe; sccl_wait_piece and sccl_fail_guard: WAIT_PARAMS): a struct is there so
// that no long list of parameters is copied by hand between a kernel, its launches and the
// emulation, and theirs are too short to drift.
namespace kargs {

// The wait role's constants, one block per data plane and op (AG, RS), in device memory,
// written once at creation. Every kernel with a wait role takes `const WaitParams* wp`
// (kernels/wait.cu WAIT_PARAMS, or its struct's wp field: WAIT_PARAMS_OF) and reads it once
// per block, plus the two values that differ per launch (adv_entries, adv_gate:
// last_block_advances).
// A pointer rather than the struct by value: the block never changes while the plane lives,
// so a CUDA graph's kernel nodes replay it as they are, and every launch passes one 8-byte
// parameter instead of 80 bytes that the native LaunchPlan, mode ce's OpProgram and the
// emulation would copy per call (they pass u64 parameters); it costs one L2-cached load per
// block at its start.
struct WaitParams {
  pu64 flags;       // the flag words (device pointer of the pinned control segment's)
  pu64 abort_w;     // the abort word
  pu64 status;      // the GPU failure record (CTL_GPU_STATUS ..)
  pu64 waits;       // int32 wait table of the op: flag words per (source, k)
  pu64 parts;       // int32 part table of the op: the part of a piece each word carries
  pu64 maxw;        // wait words per source
  pu64 state;       // the device state (STATE_*)
  pu64 rank, world;
  pu64 timeout_ns;  // the waits' timeout on the GPU clock
};
constexpr pu64 WP_FLAGS = 0;
constexpr pu64 WP_ABORT_W = 8;
constexpr pu64 WP_STATUS = 16;
constexpr pu64 WP_WAITS = 24;
constexpr pu64 WP_PARTS = 32;
constexpr pu64 WP_MAXW = 40;
constexpr pu64 WP_STATE = 48;
constexpr pu64 WP_RANK = 56;
constexpr pu64 WP_WORLD = 64;
constexpr pu64 WP_TIMEOUT_NS = 72;
constexpr pu64 WP_BYTES = 80;
static_assert(SCCL_OFFSET_IS(WaitParams, flags, WP_FLAGS) &&
                  SCCL_OFFSET_IS(WaitParams, abort_w, WP_ABORT_W) &&
                  SCCL_OFFSET_IS(WaitParams, status, WP_STATUS) &&
                  SCCL_OFFSET_IS(WaitParams, waits, WP_WAITS) &&
                  SCCL_OFFSET_IS(WaitParams, parts, WP_PARTS) &&
                  SCCL_OFFSET_IS(WaitParams, maxw, WP_MAXW) &&
                  SCCL_OFFSET_IS(WaitParams, state, WP_STATE) &&
                  SCCL_OFFSET_IS(WaitParams, rank, WP_RANK) &&
                  SCCL_OFFSET_IS(WaitParams, world, WP_WORLD) &&
                  SCCL_OFFSET_IS(WaitParams, timeout_ns, WP_TIMEOUT_NS) &&
                  sizeof(WaitParams) == WP_BYTES,
              "WaitParams offsets (sparkccl/layout.py pack_struct writes them)");


// The one-shot all-reduce's arguments (sccl_allreduce_*, kernels/allreduce.cu; the CUDA data
// plane's one-shot regime, docs/PROTOCOL.md "One shot on CUDA"), in ONE struct passed by
// value: every field a u64, so the host packs it as words (sparkccl/dataplane/
// allreduce_engine.py, layout.pack_struct "AR") and a launch plan's parameter words are the
// struct's bytes (its call pointers, src and dst, patched there like any parameter). Its
// wait role takes the plane's AG WaitParams block like every kernel with a wait role.
// Pointers are device addresses (pinned host memory mapped for the device where the
// comment says "mapped").
struct AllReduceArgs {
  pu64 src;        // this rank's vector (device, L bytes)
  pu64 dst;        // the result (device, L bytes; may be src: see gate)
  pu64 L;          // bytes per rank
  pu64 S;          // L rounded up to ALIGN: the all-gather slice
  pu64 avg;        // 1: divide the fp32 sum once by world (AVG)
  pu64 slot;       // AG slot 0 (mapped) ...
  pu64 slot_code;  // ... and its code (slot seq % slots: common.cuh slot_at)
  pu64 dtab;       // GPU-direct: the AG direct table (direct.cu); 0: the proxy path
  pu64 ring;       // this rank's publish ring (mapped)
  pu64 call;       // the ring entries' call word (layout::call_word: op AG, the caller's
                   // dtype, KIND_ALL_REDUCE_SUM / _AVG, the padding)
  pu64 counters;   // hand-off / piece counters (u32, COUNTER_SETS sets of PIECES)
  pu64 npub;       // publish blocks (proxy path: PIECES * blocks per piece)
  pu64 gate;       // in place (dst overlaps src): u32 gate[PIECES] the publish blocks bump
                   // once read of src is done (the finalize's gate words); 0: no gate
  pu64 wp;         // the plane's AG WaitParams (device)
  pu64 ll;         // LL: u64[world] the ranks' LL areas (mapped; this rank's own at its
                   // index); 0: not LL (kernels/allreduce.cu allreduce_ll)
  pu64 ll_proxy;   // LL through the proxy: 1: the lines go into this rank's own block (the
                   // only area ll gives), for the proxy to post (CHUNK_LL); 0: GPU-direct
};
constexpr pu64 AR_SRC = 0;
constexpr pu64 AR_DST = 8;
constexpr pu64 AR_L = 16;
constexpr pu64 AR_S = 24;
constexpr pu64 AR_AVG = 32;
constexpr pu64 AR_SLOT = 40;
constexpr pu64 AR_SLOT_CODE = 48;
constexpr pu64 AR_DTAB = 56;
constexpr pu64 AR_RING = 64;
constexpr pu64 AR_CALL = 72;
constexpr pu64 AR_COUNTERS = 80;
constexpr pu64 AR_NPUB = 88;
constexpr pu64 AR_GATE = 96;
constexpr pu64 AR_WP = 104;
constexpr pu64 AR_LL = 112;
constexpr pu64 AR_LL_PROXY = 120;
constexpr pu64 AR_BYTES = 128;
static_assert(SCCL_OFFSET_IS(AllReduceArgs, src, AR_SRC) &&
                  SCCL_OFFSET_IS(AllReduceArgs, dst, AR_DST) &&
                  SCCL_OFFSET_IS(AllReduceArgs, L, AR_L) &&
                  SCCL_OFFSET_IS(AllReduceArgs, S, AR_S) &&
                  SCCL_OFFSET_IS(AllReduceArgs, avg, AR_AVG) &&
                  SCCL_OFFSET_IS(AllReduceArgs, slot, AR_SLOT) &&
                  SCCL_OFFSET_IS(AllReduceArgs, slot_code, AR_SLOT_CODE) &&
                  SCCL_OFFSET_IS(AllReduceArgs, dtab, AR_DTAB) &&
                  SCCL_OFFSET_IS(AllReduceArgs, ring, AR_RING) &&
                  SCCL_OFFSET_IS(AllReduceArgs, call, AR_CALL) &&
                  SCCL_OFFSET_IS(AllReduceArgs, counters, AR_COUNTERS) &&
                  SCCL_OFFSET_IS(AllReduceArgs, npub, AR_NPUB) &&
                  SCCL_OFFSET_IS(AllReduceArgs, gate, AR_GATE) &&
                  SCCL_OFFSET_IS(AllReduceArgs, wp, AR_WP) &&
                  SCCL_OFFSET_IS(AllReduceArgs, ll, AR_LL) &&
                  SCCL_OFFSET_IS(AllReduceArgs, ll_proxy, AR_LL_PROXY) &&
                  sizeof(AllReduceArgs) == AR_BYTES,
              "AllReduceArgs offsets (sparkccl/layout.py pack_struct writes them)");

// The two-step all-reduce as one operation (sccl_ar_fused_*, kernels/allreduce_fused.cu;
// docs/PROTOCOL.md "All-reduce", "Two steps fused on CUDA"), GPU-direct or the proxy path:
// one struct by value, as AllReduceArgs (sparkccl/dataplane/allreduce_engine.py
// TwoStepEngine, layout.pack_struct "FAR"; src and dst are the call's pointers). Its
// reduce-scatter part takes the plane's RS WaitParams block and its all-gather part the AG
// one.
struct FusedAllReduceArgs {
  pu64 src;          // chunk 0 of the input at the collective's offset (device; chunk j at
                     // src + j * src_stride), or 0: the chunks lie in RS send slot seq % 2
  pu64 src_stride;
  pu64 dst;          // chunk 0 of the result at the collective's offset (device; may be src)
  pu64 dst_stride;
  pu64 L;            // bytes of each chunk this collective moves
  pu64 S;            // the slice: L rounded up to ALIGN (the same for both parts)
  pu64 avg;          // 1: divide the fp32 sum once by world (AVG)
  pu64 send, send_code;  // RS send slot 0 (mapped) and its code (common.cuh slot_at)
  pu64 recv, recv_code;  // RS receive slot 0 (mapped) and its code
  pu64 ag, ag_code;      // AG slot 0 (mapped) and its code
  pu64 ring;         // this rank's publish ring (mapped)
  pu64 rs_call;      // the RS entries' call word (op RS, the caller's dtype,
                     // KIND_ALL_REDUCE_SUM / _AVG, the padding) ...
  pu64 ag_call;      // ... and the AG entries' (the same but the op)
  pu64 counters;     // the RS publish's piece counters (u32, COUNTER_SETS sets of PIECES;
                     // GPU-direct: the plane's hand-off counters, direct.cu direct_publish)
  pu64 ag_counters;  // the AG hand-offs' (the consumers'), the same shape
  pu64 npub;         // publish blocks (proxy path: 1 for a zero-copy input, else PIECES *
                     // blocks per piece or, a slice of at most ONE_HANDOFF_SLICE, any number)
  pu64 rs_dtab;      // GPU-direct: the RS and AG direct tables (direct.cu): the chunks and the
  pu64 ag_dtab;      // rounded pieces go straight into the peers' slots; 0, 0: the proxy path
  pu64 wp_rs;        // the plane's RS WaitParams (device)
  pu64 wp_ag;        // the plane's AG WaitParams (device)
};
constexpr pu64 FAR_SRC = 0;
constexpr pu64 FAR_SRC_STRIDE = 8;
constexpr pu64 FAR_DST = 16;
constexpr pu64 FAR_DST_STRIDE = 24;
constexpr pu64 FAR_L = 32;
constexpr pu64 FAR_S = 40;
constexpr pu64 FAR_AVG = 48;
constexpr pu64 FAR_SEND = 56;
constexpr pu64 FAR_SEND_CODE = 64;
constexpr pu64 FAR_RECV = 72;
constexpr pu64 FAR_RECV_CODE = 80;
constexpr pu64 FAR_AG = 88;
constexpr pu64 FAR_AG_CODE = 96;
constexpr pu64 FAR_RING = 104;
constexpr pu64 FAR_RS_CALL = 112;
constexpr pu64 FAR_AG_CALL = 120;
constexpr pu64 FAR_COUNTERS = 128;
constexpr pu64 FAR_AG_COUNTERS = 136;
constexpr pu64 FAR_NPUB = 144;
constexpr pu64 FAR_RS_DTAB = 152;
constexpr pu64 FAR_AG_DTAB = 160;
constexpr pu64 FAR_WP_RS = 168;
constexpr pu64 FAR_WP_AG = 176;
constexpr pu64 FAR_BYTES = 184;
static_assert(SCCL_OFFSET_IS(FusedAllReduceArgs, src, FAR_SRC) &&
                  SCCL_OFFSET_IS(FusedAllReduceArgs, src_stride, FAR_SRC_STRIDE) &&
                  SCCL_OFFSET_IS(FusedAllReduceArgs, dst, FAR_DST) &&
                  SCCL_OFFSET_IS(FusedAllReduceArgs, dst_stride, FAR_DST_STRIDE) &&
                  SCCL_OFFSET_IS(FusedAllReduceArgs, L, FAR_L) &&
                  SCCL_OFFSET_IS(FusedAllReduceArgs, S, FAR_S) &&
                  SCCL_OFFSET_IS(FusedAllReduceArgs, avg, FAR_AVG) &&
                  SCCL_OFFSET_IS(FusedAllReduceArgs, send, FAR_SEND) &&
                  SCCL_OFFSET_IS(FusedAllReduceArgs, send_code, FAR_SEND_CODE) &&
                  SCCL_OFFSET_IS(FusedAllReduceArgs, recv, FAR_RECV) &&
                  SCCL_OFFSET_IS(FusedAllReduceArgs, recv_code, FAR_RECV_CODE) &&
                  SCCL_OFFSET_IS(FusedAllReduceArgs, ag, FAR_AG) &&
                  SCCL_OFFSET_IS(FusedAllReduceArgs, ag_code, FAR_AG_CODE) &&
                  SCCL_OFFSET_IS(FusedAllReduceArgs, ring, FAR_RING) &&
                  SCCL_OFFSET_IS(FusedAllReduceArgs, rs_call, FAR_RS_CALL) &&
                  SCCL_OFFSET_IS(FusedAllReduceArgs, ag_call, FAR_AG_CALL) &&
                  SCCL_OFFSET_IS(FusedAllReduceArgs, counters, FAR_COUNTERS) &&
                  SCCL_OFFSET_IS(FusedAllReduceArgs, ag_counters, FAR_AG_COUNTERS) &&
                  SCCL_OFFSET_IS(FusedAllReduceArgs, npub, FAR_NPUB) &&
                  SCCL_OFFSET_IS(FusedAllReduceArgs, rs_dtab, FAR_RS_DTAB) &&
                  SCCL_OFFSET_IS(FusedAllReduceArgs, ag_dtab, FAR_AG_DTAB) &&
                  SCCL_OFFSET_IS(FusedAllReduceArgs, wp_rs, FAR_WP_RS) &&
                  SCCL_OFFSET_IS(FusedAllReduceArgs, wp_ag, FAR_WP_AG) &&
                  sizeof(FusedAllReduceArgs) == FAR_BYTES,
              "FusedAllReduceArgs offsets (sparkccl/layout.py pack_struct writes them)");

// The proxy path's publish role (kernels/publish.cu publish_role): copy chunk j < nchunks
// of the input (src + j * src_stride, L bytes) to the send region (dst, slotted by
// dst_code, chunk j's block dst_stride apart; chunk 0 also to dst2 if set), then hand each
// piece to the proxy (ring entries, call word `call`, counters per (seq % 4, piece), bpp
// blocks per piece). sccl_publish's one parameter; the first field of ProxyArgs.
struct PublishArgs {
  pu64 src, src_stride;
  pu64 dst, dst_code, dst_stride;
  pu64 dst2;
  pu64 nchunks, L, S;
  pu64 ring, state, call, counters, bpp;
};
constexpr pu64 PUB_SRC = 0;
constexpr pu64 PUB_SRC_STRIDE = 8;
constexpr pu64 PUB_DST = 16;
constexpr pu64 PUB_DST_CODE = 24;
constexpr pu64 PUB_DST_STRIDE = 32;
constexpr pu64 PUB_DST2 = 40;
constexpr pu64 PUB_NCHUNKS = 48;
constexpr pu64 PUB_L = 56;
constexpr pu64 PUB_S = 64;
constexpr pu64 PUB_RING = 72;
constexpr pu64 PUB_STATE = 80;
constexpr pu64 PUB_CALL = 88;
constexpr pu64 PUB_COUNTERS = 96;
constexpr pu64 PUB_BPP = 104;
constexpr pu64 PUB_BYTES = 112;
static_assert(SCCL_OFFSET_IS(PublishArgs, src, PUB_SRC) &&
                  SCCL_OFFSET_IS(PublishArgs, src_stride, PUB_SRC_STRIDE) &&
                  SCCL_OFFSET_IS(PublishArgs, dst, PUB_DST) &&
                  SCCL_OFFSET_IS(PublishArgs, dst_code, PUB_DST_CODE) &&
                  SCCL_OFFSET_IS(PublishArgs, dst_stride, PUB_DST_STRIDE) &&
                  SCCL_OFFSET_IS(PublishArgs, dst2, PUB_DST2) &&
                  SCCL_OFFSET_IS(PublishArgs, nchunks, PUB_NCHUNKS) &&
                  SCCL_OFFSET_IS(PublishArgs, L, PUB_L) &&
                  SCCL_OFFSET_IS(PublishArgs, S, PUB_S) &&
                  SCCL_OFFSET_IS(PublishArgs, ring, PUB_RING) &&
                  SCCL_OFFSET_IS(PublishArgs, state, PUB_STATE) &&
                  SCCL_OFFSET_IS(PublishArgs, call, PUB_CALL) &&
                  SCCL_OFFSET_IS(PublishArgs, counters, PUB_COUNTERS) &&
                  SCCL_OFFSET_IS(PublishArgs, bpp, PUB_BPP) &&
                  sizeof(PublishArgs) == PUB_BYTES,
              "PublishArgs offsets (sparkccl/layout.py pack_struct writes them)");

// The proxy path in one launch (kernels/proxy_path.cu sccl_ag_proxy, sccl_rs_proxy_*): the
// publish role, then the wait role's consume side: `in` the slot the peers' data lands in
// (slotted by in_code); reduce-scatter: this rank's own chunk (own, own_code; own_sys: it
// lies in pinned memory) and the result `out`; all-gather: rank i's bytes to
// out + i * out_stride (out 0: zero-copy, only wait). Then WAIT_PARAMS (kernels/wait.cu):
// the WaitParams block and the advance (adv_entries, adv_gate: last_block_advances).
struct ProxyArgs {
  PublishArgs pub;
  pu64 in, in_code;
  pu64 own, own_code, own_sys;
  pu64 out, out_stride;
  pu64 wp, adv_entries, adv_gate;
};
constexpr pu64 PX_PUB = 0;
constexpr pu64 PX_IN = 112;
constexpr pu64 PX_IN_CODE = 120;
constexpr pu64 PX_OWN = 128;
constexpr pu64 PX_OWN_CODE = 136;
constexpr pu64 PX_OWN_SYS = 144;
constexpr pu64 PX_OUT = 152;
constexpr pu64 PX_OUT_STRIDE = 160;
constexpr pu64 PX_WP = 168;
constexpr pu64 PX_ADV_ENTRIES = 176;
constexpr pu64 PX_ADV_GATE = 184;
constexpr pu64 PX_BYTES = 192;
static_assert(SCCL_OFFSET_IS(ProxyArgs, pub, PX_PUB) && PX_IN == PUB_BYTES &&
                  SCCL_OFFSET_IS(ProxyArgs, in, PX_IN) &&
                  SCCL_OFFSET_IS(ProxyArgs, in_code, PX_IN_CODE) &&
                  SCCL_OFFSET_IS(ProxyArgs, own, PX_OWN) &&
                  SCCL_OFFSET_IS(ProxyArgs, own_code, PX_OWN_CODE) &&
                  SCCL_OFFSET_IS(ProxyArgs, own_sys, PX_OWN_SYS) &&
                  SCCL_OFFSET_IS(ProxyArgs, out, PX_OUT) &&
                  SCCL_OFFSET_IS(ProxyArgs, out_stride, PX_OUT_STRIDE) &&
                  SCCL_OFFSET_IS(ProxyArgs, wp, PX_WP) &&
                  SCCL_OFFSET_IS(ProxyArgs, adv_entries, PX_ADV_ENTRIES) &&
                  SCCL_OFFSET_IS(ProxyArgs, adv_gate, PX_ADV_GATE) &&
                  sizeof(ProxyArgs) == PX_BYTES,
              "ProxyArgs offsets (sparkccl/layout.py pack_struct writes them)");

// The MoE finalize's rows (kernels/finalize.cu FinArgs, fin_unit): y ([R, H] bf16 or e4m3
// bytes, fp8 1), scales ([R, H / 128] fp32, e4m3 only), pos ([T * topk] int32), wts
// ([T, topk] fp32), shared ([T, H] bf16), bad (the bad-pos record); the collective's rows:
// local rows row_lo.. (rows of them, rows_pad with the zero rows) of every destination's
// chunk of Rr rows. The first field of FinalizeArgs and FinalizeDirectArgs.
struct FinRowsArgs {
  pu64 y, scales, pos, wts, shared, bad;
  pu64 T, topk, H, R, fp8;
  pu64 Rr, row_lo, rows, rows_pad;
};
constexpr pu64 FR_Y = 0;
constexpr pu64 FR_SCALES = 8;
constexpr pu64 FR_POS = 16;
constexpr pu64 FR_WTS = 24;
constexpr pu64 FR_SHARED = 32;
constexpr pu64 FR_BAD = 40;
constexpr pu64 FR_T = 48;
constexpr pu64 FR_TOPK = 56;
constexpr pu64 FR_H = 64;
constexpr pu64 FR_R = 72;
constexpr pu64 FR_FP8 = 80;
constexpr pu64 FR_RR = 88;
constexpr pu64 FR_ROW_LO = 96;
constexpr pu64 FR_ROWS = 104;
constexpr pu64 FR_ROWS_PAD = 112;
constexpr pu64 FR_BYTES = 120;
static_assert(SCCL_OFFSET_IS(FinRowsArgs, y, FR_Y) &&
                  SCCL_OFFSET_IS(FinRowsArgs, scales, FR_SCALES) &&
                  SCCL_OFFSET_IS(FinRowsArgs, pos, FR_POS) &&
                  SCCL_OFFSET_IS(FinRowsArgs, wts, FR_WTS) &&
                  SCCL_OFFSET_IS(FinRowsArgs, shared, FR_SHARED) &&
                  SCCL_OFFSET_IS(FinRowsArgs, bad, FR_BAD) &&
                  SCCL_OFFSET_IS(FinRowsArgs, T, FR_T) &&
                  SCCL_OFFSET_IS(FinRowsArgs, topk, FR_TOPK) &&
                  SCCL_OFFSET_IS(FinRowsArgs, H, FR_H) &&
                  SCCL_OFFSET_IS(FinRowsArgs, R, FR_R) &&
                  SCCL_OFFSET_IS(FinRowsArgs, fp8, FR_FP8) &&
                  SCCL_OFFSET_IS(FinRowsArgs, Rr, FR_RR) &&
                  SCCL_OFFSET_IS(FinRowsArgs, row_lo, FR_ROW_LO) &&
                  SCCL_OFFSET_IS(FinRowsArgs, rows, FR_ROWS) &&
                  SCCL_OFFSET_IS(FinRowsArgs, rows_pad, FR_ROWS_PAD) &&
                  sizeof(FinRowsArgs) == FR_BYTES,
              "FinRowsArgs offsets (sparkccl/layout.py pack_struct writes them)");

// sccl_finalize (the proxy path's publish role of the finalize): the rows into the send
// slot (send, slotted by send_code) and this rank's own chunk into `own` (device memory),
// each (row piece, destination) handed to the proxy (ring, state, call, counters).
struct FinalizeArgs {
  FinRowsArgs rows;
  pu64 world, rank;
  pu64 send, send_code, own;
  pu64 ring, state, call, counters;
};
constexpr pu64 FN_ROWS = 0;
constexpr pu64 FN_WORLD = 120;
constexpr pu64 FN_RANK = 128;
constexpr pu64 FN_SEND = 136;
constexpr pu64 FN_SEND_CODE = 144;
constexpr pu64 FN_OWN = 152;
constexpr pu64 FN_RING = 160;
constexpr pu64 FN_STATE = 168;
constexpr pu64 FN_CALL = 176;
constexpr pu64 FN_COUNTERS = 184;
constexpr pu64 FN_BYTES = 192;
static_assert(SCCL_OFFSET_IS(FinalizeArgs, rows, FN_ROWS) && FN_WORLD == FR_BYTES &&
                  SCCL_OFFSET_IS(FinalizeArgs, world, FN_WORLD) &&
                  SCCL_OFFSET_IS(FinalizeArgs, rank, FN_RANK) &&
                  SCCL_OFFSET_IS(FinalizeArgs, send, FN_SEND) &&
                  SCCL_OFFSET_IS(FinalizeArgs, send_code, FN_SEND_CODE) &&
                  SCCL_OFFSET_IS(FinalizeArgs, own, FN_OWN) &&
                  SCCL_OFFSET_IS(FinalizeArgs, ring, FN_RING) &&
                  SCCL_OFFSET_IS(FinalizeArgs, state, FN_STATE) &&
                  SCCL_OFFSET_IS(FinalizeArgs, call, FN_CALL) &&
                  SCCL_OFFSET_IS(FinalizeArgs, counters, FN_COUNTERS) &&
                  sizeof(FinalizeArgs) == FN_BYTES,
              "FinalizeArgs offsets (sparkccl/layout.py pack_struct writes them)");

// sccl_finalize_direct (GPU-direct): blocks [0, npub) compute the rows straight into the
// peers' regions along the direct table dtab and hand each piece off (ring, call, counters),
// this rank's own rows to `own` then gate[piece]; the other blocks sum this rank's rows over
// ranks from the receive slot (recv, slotted by recv_code) and `own` into dst. Then
// WAIT_PARAMS (wp, adv_entries, adv_gate) as in ProxyArgs.
struct FinalizeDirectArgs {
  FinRowsArgs rows;
  pu64 dtab, ring, call, counters, npub, gate;
  pu64 recv, recv_code, own, dst;
  pu64 wp, adv_entries, adv_gate;
};
constexpr pu64 FD_ROWS = 0;
constexpr pu64 FD_DTAB = 120;
constexpr pu64 FD_RING = 128;
constexpr pu64 FD_CALL = 136;
constexpr pu64 FD_COUNTERS = 144;
constexpr pu64 FD_NPUB = 152;
constexpr pu64 FD_GATE = 160;
constexpr pu64 FD_RECV = 168;
constexpr pu64 FD_RECV_CODE = 176;
constexpr pu64 FD_OWN = 184;
constexpr pu64 FD_DST = 192;
constexpr pu64 FD_WP = 200;
constexpr pu64 FD_ADV_ENTRIES = 208;
constexpr pu64 FD_ADV_GATE = 216;
constexpr pu64 FD_BYTES = 224;
static_assert(SCCL_OFFSET_IS(FinalizeDirectArgs, rows, FD_ROWS) && FD_DTAB == FR_BYTES &&
                  SCCL_OFFSET_IS(FinalizeDirectArgs, dtab, FD_DTAB) &&
                  SCCL_OFFSET_IS(FinalizeDirectArgs, ring, FD_RING) &&
                  SCCL_OFFSET_IS(FinalizeDirectArgs, call, FD_CALL) &&
                  SCCL_OFFSET_IS(FinalizeDirectArgs, counters, FD_COUNTERS) &&
                  SCCL_OFFSET_IS(FinalizeDirectArgs, npub, FD_NPUB) &&
                  SCCL_OFFSET_IS(FinalizeDirectArgs, gate, FD_GATE) &&
                  SCCL_OFFSET_IS(FinalizeDirectArgs, recv, FD_RECV) &&
                  SCCL_OFFSET_IS(FinalizeDirectArgs, recv_code, FD_RECV_CODE) &&
                  SCCL_OFFSET_IS(FinalizeDirectArgs, own, FD_OWN) &&
                  SCCL_OFFSET_IS(FinalizeDirectArgs, dst, FD_DST) &&
                  SCCL_OFFSET_IS(FinalizeDirectArgs, wp, FD_WP) &&
                  SCCL_OFFSET_IS(FinalizeDirectArgs, adv_entries, FD_ADV_ENTRIES) &&
                  SCCL_OFFSET_IS(FinalizeDirectArgs, adv_gate, FD_ADV_GATE) &&
                  sizeof(FinalizeDirectArgs) == FD_BYTES,
              "FinalizeDirectArgs offsets (sparkccl/layout.py pack_struct writes them)");

// The wait role alone (kernels/wait.cu sccl_ag_wait, kernels/reduce_scatter.cu
// sccl_rs_wait_*: the split engine's and the proxy path's wait kernels), and the wait role of
// the GPU-direct kernels (DirectArgs' last field): `in` the slot the peers' data lands in
// (slotted by in_code); reduce-scatter: this rank's own chunk (own, own_code; own_sys: it
// lies in pinned memory) and the result `out`; all-gather: rank i's bytes to
// out + i * out_stride (out 0: zero-copy, only wait); L bytes per rank of a slice of S. Then
// WAIT_PARAMS (wp, adv_entries, adv_gate) as in ProxyArgs. Its first field is `in`: mode
// ce's programs set a launch's first word per launch (native OpProgram), a constant here.
struct WaitRoleArgs {
  pu64 in, in_code;
  pu64 own, own_code, own_sys;
  pu64 out, out_stride;
  pu64 L, S;
  pu64 wp, adv_entries, adv_gate;
};
constexpr pu64 WR_IN = 0;
constexpr pu64 WR_IN_CODE = 8;
constexpr pu64 WR_OWN = 16;
constexpr pu64 WR_OWN_CODE = 24;
constexpr pu64 WR_OWN_SYS = 32;
constexpr pu64 WR_OUT = 40;
constexpr pu64 WR_OUT_STRIDE = 48;
constexpr pu64 WR_L = 56;
constexpr pu64 WR_S = 64;
constexpr pu64 WR_WP = 72;
constexpr pu64 WR_ADV_ENTRIES = 80;
constexpr pu64 WR_ADV_GATE = 88;
constexpr pu64 WR_BYTES = 96;
static_assert(SCCL_OFFSET_IS(WaitRoleArgs, in, WR_IN) &&
                  SCCL_OFFSET_IS(WaitRoleArgs, in_code, WR_IN_CODE) &&
                  SCCL_OFFSET_IS(WaitRoleArgs, own, WR_OWN) &&
                  SCCL_OFFSET_IS(WaitRoleArgs, own_code, WR_OWN_CODE) &&
                  SCCL_OFFSET_IS(WaitRoleArgs, own_sys, WR_OWN_SYS) &&
                  SCCL_OFFSET_IS(WaitRoleArgs, out, WR_OUT) &&
                  SCCL_OFFSET_IS(WaitRoleArgs, out_stride, WR_OUT_STRIDE) &&
                  SCCL_OFFSET_IS(WaitRoleArgs, L, WR_L) &&
                  SCCL_OFFSET_IS(WaitRoleArgs, S, WR_S) &&
                  SCCL_OFFSET_IS(WaitRoleArgs, wp, WR_WP) &&
                  SCCL_OFFSET_IS(WaitRoleArgs, adv_entries, WR_ADV_ENTRIES) &&
                  SCCL_OFFSET_IS(WaitRoleArgs, adv_gate, WR_ADV_GATE) &&
                  sizeof(WaitRoleArgs) == WR_BYTES,
              "WaitRoleArgs offsets (sparkccl/layout.py pack_struct writes them)");

// The GPU-direct kernels (kernels/direct.cu sccl_ag_direct, sccl_rs_direct_*): blocks
// [0, npub) write chunk DT_CHUNK of the input (src slotted by src_code, chunks src_stride
// apart; src_sys: it lies in pinned memory) along the direct table dtab into the peers'
// regions, this rank's own block to own_dst (slotted by own_dst_code) and dst2 (each if
// set), and hand each piece off (ring, call, counters: COUNTER_SETS sets of PIECES); the
// other blocks run the wait role (`wait`, which also holds L and S). Its first field is
// src: mode ce's program sets it per launch (native OpProgram), as it did the positional
// first parameter.
struct DirectArgs {
  pu64 src, src_code, src_stride, src_sys;
  pu64 dtab;
  pu64 own_dst, own_dst_code, dst2;
  pu64 ring, call, counters, npub;
  WaitRoleArgs wait;
};
constexpr pu64 DX_SRC = 0;
constexpr pu64 DX_SRC_CODE = 8;
constexpr pu64 DX_SRC_STRIDE = 16;
constexpr pu64 DX_SRC_SYS = 24;
constexpr pu64 DX_DTAB = 32;
constexpr pu64 DX_OWN_DST = 40;
constexpr pu64 DX_OWN_DST_CODE = 48;
constexpr pu64 DX_DST2 = 56;
constexpr pu64 DX_RING = 64;
constexpr pu64 DX_CALL = 72;
constexpr pu64 DX_COUNTERS = 80;
constexpr pu64 DX_NPUB = 88;
constexpr pu64 DX_WAIT = 96;
constexpr pu64 DX_BYTES = 192;
static_assert(SCCL_OFFSET_IS(DirectArgs, src, DX_SRC) &&
                  SCCL_OFFSET_IS(DirectArgs, src_code, DX_SRC_CODE) &&
                  SCCL_OFFSET_IS(DirectArgs, src_stride, DX_SRC_STRIDE) &&
                  SCCL_OFFSET_IS(DirectArgs, src_sys, DX_SRC_SYS) &&
                  SCCL_OFFSET_IS(DirectArgs, dtab, DX_DTAB) &&
                  SCCL_OFFSET_IS(DirectArgs, own_dst, DX_OWN_DST) &&
                  SCCL_OFFSET_IS(DirectArgs, own_dst_code, DX_OWN_DST_CODE) &&
                  SCCL_OFFSET_IS(DirectArgs, dst2, DX_DST2) &&
                  SCCL_OFFSET_IS(DirectArgs, ring, DX_RING) &&
                  SCCL_OFFSET_IS(DirectArgs, call, DX_CALL) &&
                  SCCL_OFFSET_IS(DirectArgs, counters, DX_COUNTERS) &&
                  SCCL_OFFSET_IS(DirectArgs, npub, DX_NPUB) &&
                  SCCL_OFFSET_IS(DirectArgs, wait, DX_WAIT) && DX_BYTES == DX_WAIT + WR_BYTES &&
                  sizeof(DirectArgs) == DX_BYTES,
              "DirectArgs offsets (sparkccl/layout.py pack_struct writes them)");

// Mode ce's reduce-scatter sum of one unit (kernels/reduce_scatter.cu sccl_rs_sum_unit_*):
// the part of piece unit / maxw that parts[unit % maxw] names, summed over the world's
// sources in rank order from the staging buffer (source i's chunk at stage + i * S; own:
// this rank's own chunk, own_sys: in pinned memory) into dst. unit is the first field: the
// program sets it per launch (native OpProgram); stage and own are its per-call terms.
struct SumUnitArgs {
  pu64 unit;
  pu64 stage, own, own_sys, dst;
  pu64 L, S, rank, world;
  pu64 parts, maxw;
};
constexpr pu64 SU_UNIT = 0;
constexpr pu64 SU_STAGE = 8;
constexpr pu64 SU_OWN = 16;
constexpr pu64 SU_OWN_SYS = 24;
constexpr pu64 SU_DST = 32;
constexpr pu64 SU_L = 40;
constexpr pu64 SU_S = 48;
constexpr pu64 SU_RANK = 56;
constexpr pu64 SU_WORLD = 64;
constexpr pu64 SU_PARTS = 72;
constexpr pu64 SU_MAXW = 80;
constexpr pu64 SU_BYTES = 88;
static_assert(SCCL_OFFSET_IS(SumUnitArgs, unit, SU_UNIT) &&
                  SCCL_OFFSET_IS(SumUnitArgs, stage, SU_STAGE) &&
                  SCCL_OFFSET_IS(SumUnitArgs, own, SU_OWN) &&
                  SCCL_OFFSET_IS(SumUnitArgs, own_sys, SU_OWN_SYS) &&
                  SCCL_OFFSET_IS(SumUnitArgs, dst, SU_DST) &&
                  SCCL_OFFSET_IS(SumUnitArgs, L, SU_L) &&
                  SCCL_OFFSET_IS(SumUnitArgs, S, SU_S) &&
                  SCCL_OFFSET_IS(SumUnitArgs, rank, SU_RANK) &&
                  SCCL_OFFSET_IS(SumUnitArgs, world, SU_WORLD) &&
                  SCCL_OFFSET_IS(SumUnitArgs, parts, SU_PARTS) &&
                  SCCL_OFFSET_IS(SumUnitArgs, maxw, SU_MAXW) &&
                  sizeof(SumUnitArgs) == SU_BYTES,
              "SumUnitArgs offsets (sparkccl/layout.py pack_struct writes them)");

}  // namespace kargs
}  // namespace sparkccl
