// Control block, abort word, and the CPU data plane's publish / wait helpers.
#include <sched.h>
#include <time.h>

#include <cmath>
#include <cstring>
#include <stdexcept>

#include "control.h"
#include "geometry.h"

namespace sparkccl {

using namespace layout;

uint64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
}

void sleep_ns(uint64_t ns) {
  timespec ts{time_t(ns / 1000000000ull), long(ns % 1000000000ull)};
  nanosleep(&ts, nullptr);
}

Backoff::Backoff() : start_(now_ns()) {}

uint64_t Backoff::elapsed_ns() const { return now_ns() - start_; }

void Backoff::pause() {
  ++n_;
  if (n_ < 64) {
    cpu_relax();
    return;
  }
  if (elapsed_ns() < 200000) {  // first 200 us: give the core away but stay runnable
    sched_yield();
    return;
  }
  sleep_ns(nap_);
  if (nap_ < 200000) nap_ *= 2;  // 10 us .. 200 us
}

static bool deadline_passed(uint64_t start, double timeout_s) {
  if (!(timeout_s < 1e9)) return false;  // inf / huge: no timeout
  double waited = double(now_ns() - start) * 1e-9;
  return waited >= timeout_s;
}

void init_control(uint64_t ctl, uint64_t pid) {
  if (!ctl) throw std::invalid_argument("init_control: null control address");
  std::memset(reinterpret_cast<void*>(static_cast<uintptr_t>(ctl)), 0,
              RING_OFFSET + RING_ENTRIES * RING_ENTRY_BYTES);
  store_release(word_at(ctl, CTL_PID), pid);
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  store_release(word_at(ctl, CTL_MAGIC), CTL_MAGIC_VALUE);
}

uint64_t abort_code(uint64_t ctl) { return load_acquire(word_at(ctl, CTL_ABORT)); }

bool set_abort(uint64_t ctl, uint64_t code, const std::string& message) {
  if (code == ABORT_NONE) code = ABORT_USER;
  uint64_t expected = 0;
  if (!__atomic_compare_exchange_n(word_at(ctl, CTL_ABORT), &expected, code, false,
                                   __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
    return false;
  // Byte 0 is stored last (release): a reader that sees it non-zero sees the whole text.
  char* text = reinterpret_cast<char*>(static_cast<uintptr_t>(ctl + CTL_ERROR));
  std::string msg = message.empty() ? std::string("(no message)") : message;
  size_t n = std::min<size_t>(msg.size(), ERROR_BYTES - 1);
  if (n > 1) std::memcpy(text + 1, msg.data() + 1, n - 1);
  text[n] = 0;
  __atomic_store_n(text, msg[0], __ATOMIC_RELEASE);
  return true;
}

std::string error_text(uint64_t ctl) {
  const char* text = reinterpret_cast<const char*>(static_cast<uintptr_t>(ctl + CTL_ERROR));
  // The winner of set_abort writes the text right after the CAS: give it a moment.
  uint64_t start = now_ns();
  while (__atomic_load_n(text, __ATOMIC_ACQUIRE) == 0) {
    if (abort_code(ctl) == ABORT_NONE || now_ns() - start > 20000000ull) return std::string();
    sleep_ns(50000);
  }
  return std::string(text, strnlen(text, ERROR_BYTES - 1));
}

int64_t publish(uint64_t ctl, int op, uint64_t seq, int piece, int chunk, uint64_t slice,
                uint64_t granule, double timeout_s, uint64_t call) {
  if (op < 0 || op >= NUM_OPS) throw std::invalid_argument("publish: op out of range");
  if (piece < 0 || piece >= geom::PIECES) throw std::invalid_argument("publish: piece out of range");
  if ((chunk < -1 && chunk != CHUNK_LL && chunk != CHUNK_WHOLE) || chunk >= 32)
    throw std::invalid_argument("publish: chunk must be -1..31, CHUNK_LL (-3) or CHUNK_WHOLE (-4)");
  if (granule == 0) throw std::invalid_argument("publish: granule must be > 0");
  if (call & (0xFFull | 0xFFull << CALL_PIECE_SHIFT))
    throw std::invalid_argument("publish: call word with op or piece bits set");
  uint64_t code = abort_code(ctl);
  if (code) return int64_t(code);

  // CHUNK_WHOLE: one entry for pieces 0..piece, which takes their piece + 1 ring indices (the
  // entry at the first; `last` needs the ring's room)
  const uint64_t span = chunk == CHUNK_WHOLE ? uint64_t(piece) + 1 : 1;
  uint64_t index = __atomic_fetch_add(word_at(ctl, CTL_RING_HEAD), span, __ATOMIC_ACQ_REL);
  const uint64_t last = index + span - 1;
  const uint64_t* tail = word_at(ctl, CTL_RING_TAIL);
  if (last - load_acquire(tail) >= RING_ENTRIES) {
    Backoff backoff;
    uint64_t start = now_ns();
    while (last - load_acquire(tail) >= RING_ENTRIES) {
      code = abort_code(ctl);
      if (code) return int64_t(code);
      if (deadline_passed(start, timeout_s)) {
        set_abort(ctl, ABORT_TIMEOUT,
                  "publish: ring full for " + std::to_string(timeout_s) +
                      " s (the proxy is not consuming; entry " + std::to_string(index) +
                      ", consumed " + std::to_string(load_acquire(tail)) + ")");
        return int64_t(abort_code(ctl));
      }
      backoff.pause();
    }
  }
  auto b = geom::piece_bounds(slice, piece, granule);
  if (chunk == CHUNK_WHOLE) b.first = 0;
  uint64_t ent = ctl + RING_OFFSET + (index % RING_ENTRIES) * RING_ENTRY_BYTES;
  *word_at(ent, ENT_SEQ) = seq;
  *word_at(ent, ENT_SLICE) = slice;
  *word_at(ent, ENT_LO) = b.first;
  *word_at(ent, ENT_HI) = b.second;
  *word_at(ent, ENT_OP) = call | uint64_t(op) | uint64_t(piece) << CALL_PIECE_SHIFT;
  uint32_t u32;
  int32_t i32;
  i32 = chunk;
  std::memcpy(reinterpret_cast<void*>(static_cast<uintptr_t>(ent + ENT_CHUNK)), &i32, 4);
  u32 = uint32_t(granule);
  std::memcpy(reinterpret_cast<void*>(static_cast<uintptr_t>(ent + ENT_GRANULE)), &u32, 4);
  *word_at(ent, ENT_PUBLISH_NS) = now_ns();
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  store_release(word_at(ent, ENT_TAG), index + 1);
  return 0;
}

std::pair<int64_t, int64_t> wait_flags(uint64_t ctl, uint64_t flags,
                                       const std::vector<int64_t>& words, uint64_t value,
                                       double timeout_s) {
  for (int64_t w : words)
    if (w < 0) throw std::invalid_argument("wait_flags: negative flag word");
  size_t i = 0;
  Backoff backoff;
  uint64_t start = now_ns();
  for (;;) {
    while (i < words.size() && load_acquire(word_at(flags, uint64_t(words[i]) * FLAG_BYTES)) >= value)
      ++i;
    if (i == words.size()) return {0, -1};
    uint64_t code = abort_code(ctl);
    if (code) return {int64_t(code), int64_t(i)};
    if (deadline_passed(start, timeout_s)) return {int64_t(ABORT_TIMEOUT), int64_t(i)};
    backoff.pause();
  }
}

}  // namespace sparkccl
