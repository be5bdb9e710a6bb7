// shm transport (docs/PROTOCOL.md "The transport contract"): ranks on one host. Each connection has one copy worker thread
// that performs its operations in order: memcpy for a write, 8-byte stores for LL lines
// (store_lines), for a flag a full fence then a
// release store of the value into the peer's flag word, and for a call entry its words'
// release stores (no fence: the entry need only precede later flags, and their fences order
// it). An idle worker spins for
// spin_ns after its last operation (the proxy's own spin, where the host has the cores:
// waking a sleeping worker is a futex call in the proxy's post, several microseconds of its
// publish -> post latency on the H200 machine, benchmarks/proxy_latency_h200.txt), then
// blocks on a condition variable (0 where many ranks share few cores: no busy waiting).
//
// A small operation on a connection whose worker has nothing left to do (every operation
// pushed so far done) is performed by the calling thread (the proxy) at once: the hand-over
// to the worker and its wake-up cost more than the copy (an 8 KiB all-reduce at world 2, a
// 4 KiB write and a flag per connection: the worker's pushed -> stored was 1.5 us p50 on
// the H200 machine, benchmarks/decode_latency_h200.txt). The connection's order holds: the
// worker is drained, and the caller's next operation comes after this one returns.
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>

#include "control.h"
#include "transport.h"

namespace sparkccl {
namespace {

struct CopyOp {
  uint8_t* dst;        // write: destination bytes; else nullptr
  const uint8_t* src;
  uint64_t len;        // write: bytes; call entry: its words
  uint64_t* flag;      // flag: the peer's word; call entry: its first word
  uint64_t value[layout::CALL_ENTRY_WORDS];  // flag: value[0]; call entry: its words
  uint64_t pushed_ns;  // a data flag: when the proxy pushed it (sampled)
  bool call;           // a call entry (put_call)
  bool lines;          // LL lines (put_lines): stored a half at a time
};

// Data flags sampled per worker (Transport::stats); one sample per data flag: a
// decode-sized post has one, so the ring holds the last thousand posts or so.
constexpr size_t FLAG_SAMPLES = 1024;

// Operations of at most this many bytes go inline where the worker is drained (above): a
// memcpy of 8 KiB from host memory a GPU just wrote takes well under the worker's hop.
constexpr uint64_t INLINE_BYTES = 8192;
// But the workers copy in parallel, one per connection, and inline copies one after the
// other: a post's burst (inline operations less than BURST_GAP_NS apart) copies at most
// BURST_BYTES inline, the rest goes to the workers. (Measured: world 2, two roots, 8 and
// 16 KiB per rank, all inline. A mesh of 8 ranks would have 14 connections' parts to copy.)
constexpr uint64_t BURST_BYTES = 16384;
constexpr uint64_t BURST_GAP_NS = 2000;

void perform(const CopyOp& op) {
  if (op.call) {
    for (uint64_t k = 0; k < op.len; ++k) store_release(op.flag + k, op.value[k]);
  } else if (op.flag) {
    std::atomic_thread_fence(std::memory_order_seq_cst);
    store_release(op.flag, op.value[0]);
  } else if (op.lines) {
    store_lines(op.dst, op.src, op.len);
  } else {
    std::memcpy(op.dst, op.src, op.len);
  }
}

struct Worker : OrderedQueue<CopyOp> {
  bool stopping = false;
  std::atomic<bool> quit{false};
  std::thread thread;
  uint64_t spin_ns = 0;
  SampleRing<FLAG_SAMPLES> flag_ring;  // written by this worker only
  SampleRing<FLAG_SAMPLES> inline_ring;  // flags stored inline, by the pushing thread only
  std::atomic<uint64_t> sleeps{0};     // cv waits (the slow path: a futex each way)

