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

// 0: ran; 1: a block trapped (__trap); -1: unknown kernel.
extern "C" int sccl_emu_run(const char* name, unsigned grid, const u64* a) {
  std::string n(name);
  launch_trapped = false;
  if (n == "sccl_poison") {
    run_grid(grid, [=] { sccl_poison(P(0, const u64*), P(1, u8*), a[2], a[3], a[4]); });
  } else if (n == "sccl_advance") {
    run_grid(grid, [=] { sccl_advance(P(0, u64*), a[1], a[2]); });
  } else if (n == "sccl_fail_guard") {
    run_grid(grid, [=] { sccl_fail_guard(WAIT_ARGS(0)); });
  } else if (n == "sccl_wait_piece") {
    run_grid(grid, [=] { sccl_wait_piece(a[0], a[1], WAIT_ARGS(2)); });
  }
// A kernel whose one parameter is protocol.h kargs struct T.
#define BY_VALUE(K, T)                                                                      \
  else if (n == #K) {                                                                       \
    const auto x = by_value<T>(a);                                                          \
    run_grid(grid, [=] { K(x); });                                                          \
  }
  BY_VALUE(sccl_publish, PublishArgs)
  BY_VALUE(sccl_ag_wait, WaitRoleArgs)
  BY_VALUE(sccl_rs_wait_bf16, WaitRoleArgs)
  BY_VALUE(sccl_rs_wait_f16, WaitRoleArgs)
  BY_VALUE(sccl_rs_wait_f32, WaitRoleArgs)
  BY_VALUE(sccl_rs_sum_unit_bf16, SumUnitArgs)
  BY_VALUE(sccl_rs_sum_unit_f16, SumUnitArgs)
  BY_VALUE(sccl_rs_sum_unit_f32, SumUnitArgs)
  BY_VALUE(sccl_finalize, FinalizeArgs)
  BY_VALUE(sccl_finalize_direct, FinalizeDirectArgs)
  BY_VALUE(sccl_ag_direct, DirectArgs)
  BY_VALUE(sccl_rs_direct_bf16, DirectArgs)
  BY_VALUE(sccl_rs_direct_f16, DirectArgs)
  BY_VALUE(sccl_rs_direct_f32, DirectArgs)
  BY_VALUE(sccl_ag_proxy, ProxyArgs)
  BY_VALUE(sccl_rs_proxy_bf16, ProxyArgs)
  BY_VALUE(sccl_rs_proxy_f16, ProxyArgs)
  BY_VALUE(sccl_rs_proxy_f32, ProxyArgs)
  BY_VALUE(sccl_allreduce_bf16, AllReduceArgs)
  BY_VALUE(sccl_allreduce_f16, AllReduceArgs)
  BY_VALUE(sccl_allreduce_f32, AllReduceArgs)
  BY_VALUE(sccl_ar_fused_bf16, FusedAllReduceArgs)
  BY_VALUE(sccl_ar_fused_f16, FusedAllReduceArgs)
  BY_VALUE(sccl_ar_fused_f32, FusedAllReduceArgs)
  else if (n == "sccl_clock_probe") {
    run_grid(grid, [=] { sccl_clock_probe(P(0, const u64*), P(1, u64*), a[2], a[3]); });
  } else if (n == "sccl_piece_bounds") {
    run_grid(grid, [=] { sccl_piece_bounds(P(0, const u64*), a[1], P(2, u64*)); });
  } else {
    return -1;
  }
  return launch_trapped ? 1 : 0;
}
