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
