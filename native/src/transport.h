// The transport contract (docs/PROTOCOL.md "The transport contract"), shaped like RC queue pairs: per connection an ordered
// stream of write(local off, len, remote off) and flag(remote word, value), where a flag
// becomes visible only after every earlier write on that connection, plus polling for
// asynchronous completion errors. The proxy is the only caller (one thread).
#pragma once
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "control.h"
#include "layout.h"

namespace sparkccl {

// What a proxy knows about memory: local regions and each peer's segments as mapped in
// this process. Python threads write it (set_region / set_peer*), the proxy thread reads
// it when posting, hence atomics. Region sizes default to slots * stride.
inline const char* region_name(int r) {
  static const char* names[] = {"AG", "RS_SEND", "RS_RECV"};
  return (r >= 0 && r < layout::NUM_REGIONS) ? names[r] : "?";
}

struct Registry {
  struct Peer {
    std::atomic<uint64_t> ctl{0}, flags{0}, pid{0};
    std::atomic<uint64_t> base[layout::NUM_REGIONS]{}, size[layout::NUM_REGIONS]{};
  };

  Registry(int rank_, int world_, const std::vector<int>& slots_)
      : rank(rank_), world(world_), num_flags(layout::num_flag_words(world_)),
        num_words(layout::flag_section_words(world_)),
        ll_off(layout::ll_area_from_flags(world_)), ll_bytes(layout::ll_area_bytes(world_)),
        peers(new Peer[size_t(world_)]) {
    for (int r = 0; r < layout::NUM_REGIONS; ++r) slots[r] = uint64_t(slots_[size_t(r)]);
  }

  uint64_t local_size(int r) const {
    uint64_t s = size[r].load(std::memory_order_acquire);
    return s ? s : slots[r] * stride[r].load(std::memory_order_acquire);
  }
  uint64_t peer_size(int p, int r) const {
    uint64_t s = peers[p].size[r].load(std::memory_order_acquire);
    return s ? s : slots[r] * stride[r].load(std::memory_order_acquire);
  }

  // A transport write's source: the base of local region r when [off, off + len) lies in
  // it, else 0 and *cause says why.
  uint64_t local_span(int r, uint64_t off, uint64_t len, std::string* cause) const {
    const uint64_t b = base[r].load(std::memory_order_acquire);
    if (!b) {
      *cause = std::string("local region ") + region_name(r) + " is not registered";
      return 0;
    }
    const uint64_t s = local_size(r);
    if (off > s || len > s - off) {
      *cause = "write reads [" + std::to_string(off) + ", " + std::to_string(off + len) +
               ") past the end of local region " + region_name(r) + " (" + std::to_string(s) +
               " bytes)";
      return 0;
    }
    return b;
  }
  // The same for a destination in peer p's region r (mapped here).
  uint64_t peer_span(int p, int r, uint64_t off, uint64_t len, std::string* cause) const {
    const uint64_t b = peers[p].base[r].load(std::memory_order_acquire);
    if (!b) {
      *cause = std::string("peer's region ") + region_name(r) + " is not mapped";
      return 0;
    }
    const uint64_t s = peer_size(p, r);
    if (off > s || len > s - off) {
      *cause = "write to [" + std::to_string(off) + ", " + std::to_string(off + len) +
               ") past the end of the peer's region " + region_name(r) + " (" +
               std::to_string(s) + " bytes)";
      return 0;
    }
    return b;
  }

  const int rank, world;
  const uint64_t num_flags;
  const uint64_t num_words;  // flag words, then call words (layout::flag_section_words)
  // The LL area (Transport::put_lines): its byte offset from the flag words, and its size.
  const uint64_t ll_off, ll_bytes;
  uint64_t slots[layout::NUM_REGIONS];
  std::atomic<uint64_t> base[layout::NUM_REGIONS]{}, stride[layout::NUM_REGIONS]{},
      size[layout::NUM_REGIONS]{};
  std::unique_ptr<Peer[]> peers;
};

// The last CAP samples of one writer thread, for readers on other threads (the proxy's
// stats()): relaxed atomics, so the writer (a transport's worker, in its hot path) takes no
// lock. A reader racing the writer may get a slot of the writer's next lap: a sample all the
// same.
template <size_t CAP>
struct SampleRing {
  std::atomic<uint64_t> slot[CAP]{};
  std::atomic<uint64_t> total{0};

