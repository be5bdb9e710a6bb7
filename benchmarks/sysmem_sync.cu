// What the GPU pays for each step of a piece hand-off over pinned host memory: the memory
// operations the publish and wait roles of kernels/direct.cu and kernels/wait.cu chain per
// piece, each timed alone on one block of 256 threads (%globaltimer, mean of 2000 rounds,
// median of 5 launches). Small collectives are a chain of 8 such pieces, so these costs,
// not the bytes, set their time.
//
//   nvcc -O2 -arch=sm_90 -I sparkccl/include -o /tmp/sysmem_sync benchmarks/sysmem_sync.cu \
//     && /tmp/sysmem_sync
//
// Rows (bytes: per round, 16 per thread, to or from mapped pinned memory):
//   store 4 KiB                       256 x 16-byte stores, no ordering
//   + fence.sys per thread            each thread's __threadfence_system() after its store
//   + bar, one fence.sys              __syncthreads(), then one thread's fence
//   + bar, st.release.sys             __syncthreads(), then one thread's release store
//   piece as published (1 block)      direct_publish's steps for one stream and one block
//                                     before hand_off (kernels/direct.cu): per-thread
//                                     fences twice, two counters, a release for the flag
//                                     and one for the entry's tag
//   piece as handed off (1 block)     hand_off's: per-thread fence, one counter, the
//                                     entry's fields, one fence, two flags and the tag
//   ld.acquire.sys (1 thread)         one acquire load of a pinned word
//   load 4 KiB                        256 x 16-byte ld.cv loads + __syncthreads()
//   fence.sys, nothing outstanding    one thread's fence with no store before it
//   atomicAdd + fence (device)        a counter in device memory, as last_block_arrives
//   + fence.acq_rel.sys per thread    as "+ fence.sys per thread" with fence.acq_rel.sys, the
//                                     weakest fence that makes a release (or, after relaxed
//                                     loads, an acquire) pattern; __threadfence_system() is
//                                     fence.sc.sys
//   fence.acq_rel.sys, nothing out    one thread's fence.acq_rel.sys with no store before it
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

// The kernels' own memory operations (ld.acquire.sys, st.release.sys, the 16-byte pinned
// loads and stores, %globaltimer).
#include "../sparkccl/dataplane/kernels/common.cuh"

enum {
  STORE, FENCE_EACH, BAR_FENCE, BAR_RELEASE, PIECE, HAND_OFF, ACQUIRE, LOAD, FENCE_IDLE, ATOMIC,
  ACQREL_EACH, ACQREL_IDLE, N
};
const char* NAMES[N] = {"store 4 KiB", "+ fence.sys per thread", "+ bar, one fence.sys",
                        "+ bar, st.release.sys", "piece as published (1 block)",
                        "piece as handed off (1 block)",
                        "ld.acquire.sys (1 thread)", "load 4 KiB", "fence.sys, nothing outstanding",
                        "atomicAdd + fence (device)", "+ fence.acq_rel.sys per thread",
                        "fence.acq_rel.sys, nothing out"};

__device__ __forceinline__ void fence_acq_rel_sys() {
  asm volatile("fence.acq_rel.sys;" ::: "memory");
}

__global__ void probe(int test, int rounds, u8* pin, u64* pin_words, u32* counter,
                      u64* out) {
  const u32 t = threadIdx.x;
  u32 acc = 0;
  __syncthreads();
  const u64 t0 = globaltimer();
  for (int r = 0; r < rounds; ++r) {
    u8* mine = pin + 16 * t;
    const V16 v = {(u32)r, (u32)r, (u32)r, (u32)r};
    switch (test) {
      case STORE: st16(mine, v); break;
      case FENCE_EACH: st16(mine, v); __threadfence_system(); break;
      case BAR_FENCE:
        st16(mine, v);
        __syncthreads();
        if (t == 0) __threadfence_system();
        break;
      case BAR_RELEASE:
        st16(mine, v);
        __syncthreads();
        if (t == 0) st_release_sys(pin_words, r);
        break;
      case PIECE:  // arrive_flag + finish_piece, as direct_publish did before hand_off
        st16(mine, v);
        __threadfence_system();
        __syncthreads();
        if (t == 0 && atomicAdd(counter, 1u) == (u32)r * 2) {
          __threadfence();
          __threadfence_system();
          st_release_sys(pin_words, r);
        }
        __threadfence_system();
        __syncthreads();
        if (t == 0 && atomicAdd(counter, 1u) == (u32)r * 2 + 1) {
          __threadfence();
          volatile u64* e = pin_words + 8;
          for (int k = 0; k < 8; ++k) e[k] = r + k;
          st_release_sys(pin_words + 16, r);
        }
        break;
      case HAND_OFF:  // hand_off of kernels/direct.cu, one block, two streams
        st16(mine, v);
        __threadfence_system();
        __syncthreads();
        if (t == 0 && atomicAdd(counter, 1u) == (u32)r) {
          __threadfence();
          volatile u64* e = pin_words + 8;
          for (int k = 0; k < 8; ++k) e[k] = r + k;
          __threadfence_system();
          st_relaxed_sys(pin_words, r);
          st_relaxed_sys(pin_words + 1, r);
          st_relaxed_sys(pin_words + 16, r);
        }
        break;
      case ACQUIRE:
        if (t == 0) acc += (u32)ld_acquire_sys(pin_words);
        break;
      case LOAD: {
        const V16 got = ld_sys16(mine);
        acc += got.x ^ got.y ^ got.z ^ got.w;
        __syncthreads();
        break;
      }
      case FENCE_IDLE:
        if (t == 0) __threadfence_system();
        break;
      case ATOMIC:
        if (t == 0) {
          atomicAdd(counter + 64, 1u);
          __threadfence();
        }
        break;
      case ACQREL_EACH: st16(mine, v); fence_acq_rel_sys(); break;
      case ACQREL_IDLE:
        if (t == 0) fence_acq_rel_sys();
        break;
    }
  }
  __syncthreads();
  if (t == 0) out[0] = globaltimer() - t0;
  if (acc == 0xFFFFFFFFu) out[1] = acc;  // (keeps the loads)
}

int main() {
  const int rounds = 2000, launches = 5;
  unsigned char* pin;
  cudaHostAlloc((void**)&pin, 1 << 20, cudaHostAllocMapped);
  unsigned char* pin_dev;
  cudaHostGetDevicePointer((void**)&pin_dev, pin, 0);
  u32* counter;
  u64* out;
  cudaMalloc(&counter, 4096);
  cudaMallocManaged(&out, 64);
  cudaDeviceProp p;
  cudaGetDeviceProperties(&p, 0);
  printf("# %s: one block of 256 threads, ns per round (mean of %d rounds, median of %d "
         "launches); pinned = cudaHostAllocMapped\n", p.name, rounds, launches);
  for (int test = 0; test < N; ++test) {
    std::vector<double> ns;
    for (int l = 0; l < launches; ++l) {
      cudaMemset(counter, 0, 4096);
      probe<<<1, 256>>>(test, rounds, pin_dev, (u64*)(pin_dev + 65536), counter, out);
      if (cudaDeviceSynchronize() != cudaSuccess) {
        printf("%s: %s\n", NAMES[test], cudaGetErrorString(cudaGetLastError()));
        return 1;
      }
      ns.push_back((double)out[0] / rounds);
    }
    std::sort(ns.begin(), ns.end());
    printf("  %-32s %8.0f ns\n", NAMES[test], ns[launches / 2]);
  }
  return 0;
}