  void run() {
    std::vector<CopyOp> batch;
    uint64_t taken = 0;  // operations taken from the queue (queued counts those put in)
    for (;;) {
      if (spin_ns) {
        const uint64_t t0 = now_ns();
        while (queued.load(std::memory_order_acquire) == taken &&
               !quit.load(std::memory_order_relaxed) && now_ns() - t0 < spin_ns)
          cpu_relax();
      }
      {
        lock_briefly(mu);  // (the proxy may be pushing the post's next operation)
        std::unique_lock<std::mutex> lk(mu, std::adopt_lock);
        while (queue.empty() && !stopping) {
          waiting = true;
          sleeps.fetch_add(1, std::memory_order_relaxed);
          cv.wait(lk);
          waiting = false;
        }
        if (stopping) return;
        batch.swap(queue);
      }
      taken += batch.size();
      const uint64_t taken_ns = now_ns();  // (one clock read per batch, for the samples)
      for (const CopyOp& op : batch) {
        if (quit.load(std::memory_order_relaxed)) return;
        perform(op);
        if (op.flag && !op.call && op.pushed_ns)
          flag_ring.add(flag_sample(op.pushed_ns, taken_ns, now_ns()));
        done.fetch_add(1, std::memory_order_release);
      }
      batch.clear();
    }
  }
};

class ShmTransport final : public Transport {
 public:
  ShmTransport(Registry* reg, std::vector<ConnInfo> conns, uint64_t flags, uint64_t spin_ns)
      : reg_(reg), conns_(std::move(conns)), flags_(flags) {
    workers_.reserve(conns_.size());
    for (size_t i = 0; i < conns_.size(); ++i) {
      workers_.emplace_back(new Worker);
      workers_.back()->spin_ns = spin_ns;
    }
  }
  ~ShmTransport() override { stop(); }

  const char* name() const override { return "shm"; }

  void start() override {
    if (started_) return;
    started_ = true;
    for (auto& w : workers_) {
      Worker* wp = w.get();
      wp->thread = std::thread([wp] { wp->run(); });
    }
  }

  void stop() override {
    for (auto& w : workers_) {
      {
        std::lock_guard<std::mutex> lk(w->mu);
        w->stopping = true;
      }
      w->quit.store(true, std::memory_order_relaxed);
      w->cv.notify_all();
    }
    for (auto& w : workers_)
      if (w->thread.joinable()) w->thread.join();
  }

  bool write(int conn, int src_region, uint64_t src_off, int dst_region, uint64_t dst_off,
             uint64_t len, std::string* cause) override {
    const ConnInfo& c = conns_[size_t(conn)];
    const uint64_t src_base = reg_->local_span(src_region, src_off, len, cause);
    if (!src_base) return false;
    const uint64_t dst_base = reg_->peer_span(c.peer, dst_region, dst_off, len, cause);
    if (!dst_base) return false;
    CopyOp op{reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(dst_base + dst_off)),
              reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(src_base + src_off)), len,
              nullptr, {}, 0, false, false};
    // Queued with the post's flag (below), which always follows: one lock and one batch
    // for the worker, and one wake-up if it sleeps.
    submit(conn, op);
    return true;
  }

  bool flag(int conn, uint64_t word, uint64_t value, std::string* cause) override {
    if (word >= reg_->num_flags) {
      *cause = "flag word " + std::to_string(word) + " out of range (" +
               std::to_string(reg_->num_flags) + " words)";
      return false;
    }
    uint64_t* at = peer_word(conn, word, cause);
    if (!at) return false;
    CopyOp op{nullptr, nullptr, 0, at, {value}, now_ns(), false, false};
    submit(conn, op);
    return true;
  }

  // One operation for the whole entry (one push, and no fence per word: it needs to precede
  // only the connection's later flags, whose own fences see to that).
  bool put_call(int conn, uint64_t word, const uint64_t* values, uint64_t n,
                std::string* cause) override {
    if (!call_entry_in_range(*reg_, word, n, cause)) return false;
    uint64_t* at = peer_word(conn, word, cause);
    if (!at) return false;
    CopyOp op{nullptr, nullptr, n, at, {}, 0, true, false};
    for (uint64_t k = 0; k < n; ++k) op.value[k] = values[k];
    submit(conn, op);
    return true;
  }

