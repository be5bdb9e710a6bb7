// Host-C++ twins of the CUDA built-ins and memory operations the kernels use, so that the
// kernels' logic runs on a CPU (one thread per block; see emu.cpp). Test-only.
#pragma once
#include <atomic>
#include <cmath>
#include <cstring>
#include <ctime>
#include <sched.h>

struct EmuDim3 { unsigned x = 0, y = 0, z = 0; };
extern thread_local EmuDim3 threadIdx, blockIdx, blockDim, gridDim;

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static thread_local

inline void __syncthreads() {}
// A device trap ends the launch and loses the context: emu.cpp catches it per block and
// reports the launch as trapped; the emulated stream then refuses everything after it.
struct EmuTrap {};
[[noreturn]] inline void __trap() { throw EmuTrap{}; }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL); }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  return __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL);
}
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
inline float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
inline float __fmaf_rn(float a, float b, float c) { return std::fmaf(a, b, c); }

inline u64 ld_acquire_sys(const u64* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline u64 ld_relaxed_sys(const u64* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
inline u64 ld_acquire_gpu(const u64* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline void st_release_gpu(u64* p, u64 v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
inline void red_release_gpu(u32* p, u32 v) { __atomic_fetch_add(p, v, __ATOMIC_RELEASE); }
inline u32 ld_acquire_gpu32(const u32* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline void st_release_sys(u64* p, u64 v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
inline void st_relaxed_sys(u64* p, u64 v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
inline void st_volatile_u64(u64* p, u64 v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
inline void st_volatile_u32(u32* p, u32 v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
inline u64 globaltimer() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return u64(ts.tv_sec) * 1000000000ull + u64(ts.tv_nsec);
}
inline void nanosleep(u32) { sched_yield(); }
inline void wait_previous_grid() {}  // (launches run one after another here)
inline void let_next_grid_start() {}

struct V16 { u32 x, y, z, w; };
inline V16 ld_sys16(const u8* p) {
  if ((u64)p & 15) __builtin_trap();  // the kernels only do 16-byte accesses when aligned
  V16 v; std::memcpy(&v, p, 16); return v;
}
inline V16 ld_dev16(const u8* p) { return ld_sys16(p); }
inline void st16(u8* p, V16 v) {
  if ((u64)p & 15) __builtin_trap();
  std::memcpy(p, &v, 16);
}
inline u8 ld_sys8(const u8* p) { return *(volatile const u8*)p; }
// LL lines: each 8-byte half {data, flag} stored and loaded whole, as on the GPU.
inline void st_ll16(u8* p, V16 v) {
  if ((u64)p & 15) __builtin_trap();
  __atomic_store_n((u64*)p, (u64)v.x | (u64)v.y << 32, __ATOMIC_RELAXED);
  __atomic_store_n((u64*)p + 1, (u64)v.z | (u64)v.w << 32, __ATOMIC_RELAXED);
}
inline V16 ld_ll16(const u8* p) {
  if ((u64)p & 15) __builtin_trap();
  const u64 a = __atomic_load_n((const u64*)p, __ATOMIC_RELAXED);
  const u64 b = __atomic_load_n((const u64*)p + 1, __ATOMIC_RELAXED);
  return V16{(u32)a, (u32)(a >> 32), (u32)b, (u32)(b >> 32)};
}
inline float f16_to_f32(u16 v) { _Float16 h; std::memcpy(&h, &v, 2); return (float)h; }
inline u16 f32_to_f16_rn(float f) { _Float16 h = (_Float16)f; u16 v; std::memcpy(&v, &h, 2); return v; }