  void add(uint64_t v) {  // the one writer thread only
    const uint64_t n = total.load(std::memory_order_relaxed);
    slot[n % CAP].store(v, std::memory_order_relaxed);
    total.store(n + 1, std::memory_order_release);
  }
  // Appends the samples kept to *out; returns how many were ever added.
  uint64_t read(std::vector<uint64_t>* out) const {
    const uint64_t n = total.load(std::memory_order_acquire);
    for (size_t k = 0; k < std::min<uint64_t>(n, CAP); ++k)
      out->push_back(slot[k].load(std::memory_order_relaxed));
    return n;
  }
};

// A flag's way through a transport with worker threads (shm), one sample: ns from the
// proxy's push to the worker taking it from the queue (high 32 bits), and from then to the
// flag's store (low 32 bits; the batch's earlier copies and the fence included). One word,
// so that a reader never pairs halves of two samples.
inline uint64_t flag_sample(uint64_t pushed, uint64_t taken, uint64_t stored) {
  auto clamp = [](uint64_t a, uint64_t b) { return b > a ? std::min<uint64_t>(b - a, 0xFFFFFFFFu) : 0; };
  return clamp(pushed, taken) << 32 | clamp(taken, stored);
}

struct ConnInfo {
  int peer, channel, root;
};

// One row [peer, channel, root] of a plan's connection table (sparkccl.plan.model), checked:
// what: the caller, for the message.
inline ConnInfo conn_from_row(const std::vector<int64_t>& c, int rank, int world,
                              const char* what) {
  auto bad = [&](const char* why) { throw std::invalid_argument(std::string(what) + ": " + why); };
  if (c.size() != 3) bad("connection rows are [peer, channel, root]");
  if (c[0] < 0 || c[0] >= world || c[0] == rank) bad("connection peer out of range");
  if (c[1] < 0 || c[1] >= layout::CHANNELS || c[2] < 0 || c[2] >= layout::MAX_ROOTS)
    bad("connection channel/root out of range");
  return ConnInfo{int(c[0]), int(c[1]), int(c[2])};
}

class Transport {
 public:
  virtual ~Transport() = default;
  virtual const char* name() const = 0;
  virtual void start() = 0;
  virtual void stop() = 0;  // joins every worker; idempotent
  // Post in order on connection `conn`. Returns false with *cause set on a failure found
  // at post time (bounds, unregistered memory); nothing is posted then.
  virtual bool write(int conn, int src_region, uint64_t src_off, int dst_region,
                     uint64_t dst_off, uint64_t len, std::string* cause) = 0;
  virtual bool flag(int conn, uint64_t word, uint64_t value, std::string* cause) = 0;
  // A call entry (docs/PROTOCOL.md "Call words"): store its first n values (CALL_SIZED: the
  // call and the slice; CALL_ENTRY_WORDS: with a sized all-to-all's lengths, for relays) at
  // the peer's words word .. word + n - 1 (past its flag words), ordered like a write:
  // visible before every later flag on the connection.
  // Not a flag (nothing waits on it; verbs strict mode writes it plainly, not as an
  // immediate).
  virtual bool put_call(int conn, uint64_t word, const uint64_t* values, uint64_t n,
                        std::string* cause) = 0;
  // LL lines (docs/PROTOCOL.md "One shot, LL, through the proxy"): bytes [off, off + len) of
  // this rank's LL area (Registry::ll_off past its flag words) to the same bytes of the
  // peer's, ordered like a write. Every 8-byte half {data, flag} lands whole (store_lines):
  // the peer's GPU reads the lines while they arrive and takes a half once its flag says
  // the collective's, with no flag or fence after them to wait for.
  virtual bool put_lines(int conn, uint64_t off, uint64_t len, std::string* cause) = 0;
  // Asynchronous completions: false with *conn / *cause for the first failed operation.
  virtual bool poll(int* conn, std::string* cause) = 0;
  // Operations posted and not yet completed (all connections).
  virtual uint64_t outstanding() const = 0;
  // The communicator has failed (local or peer abort; text = the abort record): tell the
  // peers where the transport can (tcp sends an abort frame on every connection). Called
  // once, from the proxy thread.
  virtual void on_abort(const std::string& text) { (void)text; }
  // Clean close (every rank is done with every collective): flush what was posted and tell
  // the peers that nothing more will come, so that the close is not taken for a crash.
  // Called before stop().
  virtual void finish() {}
  // What a transport with worker threads measures (shm does; others leave it empty): any
  // thread, for Proxy::stats().
  struct Stats {
    std::vector<uint64_t> flag_samples;  // data flags (flag(), not put_call's words):
                                         // flag_sample words, the last ones kept
    uint64_t flags_sampled = 0;          // how many were taken in all
    uint64_t worker_sleeps = 0;          // times a worker blocked on its queue's condvar
  };
  virtual void stats(Stats* out) const { (void)out; }
};

// What a transport is built on: the proxy's registry (rank, world, memory), its connection
// table, and its control block and flag words (tcp stores arriving flags and abort records).
struct ProxySide {
  Registry* reg;
  const std::vector<ConnInfo>& conns;
  uint64_t ctl, flags;
};

// The one way a proxy takes a transport (Proxy::attach), in the manner of NCCL's
// `struct ncclTransport` table: Python sets the transport up (sparkccl/transport/), then
// hands the proxy one of these, and the proxy builds its Transport from it, once, before
// start(). shm and tcp below; verbs: VerbsEndpoint (verbs_transport.h).
class TransportFactory {
 public:
  virtual ~TransportFactory() = default;
  virtual const char* kind() const = 0;
  // Throws std::invalid_argument when the factory does not fit the proxy.
  virtual std::unique_ptr<Transport> make(const ProxySide& side) = 0;
};

// shm: peers' segments are mapped in this process; one ordered copy worker per connection.
class ShmFactory final : public TransportFactory {
 public:
  explicit ShmFactory(uint64_t spin_us = 0) : spin_ns_(spin_us * 1000) {}
  const char* kind() const override { return "shm"; }
  std::unique_ptr<Transport> make(const ProxySide& side) override;

