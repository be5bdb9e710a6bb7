// Runs the kernels of sparkccl/dataplane/kernels/ on the CPU: every block of a launch is
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

#include <atomic>
static thread_local bool launch_trapped;  // of the launch this (stream) thread runs

template <class F>
static void run_grid(unsigned grid, F f) {
  std::vector<std::thread> ts;
  std::atomic<bool> trapped{false};
  for (unsigned b = 0; b < grid; ++b)
    ts.emplace_back([=, &trapped] {
      blockIdx.x = b; gridDim.x = grid; blockDim.x = 1; threadIdx.x = 0;
      try {
        f();
      } catch (const EmuTrap&) {
        trapped = true;
      }
    });
  for (auto& t : ts) t.join();
  launch_trapped = trapped;
}

#define P(i, T) ((T)(uintptr_t)a[i])
// A kernel whose one parameter is a protocol.h kargs struct: its bytes are the words.
template <class T>
static T by_value(const u64* a) {
  T x;
  std::memcpy(&x, a, sizeof x);
  return x;
}
// WAIT_PARAMS of kernels/wait.cu from argument i on (3 arguments: the WaitParams block of
// protocol.h, then adv_entries, adv_gate).
#define WAIT_ARGS(i) P(i, const WaitParams*), a[i + 1], a[i + 2]
// DIRECT_PARAMS of kernels/direct.cu (14 arguments, from 0).
#define DIRECT_ARGS                                                                           \
  P(0, const u8*), a[1], a[2], a[3], a[4], a[5], P(6, const u64*), P(7, u8*), a[8], P(9, u8*), \
      P(10, u8*), a[11], P(12, u32*), a[13]

// 0: ran; 1: a block trapped (__trap); -1: unknown kernel.
extern "C" int sccl_emu_run(const char* name, unsigned grid, const u64* a) {
  std::string n(name);
  launch_trapped = false;
  if (n == "sccl_poison") {
    run_grid(grid, [=] { sccl_poison(P(0, const u64*), P(1, u8*), a[2], a[3], a[4]); });
  } else if (n == "sccl_advance") {
    run_grid(grid, [=] { sccl_advance(P(0, u64*), a[1], a[2]); });
  } else if (n == "sccl_publish") {
    const auto x = by_value<PublishArgs>(a);
    run_grid(grid, [=] { sccl_publish(x); });
  } else if (n == "sccl_fail_guard") {
    run_grid(grid, [=] { sccl_fail_guard(WAIT_ARGS(0)); });
  } else if (n == "sccl_wait_piece") {
    run_grid(grid, [=] { sccl_wait_piece(a[0], WAIT_ARGS(1)); });
  } else if (n == "sccl_ag_wait") {
    run_grid(grid, [=] {
      sccl_ag_wait(P(0, const u8*), a[1], P(2, u8*), a[3], a[4], a[5], WAIT_ARGS(6));
    });
  }
#define RS(K)                                                                               \
  else if (n == #K) {                                                                       \
    run_grid(grid, [=] {                                                                    \
      K(P(0, const u8*), a[1], P(2, const u8*), a[3], a[4], P(5, u8*), a[6], a[7],          \
        WAIT_ARGS(8));                                                                      \
    });                                                                                     \
  }
  RS(sccl_rs_wait_bf16) RS(sccl_rs_wait_f16) RS(sccl_rs_wait_f32)
#define RSP(K)                                                                              \
  else if (n == #K) {                                                                       \
    run_grid(grid, [=] {                                                                    \
      K(a[0], P(1, const u8*), P(2, const u8*), a[3], P(4, u8*), a[5], a[6], a[7], a[8],    \
        P(9, const int*), a[10]);                                                           \
    });                                                                                     \
  }
  RSP(sccl_rs_sum_unit_bf16) RSP(sccl_rs_sum_unit_f16) RSP(sccl_rs_sum_unit_f32)
  else if (n == "sccl_finalize") {
    const auto x = by_value<FinalizeArgs>(a);
    run_grid(grid, [=] { sccl_finalize(x); });
  }
  else if (n == "sccl_finalize_direct") {
    const auto x = by_value<FinalizeDirectArgs>(a);
    run_grid(grid, [=] { sccl_finalize_direct(x); });
  }
  else if (n == "sccl_ag_direct") {
    run_grid(grid, [=] {
      sccl_ag_direct(DIRECT_ARGS, P(14, const u8*), a[15], P(16, u8*), a[17], WAIT_ARGS(18));
    });
  }
#define RSD(K)                                                                              \
  else if (n == #K) {                                                                       \
    run_grid(grid, [=] {                                                                    \
      K(DIRECT_ARGS, P(14, const u8*), a[15], P(16, const u8*), a[17], a[18], P(19, u8*),   \
        WAIT_ARGS(20));                                                                     \
    });                                                                                     \
  }
  RSD(sccl_rs_direct_bf16) RSD(sccl_rs_direct_f16) RSD(sccl_rs_direct_f32)
  else if (n == "sccl_ag_proxy") {
    const auto x = by_value<ProxyArgs>(a);
    run_grid(grid, [=] { sccl_ag_proxy(x); });
  }
#define RSX(K)                                                                              \
  else if (n == #K) {                                                                       \
    const auto x = by_value<ProxyArgs>(a);                                                  \
    run_grid(grid, [=] { K(x); });                                                          \
  }
  RSX(sccl_rs_proxy_bf16) RSX(sccl_rs_proxy_f16) RSX(sccl_rs_proxy_f32)
#define ARX(K)                                                                              \
  else if (n == #K) {                                                                       \
    AllReduceArgs args;                                                                     \
    std::memcpy(&args, a, sizeof args); /* the struct's words, as the launch passes them */ \
    run_grid(grid, [=] { K(args); });                                                       \
  }
  ARX(sccl_allreduce_bf16) ARX(sccl_allreduce_f16) ARX(sccl_allreduce_f32)
  else if (n == "sccl_clock_probe") {
    run_grid(grid, [=] { sccl_clock_probe(P(0, const u64*), P(1, u64*), a[2], a[3]); });
  } else if (n == "sccl_piece_bounds") {
    run_grid(grid, [=] { sccl_piece_bounds(P(0, const u64*), a[1], P(2, u64*)); });
  } else {
    return -1;
  }
  return launch_trapped ? 1 : 0;
}
