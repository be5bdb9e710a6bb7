// The host cost of the driver calls a planned sparkccl collective makes (one
// cuLaunchKernel, one cuEventRecord, plus cuCtxGetCurrent and cuStreamIsCapturing in
// native/src/cuda_ops.cpp LaunchPlan::issue), each timed alone, p50 of 20000, and
// cuEventQuery (what a synchronization polls). The kernel takes nine 64-bit parameters
// and runs 8 blocks on a non-blocking stream, drained now and then so the queue never
// fills.
//
//   nvcc -O2 -o /tmp/driver_calls benchmarks/driver_calls.cu -lcuda && /tmp/driver_calls
//
// Run two at once under MPS to see what two ranks sharing a GPU pay
// (benchmarks/host_time_cuda_h200.txt has the figures: cuLaunchKernel is most of the
// native issue, and the floor of an eager call's host time).
#include <cuda.h>
#include <cstdio>
#include <chrono>
#include <vector>
#include <algorithm>
__global__ void k(unsigned long long* a, unsigned long long b, unsigned long long c,
                  unsigned long long d, unsigned long long e, unsigned long long f,
                  unsigned long long g, unsigned long long h, unsigned long long i) {
  if (threadIdx.x == 0 && blockIdx.x == 0 && b == 12345) a[0] = c + d + e + f + g + h + i;
}
using clk = std::chrono::steady_clock;
template <class F> double med(F f, int n = 20000) {
  std::vector<double> t(n);
  for (int i = 0; i < n; ++i) {
    auto a = clk::now(); f(); auto b = clk::now();
    t[i] = std::chrono::duration<double, std::micro>(b - a).count();
  }
  std::sort(t.begin(), t.end());
  return t[n / 2];
}
int main() {
  cudaFree(0);
  CUcontext ctx; cuCtxGetCurrent(&ctx);
  CUstream s; cuStreamCreate(&s, CU_STREAM_NON_BLOCKING);
  CUevent ev; cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING);
  unsigned long long* a; cudaMalloc(&a, 64);
  unsigned long long v[9] = {(unsigned long long)a, 1, 2, 3, 4, 5, 6, 7, 8};
  void* p[9]; for (int i = 0; i < 9; ++i) p[i] = &v[i];
  CUfunction fn; cudaGetFuncBySymbol(&fn, (const void*)k);
  for (int rep = 0; rep < 2; ++rep) {
    double t_ctx = med([&] { CUcontext c; cuCtxGetCurrent(&c); });
    double t_cap = med([&] { CUstreamCaptureStatus st; cuStreamIsCapturing(s, &st); });
    double t_launch = med([&] { cuLaunchKernel(fn, 8, 1, 1, 128, 1, 1, 0, s, p, nullptr); if (rand() % 64 == 0) cuStreamSynchronize(s); });
    cuStreamSynchronize(s);
    double t_ev = med([&] { cuEventRecord(ev, s); });
    double t_both = med([&] { cuLaunchKernel(fn, 8, 1, 1, 128, 1, 1, 0, s, p, nullptr); cuEventRecord(ev, s); if (rand() % 64 == 0) cuStreamSynchronize(s); });
    cuStreamSynchronize(s);
    double t_q = med([&] { cuEventQuery(ev); });
    printf("us p50: ctxGetCurrent %.3f isCapturing %.3f launch %.3f eventRecord %.3f launch+record %.3f eventQuery %.3f\n",
           t_ctx, t_cap, t_launch, t_ev, t_both, t_q);
  }
  return 0;
}
