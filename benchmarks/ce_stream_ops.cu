// The host cost of the stream operations mode "ce" issues (native/src/cuda_ops.cpp
// OpProgram), each alone and batched: cuMemcpyAsync against cuMemcpyBatchAsync,
// cuStreamWriteValue64 / cuStreamWaitValue64 against cuStreamBatchMemOp, beside
// cuLaunchKernel and the event pair of a fork. p50 of 20000 calls each, on a non-blocking
// stream, drained now and then so the queue never fills; the copies go from device memory
// into mapped pinned host memory (as the sending side's copies into a peer's region), 4 KiB
// each so the GPU keeps up. Every batched form is checked once for what it wrote.
//
//   nvcc -O2 -o /tmp/ce_stream_ops benchmarks/ce_stream_ops.cu -lcuda && /tmp/ce_stream_ops
//
// Run two at once under MPS to see what two ranks sharing a GPU pay
// (benchmarks/host_time_cuda_h200.txt has the figures).
#include <cuda.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char* s_; \
  cuGetErrorString(r_, &s_); std::printf("%s failed: %s\n", #x, s_); std::exit(1); } } while (0)

__global__ void k(unsigned long long* a, unsigned long long b) {
  if (threadIdx.x == 0 && blockIdx.x == 0 && b == 12345) a[0] = b;
}

using clk = std::chrono::steady_clock;
static CUstream s;
template <class F> double med(F f, int n = 20000) {
  std::vector<double> t(n);
  for (int i = 0; i < n; ++i) {
    if (i % 64 == 0) CK(cuStreamSynchronize(s));
    auto a = clk::now(); f(); auto b = clk::now();
    t[i] = std::chrono::duration<double, std::micro>(b - a).count();
  }
  CK(cuStreamSynchronize(s));
  std::sort(t.begin(), t.end());
  return t[n / 2];
}

int main() {
  CK(cuInit(0));
  CUdevice dev; CK(cuDeviceGet(&dev, 0));
  CUcontext ctx; CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CUevent ev; CK(cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
  const size_t N = 4096, COPIES = 8;
  CUdeviceptr src; CK(cuMemAlloc(&src, COPIES * N));
  CK(cuMemsetD8(src, 0x5A, COPIES * N));
  void* host; CK(cuMemHostAlloc(&host, COPIES * N + 64, CU_MEMHOSTALLOC_DEVICEMAP));
  CUdeviceptr hdev; CK(cuMemHostGetDevicePointer(&hdev, host, 0));
  CUdeviceptr words = hdev + COPIES * N;  // 8 value words in the same mapped memory
  CUfunction fn;
  if (cudaGetFuncBySymbol(&fn, (const void*)k) != cudaSuccess) {
    std::printf("cudaGetFuncBySymbol failed\n");
    return 1;
  }
  unsigned long long a0 = (unsigned long long)src, b0 = 1;
  void* kp[2] = {&a0, &b0};

  CUdeviceptr dsts[COPIES], srcs[COPIES];
  size_t sizes[COPIES];
  for (size_t i = 0; i < COPIES; ++i) { dsts[i] = hdev + i * N; srcs[i] = src + i * N; sizes[i] = N; }
  CUmemcpyAttributes attr;
  std::memset(&attr, 0, sizeof attr);
  attr.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
  size_t attr_idx = 0;
  CUstreamBatchMemOpParams ops[8];
  std::memset(ops, 0, sizeof ops);
  for (int i = 0; i < 8; ++i) {
    ops[i].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
    ops[i].writeValue.address = words + 8 * i;
    ops[i].writeValue.value64 = 0;
    ops[i].writeValue.flags = 0;  // with the fence before the write, as the program's writes
  }
  CUstreamBatchMemOpParams waits[8];
  std::memset(waits, 0, sizeof waits);
  for (int i = 0; i < 8; ++i) {
    waits[i].waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64;
    waits[i].waitValue.address = words + 8 * i;
    waits[i].waitValue.value64 = 0;  // met at once: the words only grow
    waits[i].waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
  }

  // What the batched forms wrote, once.
  std::memset(host, 0, COPIES * N + 64);
  CK(cuMemcpyBatchAsync(dsts, srcs, sizes, COPIES, &attr, &attr_idx, 1, s));
  for (int i = 0; i < 3; ++i) ops[i].writeValue.value64 = 7 + i;
  CK(cuStreamBatchMemOp(s, 3, ops, 0));
  CK(cuStreamSynchronize(s));
  const unsigned char* hb = static_cast<const unsigned char*>(host);
  const unsigned long long* hw = reinterpret_cast<const unsigned long long*>(hb + COPIES * N);
  bool copied = true;
  for (size_t i = 0; i < COPIES * N; ++i) copied &= hb[i] == 0x5A;
  std::printf("check: cuMemcpyBatchAsync of %zu copies %s; cuStreamBatchMemOp of 3 writes %s\n",
              COPIES, copied ? "wrote every byte" : "WROTE WRONG BYTES",
              hw[0] == 7 && hw[1] == 8 && hw[2] == 9 ? "wrote 7 8 9" : "WROTE WRONG VALUES");
  if (!copied) return 1;

  for (int rep = 0; rep < 2; ++rep) {
    double launch = med([&] { CK(cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, s, kp, nullptr)); });
    double fork = med([&] { CK(cuEventRecord(ev, s)); CK(cuStreamWaitEvent(s, ev, 0)); });
    double copy1 = med([&] { CK(cuMemcpyAsync(dsts[0], srcs[0], N, s)); });
    double copy2 = med([&] { for (int i = 0; i < 2; ++i) CK(cuMemcpyAsync(dsts[i], srcs[i], N, s)); });
    double batch2 = med([&] { CK(cuMemcpyBatchAsync(dsts, srcs, sizes, 2, &attr, &attr_idx, 1, s)); });
    double batch6 = med([&] { CK(cuMemcpyBatchAsync(dsts, srcs, sizes, 6, &attr, &attr_idx, 1, s)); });
    double write1 = med([&] { CK(cuStreamWriteValue64(s, words, 1, 0)); });
    double write3 = med([&] { for (int i = 0; i < 3; ++i) CK(cuStreamWriteValue64(s, words + 8 * i, 1, 0)); });
    for (int i = 0; i < 8; ++i) ops[i].writeValue.value64 = 1;
    double bwrite3 = med([&] { CK(cuStreamBatchMemOp(s, 3, ops, 0)); });
    double bwrite7 = med([&] { CK(cuStreamBatchMemOp(s, 7, ops, 0)); });
    double wait1 = med([&] { CK(cuStreamWaitValue64(s, words, 0, CU_STREAM_WAIT_VALUE_GEQ)); });
    double bwait2 = med([&] { CK(cuStreamBatchMemOp(s, 2, waits, 0)); });
    std::printf("us p50: cuLaunchKernel %.2f  cuEventRecord+cuStreamWaitEvent %.2f\n", launch, fork);
    std::printf("        cuMemcpyAsync x1 %.2f  x2 %.2f  cuMemcpyBatchAsync of 2 %.2f  of 6 %.2f\n",
                copy1, copy2, batch2, batch6);
    std::printf("        cuStreamWriteValue64 x1 %.2f  x3 %.2f  cuStreamBatchMemOp of 3 writes %.2f  of 7 %.2f\n",
                write1, write3, bwrite3, bwrite7);
    std::printf("        cuStreamWaitValue64 (met) x1 %.2f  cuStreamBatchMemOp of 2 waits %.2f\n",
                wait1, bwait2);
  }
  return 0;
}
