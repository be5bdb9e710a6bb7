// Control-block helpers shared by the data-plane functions and the proxy:
// atomics on raw shared-memory words, the abort word and its error text, and the
// backoff used by every wait (hosts may be oversubscribed: never spin for long).
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "layout.h"

namespace sparkccl {

inline uint64_t* word_at(uint64_t base, uint64_t off) {
  return reinterpret_cast<uint64_t*>(static_cast<uintptr_t>(base + off));
}
inline uint64_t load_acquire(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline uint64_t load_relaxed(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
inline void store_release(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

uint64_t now_ns();  // steady clock
void sleep_ns(uint64_t ns);

// Waits that may be long: a few spins, then sched_yield for a while, then short sleeps.
class Backoff {
 public:
  Backoff();
  void pause();
  uint64_t elapsed_ns() const;

 private:
  uint64_t start_;
  uint64_t n_ = 0;
  uint64_t nap_ = 10000;
};

// Control block.
void init_control(uint64_t ctl, uint64_t pid);
uint64_t abort_code(uint64_t ctl);
// CAS 0 -> code; the message goes into the error field only if this call won.
bool set_abort(uint64_t ctl, uint64_t code, const std::string& message);
std::string error_text(uint64_t ctl);

// Data-plane helpers (dataplane_cpu.cpp). Both must be called without the GIL.
// publish: 0, or the abort code (ABORT_TIMEOUT after timeout_s; then the abort word is set).
// call: the entry's call word (protocol.h call_word) without op and piece (added here).
int64_t publish(uint64_t ctl, int op, uint64_t seq, int piece, int chunk, uint64_t slice,
                uint64_t granule, double timeout_s, uint64_t call = 0);
// wait_flags: (0, -1), or (code, index into `words` of the first unsatisfied word).
std::pair<int64_t, int64_t> wait_flags(uint64_t ctl, uint64_t flags,
                                       const std::vector<int64_t>& words, uint64_t value,
                                       double timeout_s);

}  // namespace sparkccl