  // From this rank's LL area to the peer's, mapped here; deferred like a write (the post's
  // flag follows).
  bool put_lines(int conn, uint64_t off, uint64_t len, std::string* cause) override {
    if (!lines_in_range(*reg_, off, len, cause)) return false;
    uint64_t* at = peer_word(conn, 0, cause);
    if (!at) return false;
    const uint64_t to = reinterpret_cast<uintptr_t>(at) + reg_->ll_off + off;
    CopyOp op{reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(to)),
              reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(flags_ + reg_->ll_off + off)),
              len, nullptr, {}, 0, false, true};
    submit(conn, op);
    return true;
  }

  bool poll(int*, std::string*) override { return true; }  // memcpy cannot fail later

  void stats(Stats* out) const override {
    for (auto& w : workers_) {
      out->flags_sampled += w->flag_ring.read(&out->flag_samples);
      out->flags_sampled += w->inline_ring.read(&out->flag_samples);
      out->worker_sleeps += w->sleeps.load(std::memory_order_relaxed);
    }
  }

 private:
  // An operation on connection conn: performed here if small and the worker is drained (see
  // the file's head), else queued: deferred (bytes to copy, which their post's flag follows)
  // or pushed (a flag, a call entry).
  void submit(int conn, const CopyOp& op) {
    Worker& w = *workers_[size_t(conn)];
    const uint64_t bytes = op.len;  // (0 for a flag or a call entry)
    // (posted counts what this thread queued, deferred ones included: equal to done, the
    // worker has performed all of it, and the acquire orders those stores before ours)
    if (bytes <= INLINE_BYTES &&
        w.posted.load(std::memory_order_relaxed) == w.done.load(std::memory_order_acquire)) {
      const uint64_t t0 = bytes ? now_ns() : 0;
      if (bytes && t0 - burst_end_ns_ > BURST_GAP_NS) burst_bytes_ = 0;
      if (burst_bytes_ + bytes <= BURST_BYTES) {
        burst_bytes_ += bytes;
        perform(op);
        const uint64_t t = bytes || (op.flag && !op.call) ? now_ns() : 0;
        if (bytes) burst_end_ns_ = t;
        if (op.flag && !op.call)
          w.inline_ring.add(flag_sample(op.pushed_ns, op.pushed_ns, t > op.pushed_ns ? t : op.pushed_ns + 1));
        return;
      }
    }
    if (op.dst) w.defer(op);
    else w.push(op);
  }

  // The peer's word (from FLAGS_OFFSET) as mapped here, or nullptr and *cause.
  uint64_t* peer_word(int conn, uint64_t word, std::string* cause) {
    const ConnInfo& c = conns_[size_t(conn)];
    uint64_t flags = reg_->peers[c.peer].flags.load(std::memory_order_acquire);
    if (!flags) {
      *cause = "peer's flag words are not mapped";
      return nullptr;
    }
    return word_at(flags, word * layout::FLAG_BYTES);
  }

 public:

  uint64_t outstanding() const override { return outstanding_in(workers_); }

 private:
  Registry* reg_;
  std::vector<ConnInfo> conns_;
  const uint64_t flags_;  // this rank's flag words (the LL area lies past them)
  uint64_t burst_bytes_ = 0, burst_end_ns_ = 0;  // submit's inline burst (the posting thread's)
  std::vector<std::unique_ptr<Worker>> workers_;
  bool started_ = false;
};

}  // namespace

std::unique_ptr<Transport> ShmFactory::make(const ProxySide& side) {
  return std::unique_ptr<Transport>(new ShmTransport(side.reg, side.conns, side.flags, spin_ns_));
}

}  // namespace sparkccl
