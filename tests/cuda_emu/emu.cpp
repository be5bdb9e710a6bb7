// Runs the kernels of sparkccl/dataplane/kernels.cu on the CPU: every block of a launch is
// a std::thread with blockDim.x == 1 (so __syncthreads is a no-op), all blocks run at once
// (the wait kernels' poller and consumers spin on each other). Test-only.
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

#define SCCL_EMU 1
#include "sccl_emu.h"
thread_local EmuDim3 threadIdx, blockIdx, blockDim, gridDim;

#include KERNELS_CU

template <class F>
static void run_grid(unsigned grid, F f) {
  std::vector<std::thread> ts;
  for (unsigned b = 0; b < grid; ++b)
    ts.emplace_back([=] {
      blockIdx.x = b; gridDim.x = grid; blockDim.x = 1; threadIdx.x = 0;
      f();
    });
  for (auto& t : ts) t.join();
}

#define P(i, T) ((T)(uintptr_t)a[i])

extern "C" int sccl_emu_run(const char* name, unsigned grid, const u64* a) {
  std::string n(name);
  if (n == "sccl_publish") {
    run_grid(grid, [=] {
      sccl_publish(P(0, const u8*), a[1], P(2, u8*), a[3], P(4, u8*), a[5], a[6], a[7], P(8, u8*),
                   a[9], a[10], a[11], P(12, u32*), a[13]);
    });
  } else if (n == "sccl_ag_wait") {
    run_grid(grid, [=] {
      sccl_ag_wait(P(0, const u8*), P(1, u8*), a[2], a[3], a[4], P(5, const u64*),
                   P(6, const u64*), P(7, u64*), P(8, const int*), a[9], P(10, u64*), a[11], a[12],
                   a[13], a[14]);
    });
  }
#define RS(K)                                                                               \
  else if (n == #K) {                                                                       \
    run_grid(grid, [=] {                                                                    \
      K(P(0, const u8*), P(1, const u8*), a[2], P(3, u8*), a[4], a[5], P(6, const u64*),    \
        P(7, const u64*), P(8, u64*), P(9, const int*), a[10], P(11, u64*), a[12], a[13],   \
        a[14], a[15]);                                                                      \
    });                                                                                     \
  }
  RS(sccl_rs_wait_bf16) RS(sccl_rs_wait_f16) RS(sccl_rs_wait_f32)
  else if (n == "sccl_piece_bounds") {
    run_grid(grid, [=] { sccl_piece_bounds(P(0, const u64*), a[1], P(2, u64*)); });
  } else {
    return -1;
  }
  return 0;
}
