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

// One parameter: protocol.h kargs::ProxyArgs, by value (the publish role's PublishArgs,
// the consume side, WAIT_PARAMS).
#define PROXY_ROLES_INIT                                                                     \
  WAIT_PARAMS_OF(x)                                                                          \
  WAIT_ARGS_INIT(x.pub.S)                                                                    \
  const u32 npub = PIECES * (u32)x.pub.bpp;                                                  \
  const u64 L = x.pub.L, S = x.pub.S;

extern "C" __global__ void __launch_bounds__(512) sccl_ag_proxy(const ProxyArgs x) {
  PROXY_ROLES_INIT
  if (blockIdx.x < npub) {
    publish_role(x.pub, blockIdx.x);
  } else {
    ag_wait(slot_at((const u8*)x.in, x.in_code, w.seq), (u8*)x.out, x.out_stride, L, S, w,
            blockIdx.x - npub, gridDim.x - npub, slot_at((const u8*)x.own, x.own_code, w.seq),
            x.own_sys, call_sized(x.pub.call));
  }
  last_block_advances(state, adv_entries, adv_gate);
}

#define RS_PROXY_KERNEL(NAME, E)                                                             \
  extern "C" __global__ void __launch_bounds__(512) NAME(const ProxyArgs x) {                \
    PROXY_ROLES_INIT                                                                         \
    if (blockIdx.x < npub) {                                                                 \
      publish_role(x.pub, blockIdx.x);                                                       \
    } else {                                                                                 \
      rs_wait<E>(slot_at((const u8*)x.in, x.in_code, w.seq),                                 \
                 slot_at((const u8*)x.own, x.own_code, w.seq), x.own_sys, (u8*)x.out, L, S,  \
                 w, blockIdx.x - npub, gridDim.x - npub);                                    \
    }                                                                                        \
    last_block_advances(state, adv_entries, adv_gate);                                       \
  }

RS_PROXY_KERNEL(sccl_rs_proxy_bf16, BF16)
RS_PROXY_KERNEL(sccl_rs_proxy_f16, F16)
RS_PROXY_KERNEL(sccl_rs_proxy_f32, F32)