 private:
  uint64_t spin_ns_;  // each copy worker's spin after its last operation (then it sleeps)
};

// tcp: connected, authenticated sockets from Python (sparkccl/transport/tcp.py): send_fds[i]
// carries connection i; each incoming socket is a row [fd, peer, channel, root] (the peer
// that sends on it, the local channel / root it arrives on). The factory owns the
// descriptors from its construction: the transport made from it takes them; a refused
// make() closes them, and so does the destructor of a factory never used.
class TcpFactory final : public TransportFactory {
 public:
  TcpFactory(std::vector<int> send_fds, const std::vector<std::vector<int64_t>>& recv);
  ~TcpFactory() override;
  TcpFactory(const TcpFactory&) = delete;
  TcpFactory& operator=(const TcpFactory&) = delete;
  const char* kind() const override { return "tcp"; }
  std::unique_ptr<Transport> make(const ProxySide& side) override;

 private:
  void close_all();
  std::vector<int> send_fds_;
  std::vector<std::vector<int64_t>> recv_;
};

// Takes a mutex held only for moments (OrderedQueue::mu: a push_back, a swap): tries for a
// while before it blocks. A contended std::mutex sleeps at once (a futex wait), and its
// holder's unlock then pays a futex wake and the sleeper a wake-up, microseconds each; the
// proxy's push and a spinning copy worker's take meet there several times per post (the
// post's pushes come back to back). 256 tries are far longer than such a hold.
inline void lock_briefly(std::mutex& mu) {
  for (int k = 0; k < 256; ++k) {
    if (mu.try_lock()) return;
    cpu_relax();
  }
  mu.lock();
}

// The queue in front of one connection's worker thread (shm copy worker, tcp sender): the
// proxy pushes operations in stream order, the worker takes them in batches under `mu`
// and sleeps on `cv` while `waiting` (its own wait predicate: each transport adds states).
// posted / done count operations, so the proxy can tell when a connection is drained.
template <class Op>
struct OrderedQueue {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Op> queue;
  bool waiting = false;
  std::atomic<uint64_t> posted{0};
  // Operations put in the queue so far, counted under mu after the push_back: what a
  // spinning worker watches, so that when it sees the count move, the operation is there.
  // (posted moves before the lock, so that outstanding() never counts an operation done
  // before it counted it posted; a worker that went by posted could take mu ahead of the
  // push, find the queue empty and block on cv: a futex wake in the push and a wake-up for
  // the worker, each flag's way several microseconds longer.)
  std::atomic<uint64_t> queued{0};
  alignas(64) std::atomic<uint64_t> done{0};  // (the worker's: not on the proxy's line)
  alignas(64) std::vector<Op> deferred;        // (the pushing thread's own: defer)

