// sparkccl GPU data plane: the CUDA twin of sparkccl/dataplane/cpu.py.
//
// Compiled at run time with NVRTC (sparkccl/dataplane/nvrtc.py) for the device's own
// architecture (sm_80 and up). One translation unit: nvrtc.py inlines the files included
// below (and their includes, sparkccl/include/sparkccl/protocol.h among them) into the
// source NVRTC compiles, so the compiled-kernel cache key covers every one of them.
//
// The proxy path: two roles, launched on the caller's stream as one kernel (proxy_path.cu:
// sccl_ag_proxy, sccl_rs_proxy_*), or as these two where one phase is timed alone:
//
//   *_publish: copy piece c of the input into the send region (all-gather: own block of AG
//      slot seq%3, and the own slice of the device result; reduce-scatter: chunk j's piece
//      c into block j of RS send slot seq%2). The last block to finish piece c writes ring
//      entry first_index + c (fields, system fence, then tag = index + 1). The host
//      reserved the collective's 8 ring indices before the launch (it waited for space),
//      so this kernel never waits.
//
//   *_wait: block 0 is the poller: one thread polls the pinned flag words with
//      ld.acquire.sys in (piece, source) order, watching the abort word and a timeout on
//      %globaltimer, and relays progress through a device-memory word. Blocks 1.. poll
//      that word and consume each piece as it arrives: all-gather copies it out into the
//      device result; reduce-scatter sums the sources in rank order 0..W-1 in fp32 and
//      rounds once (round to nearest even).
//
//   sccl_*_direct (GPU-direct publish, same-host peers mapped here; docs/PROTOCOL.md):
//      one launch, two roles. Blocks [0, npub) execute this rank's publish-triggered
//      streams themselves, piece by piece in order: each item's sub-range goes from the
//      input straight into the peer's mapped region, and the last block to finish a
//      (stream, piece) writes the peer's flag word (system fence, then a system-scope
//      release store); then the own copies and the ring entry, as *_publish does. Blocks
//      npub.. are the wait kernel (poller + consumers), so the wire's two directions
//      overlap: this rank reads piece c of its peers while it still writes piece c + 1.
//
// Progress word (device memory, monotonic across launches of one data plane). The poller
// walks units u(c, k, i) = (c * maxw + k) * W + i + 1 in order (piece c, wait-word index k,
// source i): once it passed u, flag word k of every source <= i is satisfied for piece c.
//   seq * PROG_STRIDE + u       units up to u are ready
//   seq * PROG_STRIDE + FAILED  the wait failed (abort or timeout): every block exits
// Each wait word carries one part of the piece (root share, direction half: the `parts`
// table, PART_* codes), so the all-gather copies source i's part k out as soon as it came,
// and the reduce-scatter reduces part k once every source's word k came (when every source
// splits its pieces the same way; else piece by piece).
// Device state: state[0] = progress word, state[1] = dead (1 once any wait failed; later
// waits fail at once, so a failed communicator cannot hang a stream).
//
// Failure record (mapped host memory in the control block, protocol.h CTL_GPU_*):
//   status[0] code (ABORT_*; written last), status[1] detail = source << 32 | word << 8 |
//   piece (word = flag word index, 0xFFFF if none), status[2] seq.

#include "common.cuh"
#include "publish.cu"
#include "wait.cu"
#include "reduce_scatter.cu"
#include "direct.cu"
#include "proxy_path.cu"
#include "finalize.cu"
#include "allreduce.cu"
#include "allreduce_fused.cu"

// ---------------------------------------------------------------- self-test helpers

// piece_bounds of the kernels, for the drift test against plan/geometry.py.
extern "C" __global__ void sccl_piece_bounds(const u64* sizes, u64 n, u64* out) {
  for (u64 k = blockIdx.x * (u64)blockDim.x + threadIdx.x; k < n; k += (u64)gridDim.x * blockDim.x)
    for (int c = 0; c < PIECES; ++c) piece_bounds(sizes[k], c, out + (k * PIECES + c) * 2, out + (k * PIECES + c) * 2 + 1);
}
