// The proxy path's floor with its data (benchmarks/decode_latency.py _piece_rtt): a
// GPU -> CPU -> GPU round trip that carries one piece. Round k: the host writes go[k]; the
// kernel, spinning, reads the piece from pinned memory (as a consumer reads what the proxy
// stored), writes it to another pinned buffer (as the publish writes the send slot), fences
// and stamps; the host, seeing the stamp, copies the piece back (as the proxy's copy does).
// One block; gives up after timeout_ns (the host then sets every go word).
#include "common.cuh"

#define BATCH 8  // 16-byte loads in flight per thread (a block of 512: 64 KiB)

extern "C" __global__ void piece_probe(const u64* go, u64* stamp, const u8* in, u8* out,
                                       u64 nbytes, u64 rounds, u64 timeout_ns) {
  __shared__ int quit;
  const u64 t0 = globaltimer();
  for (u64 k = 0; k < rounds; ++k) {
    if (threadIdx.x == 0) {
      quit = 0;
      while (ld_acquire_sys(go + k) == 0)
        if (globaltimer() - t0 > timeout_ns) {
          quit = 1;
          break;
        }
    }
    __syncthreads();
    if (quit) return;
    // (every load of a batch issued before its stores: one trip across the bus a batch)
    const u64 step = 16 * (u64)blockDim.x;
    for (u64 b = 16 * (u64)threadIdx.x; b < nbytes; b += BATCH * step) {
      V16 v[BATCH];
#pragma unroll
      for (int j = 0; j < BATCH; ++j)
        if (b + j * step < nbytes) v[j] = ld_sys16(in + b + j * step);
#pragma unroll
      for (int j = 0; j < BATCH; ++j)
        if (b + j * step < nbytes) st16(out + b + j * step, v[j]);
    }
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) st_release_sys(stamp + k, k + 1);
  }
}