  // An operation held back until the pushing thread's next push(), which puts it in the
  // queue ahead of its own under the same lock: the shm transport's writes wait for their
  // post's flag, so the worker takes the post in one batch. (Pushed one by one, every write
  // took the lock from a spinning worker that had just taken the last: ~0.3 us each, 2.4 us
  // of an 8 KiB world-2 post's eight writes on the H200 machine, benchmarks/
  // decode_latency_h200.txt.) Counted in posted at once, so outstanding() stays exact.
  void defer(const Op& op) {
    posted.fetch_add(1, std::memory_order_relaxed);
    deferred.push_back(op);
  }

  void push(const Op& op) {
    bool wake;
    posted.fetch_add(1, std::memory_order_relaxed);
    lock_briefly(mu);
    {
      std::lock_guard<std::mutex> lk(mu, std::adopt_lock);
      const uint64_t n = deferred.size() + 1;
      queue.insert(queue.end(), deferred.begin(), deferred.end());
      queue.push_back(op);
      queued.store(queued.load(std::memory_order_relaxed) + n, std::memory_order_release);
      wake = waiting;
    }
    deferred.clear();
    if (wake) cv.notify_one();
  }

  uint64_t outstanding() const {
    return posted.load(std::memory_order_relaxed) - done.load(std::memory_order_acquire);
  }
};

// put_call's bounds: the entry lies in the call words. False with *cause otherwise.
inline bool call_entry_in_range(const Registry& reg, uint64_t word, uint64_t n,
                                std::string* cause) {
  if (n >= 1 && n <= layout::CALL_ENTRY_WORDS && word >= reg.num_flags &&
      word + layout::CALL_ENTRY_WORDS <= reg.num_words)
    return true;
  *cause = "call entry of " + std::to_string(n) + " words at word " + std::to_string(word) +
           " outside the call words [" + std::to_string(reg.num_flags) + ", " +
           std::to_string(reg.num_words) + ")";
  return false;
}

// put_lines' bounds: whole 8-byte halves inside the LL area. False with *cause otherwise.
inline bool lines_in_range(const Registry& reg, uint64_t off, uint64_t len, std::string* cause) {
  if (off % 8 == 0 && len % 8 == 0 && off <= reg.ll_bytes && len <= reg.ll_bytes - off)
    return true;
  *cause = "LL lines [" + std::to_string(off) + ", " + std::to_string(off + len) +
           ") not whole 8-byte halves inside the LL area (" + std::to_string(reg.ll_bytes) +
           " bytes)";
  return false;
}

// LL lines into memory a GPU may be polling: one 8-byte store per half, so that a reader
// never sees a half's flag without its data (memcpy may store a large copy in any order and
// width: fast-string moves).
inline void store_lines(uint8_t* dst, const uint8_t* src, uint64_t len) {
  auto* d = reinterpret_cast<uint64_t*>(dst);
  const auto* s = reinterpret_cast<const uint64_t*>(src);
  for (uint64_t k = 0; k < len / 8; ++k) __atomic_store_n(d + k, s[k], __ATOMIC_RELAXED);
}

// Operations posted and not yet done over every queue of a transport.
template <class Queues>
uint64_t outstanding_in(const Queues& queues) {
  uint64_t n = 0;
  for (auto& q : queues) n += q->outstanding();
  return n;
}

}  // namespace sparkccl
