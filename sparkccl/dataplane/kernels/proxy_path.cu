// The proxy path in one launch: blocks [0, PIECES * bpp) publish (sccl_publish's work: the
// input into the send slot, then each piece's ring entry for the proxy), the others wait and
// consume (sccl_ag_wait's or sccl_rs_wait_*'s work: poller, then consumers), so a collective
// costs the host one kernel launch, not two (issue 17: a launch is several microseconds of
// host time under MPS). The publish blocks come first in the grid, so they are dispatched
// before the spinning waiters (as the publish role of the sccl_*_direct kernels); the last
// block of either role to finish advances the device state (last_block_advances: every
// block read seq at its start).
#pragma once
#include "common.cuh"
#include "publish.cu"
#include "wait.cu"
#include "reduce_scatter.cu"

// sccl_publish's parameters but L, S and state (the wait role's too).
#define PUBLISH_ROLE_PARAMS                                                                  \
  const u8 *src, u64 src_stride, u8 *pdst, u64 pdst_code, u64 pdst_stride, u8 *dst2,         \
      u64 nchunks, u8 *ring, u64 call, u32 *counters, u64 bpp
#define PUBLISH_ROLE                                                                         \
  publish_role(src, src_stride, pdst, pdst_code, pdst_stride, dst2, nchunks, L, S, ring,    \
               state, call, counters, bpp, blockIdx.x)

extern "C" __global__ void __launch_bounds__(512) sccl_ag_proxy(
    PUBLISH_ROLE_PARAMS, const u8* slot, u64 slot_code, u8* dst, u64 dst_stride, u64 L, u64 S,
    WAIT_PARAMS) {
  WAIT_ARGS_INIT
  const u32 npub = PIECES * (u32)bpp;
  if (blockIdx.x < npub) {
    PUBLISH_ROLE;
  } else {
    ag_wait(slot_at(slot, slot_code, w.seq), dst, dst_stride, L, S, w, blockIdx.x - npub,
            gridDim.x - npub);
  }
  last_block_advances(state, adv_entries, adv_gate);
}

#define RS_PROXY_KERNEL(NAME, E)                                                             \
  extern "C" __global__ void __launch_bounds__(512) NAME(                                    \
      PUBLISH_ROLE_PARAMS, const u8* recv, u64 recv_code, const u8* own, u64 own_code,       \
      u64 own_sys, u8* dst, u64 L, u64 S, WAIT_PARAMS) {                                     \
    WAIT_ARGS_INIT                                                                           \
    const u32 npub = PIECES * (u32)bpp;                                                      \
    if (blockIdx.x < npub) {                                                                 \
      PUBLISH_ROLE;                                                                          \
    } else {                                                                                 \
      rs_wait<E>(slot_at(recv, recv_code, w.seq), slot_at(own, own_code, w.seq), own_sys,    \
                 dst, L, S, w, blockIdx.x - npub, gridDim.x - npub);                         \
    }                                                                                        \
    last_block_advances(state, adv_entries, adv_gate);                                       \
  }

RS_PROXY_KERNEL(sccl_rs_proxy_bf16, BF16)
RS_PROXY_KERNEL(sccl_rs_proxy_f16, F16)
RS_PROXY_KERNEL(sccl_rs_proxy_f32, F32)
