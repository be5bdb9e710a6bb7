// The proxy: executes a rank's stream tables (docs/PROTOCOL.md "Streams").
//
// One thread. Each turn it consumes new publish-ring entries (strictly in index order),
// then lets every stream post at most one piece whose trigger holds, then (every ~100 ms)
// watches the peers. It spins while there is progress and for spin_us after, then naps
// nap_us per turn. Any failure sets the abort word (first writer wins) and stops posting.
#include "proxy.h"

#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "control.h"

namespace sparkccl {

using namespace layout;

namespace {

const char* op_name(int op) { return op == 0 ? "AG" : op == 1 ? "RS" : "?"; }

void need(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("Proxy: " + what);
}

constexpr uint64_t WATCH_NS = 100000000ull;  // peer liveness / abort check period
constexpr int ENTRIES_PER_TURN = 1;           // publish entries consumed per loop turn
// A collective whose slice goes in one hand-off (protocol.h ONE_HANDOFF_SLICE) is posted in
// one go: its ring entries, published together, are read in one turn, and a stream posts
// every ready piece's writes behind one flag of the last one's value (a flag says its piece
// and every one before it: every wait is flag >= value). Eight posts, flags and turns per
// stream cost a decode-sized collective more than its bytes.
constexpr uint64_t BATCH_SLICE = gpu::ONE_HANDOFF_SLICE;
constexpr size_t MAX_SAMPLES = 4096;
constexpr size_t MAX_PENDING = 1024;  // collectives per op the proxy keeps track of

// Whether a process still runs. kill(pid, 0) also succeeds for a zombie (exited, not yet
// reaped by its parent, e.g. a launcher that polls its children slowly), so check the
// state letter in /proc as well where there is one.
bool pid_alive(uint64_t pid) {
  if (kill(pid_t(pid), 0) != 0 && errno == ESRCH) return false;
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%llu/stat", static_cast<unsigned long long>(pid));
  FILE* f = std::fopen(path, "r");
  if (!f) return true;
  char buf[512];
  size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* paren = std::strrchr(buf, ')');
  if (!paren || paren[1] != ' ') return true;
  char state = paren[2];
  return state != 'Z' && state != 'X';
}

}  // namespace

Proxy::Proxy(int rank, int world, uint64_t ctl, uint64_t flags,
             const std::vector<std::vector<int64_t>>& connections,
             const std::vector<std::vector<int64_t>>& streams,
             const std::vector<std::vector<int64_t>>& items, const std::vector<int>& slots,
             uint64_t spin_us, uint64_t nap_us)
    : rank_(rank), world_(world), ctl_(ctl), flags_(flags), spin_ns_(spin_us * 1000),
      nap_ns_(nap_us * 1000),
      reg_((need(world >= 1 && world <= 1024, "world out of range"),
            need(rank >= 0 && rank < world, "rank out of range"),
            need(slots.size() == size_t(NUM_REGIONS), "slots must have 3 entries"), rank),
           world, slots) {
  need(ctl != 0 && flags != 0, "null control or flags address");
  for (int s : slots) need(s >= 1, "slots must be >= 1");
  const uint64_t nflags = reg_.num_flags;
  for (auto& c : connections) conns_.push_back(conn_from_row(c, rank, world, "Proxy"));
  for (auto& it : items) {
    need(it.size() == 9, "item rows have 9 fields");
    need(it[0] >= 0 && it[0] < NUM_REGIONS && it[2] >= 0 && it[2] < NUM_REGIONS,
         "item region out of range");
    need(it[1] >= 0 && it[3] >= 0, "item block negative");
    need(it[5] >= 1 && it[5] <= 2 && it[4] >= 0 && it[4] < it[5], "item root/roots invalid");
    need(it[7] >= 1 && it[7] <= 2 && it[6] >= 0 && it[6] < it[7], "item half/halves invalid");
    need(it[8] >= 0 && it[8] < world, "item target out of range");
    items_.push_back(ItemRow{int(it[0]), int(it[1]), int(it[2]), int(it[3]), int(it[4]),
                             int(it[5]), int(it[6]), int(it[7]), int(it[8])});
  }
  for (auto& s : streams) {
    need(s.size() == 7, "stream rows have 7 fields");
    need(s[0] >= 0 && s[0] < NUM_OPS, "stream op out of range");
    need(s[1] >= 0 && size_t(s[1]) < conns_.size(), "stream connection out of range");
    need(s[2] >= 0 && uint64_t(s[2]) < nflags, "stream dst_flag out of range");
    need(s[3] == 0 || s[3] == 1, "stream trigger kind must be 0 or 1");
    if (s[3] == 0)
      need(s[4] > 0 && s[4] < (int64_t(1) << 32), "publish trigger chunk mask out of range");
    else
      need(s[4] >= 0 && uint64_t(s[4]) < nflags, "relay trigger flag word out of range");
    need(s[5] >= 0 && s[6] >= 0 && size_t(s[5] + s[6]) <= items_.size(),
         "stream items out of range");
    StreamRow row{int(s[0]), int(s[1]), uint64_t(s[2]), int(s[3]), uint64_t(s[4]),
                  size_t(s[5]), size_t(s[6])};
    ops_[row.op].streams.push_back(streams_.size());
    if (row.kind == 0)
      send_chunks_[row.op] |= uint32_t(row.arg);
    else
      relays_ = true;
    streams_.push_back(row);
  }
  for (auto& own : streams_)
    for (size_t k = 0; k < streams_.size(); ++k)
      if (own.kind == 0 && streams_[k].kind == 1 && streams_[k].op == own.op &&
          streams_[k].conn == own.conn)
        own.relays.push_back(k);
  // flag_word(op, origin, channel, root): the origin of a stream's data is in its dst_flag
  std::vector<std::pair<int, int>> keys;
  for (auto& row : streams_) {
    row.origin = int(row.dst_flag / (CHANNELS * MAX_ROOTS) % uint64_t(world));
    const std::pair<int, int> key{row.conn, row.origin};
    auto at = std::find(keys.begin(), keys.end(), key);
    row.call_key = size_t(at - keys.begin());
    if (at == keys.end()) keys.push_back(key);
  }
  calls_sent_.assign(keys.size(), 0);
  samples_.reserve(MAX_SAMPLES);
}

void Proxy::attach(TransportFactory& source) {
  std::lock_guard<std::mutex> lk(life_mu_);
  if (transport_ || started_ || stop_.load())
    throw std::invalid_argument(std::string("Proxy: attach(") + source.kind() +
                                "): a transport is attached already, or the proxy has started "
                                "or stopped");
  transport_ = source.make(ProxySide{&reg_, conns_, ctl_, flags_});
}

void Proxy::set_relay_lead(int pieces) {
  std::lock_guard<std::mutex> lk(life_mu_);
  need(!started_ && !stop_.load(), "set_relay_lead: before start()");
  need(pieces >= -1 && pieces < geom::PIECES, "set_relay_lead: -1 (off) .. PIECES - 1");
  relay_lead_ = pieces;
}

void Proxy::set_gpu_streams(const std::vector<int64_t>& streams) {
  std::lock_guard<std::mutex> lk(life_mu_);
  need(!started_ && !stop_.load(), "set_gpu_streams: before start()");
  for (int64_t k : streams) {
    need(k >= 0 && size_t(k) < streams_.size(), "set_gpu_streams: stream index out of range");
    need(streams_[size_t(k)].kind == 0,
         "set_gpu_streams: stream " + std::to_string(k) + " is relay-triggered (only publish-"
         "triggered streams can be executed by the data plane)");
  }
  for (auto& s : streams_) s.gpu = false;
  for (int64_t k : streams) streams_[size_t(k)].gpu = true;
  for (auto& o : ops_) {
    o.publish_on_gpu = true;
    for (size_t k : o.streams)
      if (streams_[k].kind == 0 && !streams_[k].gpu) o.publish_on_gpu = false;
  }
}

Proxy::~Proxy() { stop(); }

void Proxy::set_region(int region, uint64_t base, uint64_t stride, uint64_t size) {
  need(region >= 0 && region < NUM_REGIONS, "region out of range");
  reg_.stride[region].store(stride, std::memory_order_release);
  reg_.size[region].store(size, std::memory_order_release);
  reg_.base[region].store(base, std::memory_order_release);
}

void Proxy::set_peer(int peer, uint64_t ctl, uint64_t flags, uint64_t pid) {
  need(peer >= 0 && peer < world_ && peer != rank_, "peer out of range");
  auto& p = reg_.peers[peer];
  p.ctl.store(ctl, std::memory_order_release);
  p.flags.store(flags, std::memory_order_release);
  p.pid.store(pid, std::memory_order_release);
}

void Proxy::set_peer_region(int peer, int region, uint64_t base, uint64_t size) {
  need(peer >= 0 && peer < world_ && peer != rank_, "peer out of range");
  need(region >= 0 && region < NUM_REGIONS, "region out of range");
  reg_.peers[peer].size[region].store(size, std::memory_order_release);
  reg_.peers[peer].base[region].store(base, std::memory_order_release);
}

void Proxy::start() {
  std::lock_guard<std::mutex> lk(life_mu_);
  if (stop_.load()) throw std::runtime_error("Proxy: cannot start a stopped proxy");
  if (started_) return;
  if (!transport_)
    throw std::runtime_error("Proxy: no transport attached before start() (Proxy.attach)");
  started_ = true;
  for (auto& o : ops_) {
    o.ll_ok = !o.streams.empty();
    for (size_t k : o.streams)
      if (streams_[k].kind != 0 || streams_[k].gpu) o.ll_ok = false;
  }
  tail_ = load_acquire(word_at(ctl_, CTL_RING_TAIL));
  transport_->start();
  try {
    thread_ = std::thread([this] { run(); });
  } catch (...) {
    transport_->stop();
    stop_.store(true);
    throw;
  }
}

void Proxy::stop(bool graceful) {
  std::lock_guard<std::mutex> lk(life_mu_);
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
  // Once: a later stop() (the destructor's) must not touch the control block, which the
  // owner may have unmapped after the first stop().
  if (stopped_) return;
  stopped_ = true;
  if (transport_) {
    if (graceful && started_ && abort_code(ctl_) == ABORT_NONE) transport_->finish();
    // Failed, and the proxy thread ended before it saw it: tell the peers now.
    if (started_ && !abort_told_ && abort_code(ctl_) != ABORT_NONE) {
      abort_told_ = true;
      transport_->on_abort(error_text(ctl_));
    }
    transport_->stop();
  }
}

uint64_t Proxy::outstanding() const { return transport_ ? transport_->outstanding() : 0; }

void Proxy::fail(uint64_t code, const std::string& message) {
  set_abort(ctl_, code, message);
  aborted_ = true;
}

void Proxy::run() {
  try {
    uint64_t last_progress = now_ns();
    uint64_t last_watch = last_progress;
    uint64_t idle_turns = 0;
    while (!stop_.load(std::memory_order_relaxed)) {
      n_turns_.fetch_add(1, std::memory_order_relaxed);
      if (!aborted_ && abort_code(ctl_) != ABORT_NONE) aborted_ = true;
      if (aborted_ && !abort_told_) {
        abort_told_ = true;
        transport_->on_abort(error_text(ctl_));
      }
      bool progress = consume_ring();
      if (!aborted_) progress |= advance_streams();
      if (progress) note_delivered();
      if (!aborted_) {
        int conn = -1;
        std::string cause;
        if (!transport_->poll(&conn, &cause)) {
          const ConnInfo& c = conns_[size_t(conn)];
          fail(ABORT_TRANSPORT, "rank " + std::to_string(rank_) + ": " + transport_->name() +
                                    " transport: connection " + std::to_string(conn) +
                                    " (peer " + std::to_string(c.peer) + ", channel " +
                                    std::to_string(c.channel) + ", root " +
                                    std::to_string(c.root) + "): " + cause);
        }
      }
      uint64_t t = now_ns();
      if (progress) last_progress = t;
      if (t - last_watch >= WATCH_NS) {
        last_watch = t;
        if (!aborted_) watch();
      }
      if (!aborted_ && t - last_progress < spin_ns_) {
        if (progress) {
          idle_turns = 0;
        } else if (++idle_turns % 64 == 0) {
          sched_yield();
        } else {
          cpu_relax();
        }
      } else {
        n_naps_.fetch_add(1, std::memory_order_relaxed);
        sleep_ns(nap_ns_ ? nap_ns_ : 1000);
      }
    }
  } catch (const std::exception& e) {
    fail(ABORT_TRANSPORT, "rank " + std::to_string(rank_) + ": proxy thread failed: " + e.what());
  } catch (...) {
    fail(ABORT_TRANSPORT, "rank " + std::to_string(rank_) + ": proxy thread failed");
  }
}

bool Proxy::consume_ring() {
  bool progress = false;
  uint64_t* tail_word = word_at(ctl_, CTL_RING_TAIL);
  // One entry per turn: a collective's 8 entries appear at once where its pieces are small,
  // and reading all of them (a cache miss each: the GPU wrote them) before advance_streams
  // comes first would hold piece 0's post back. (Its effect on piece 0's entry consumed ->
  // posted was within the spread on the H200, 1.3-1.9 us p50; proxy_latency_h200.txt.)
  // More than ENTRIES_PER_TURN only for the rest of a one-hand-off collective (BATCH_SLICE).
  uint64_t batch_seq = 0;
  uint32_t batch_op = uint32_t(NUM_OPS);
  for (int k = 0;; ++k) {
    uint64_t ent = ctl_ + RING_OFFSET + (tail_ % RING_ENTRIES) * RING_ENTRY_BYTES;
    if (load_acquire(word_at(ent, ENT_TAG)) != tail_ + 1) break;
    uint64_t seq = *word_at(ent, ENT_SEQ);
    uint64_t slice = *word_at(ent, ENT_SLICE);
    // (the call word's other bytes, dtype, kind and padding, are for the peers' check:
    // send_call)
    const uint64_t call = *word_at(ent, ENT_OP);
    const uint32_t op = uint32_t(call & 0xFF);
    const uint32_t piece = uint32_t(call >> CALL_PIECE_SHIFT & 0xFF);
    uint32_t granule;
    int32_t chunk;
    if (k >= ENTRIES_PER_TURN && !(op == batch_op && seq == batch_seq)) break;
    if (slice <= BATCH_SLICE) {
      batch_op = op;
      batch_seq = seq;
    } else {
      batch_op = uint32_t(NUM_OPS);
    }
    std::memcpy(&chunk, reinterpret_cast<const void*>(static_cast<uintptr_t>(ent + ENT_CHUNK)), 4);
    std::memcpy(&granule,
                reinterpret_cast<const void*>(static_cast<uintptr_t>(ent + ENT_GRANULE)), 4);
    // Taken and cleared before the slot is handed back: a publisher that does not stamp
    // (the GPU kernels) must not leave an earlier lap's stamp behind.
    uint64_t publish_ns = *word_at(ent, ENT_PUBLISH_NS);
    *word_at(ent, ENT_PUBLISH_NS) = 0;
    uint64_t index = tail_;
    // (CHUNK_WHOLE stands for pieces 0..piece, at piece 0's index: their indices are done)
    tail_ += chunk == CHUNK_WHOLE && piece < uint32_t(geom::PIECES) ? piece + 1 : 1;
    store_release(tail_word, tail_);
    n_entries_.fetch_add(1, std::memory_order_relaxed);
    progress = true;

    auto bad = [&](const std::string& why) {
      if (!aborted_)
        fail(ABORT_TRANSPORT, "rank " + std::to_string(rank_) + ": proxy: bad publish entry " +
                                  std::to_string(index) + " (op " + std::to_string(op) +
                                  ", seq " + std::to_string(seq) + ", piece " +
                                  std::to_string(piece) + ", chunk " + std::to_string(chunk) +
                                  "): " + why);
    };
    if (op >= uint32_t(NUM_OPS)) { bad("op out of range"); continue; }
    if (piece >= uint32_t(geom::PIECES)) { bad("piece out of range"); continue; }
    if (chunk < CHUNK_WHOLE || chunk >= 32) { bad("chunk out of range"); continue; }
    if (granule == 0) { bad("granule is 0"); continue; }

    OpState& o = ops_[op];
    Coll* c = nullptr;
    for (auto& h : o.hist)
      if (h.seq == seq) { c = &h; break; }
    if (!c) {
      if (o.any && seq <= o.last_seq) {  // a collective every stream is done with
        n_stale_.fetch_add(1, std::memory_order_relaxed);
        continue;
      }
      if (o.hist.size() >= MAX_PENDING) {
        bad("more than " + std::to_string(MAX_PENDING) + " collectives of this op are pending "
            "(a stream is stuck at collective seq " + std::to_string(o.hist.front().seq) + ")");
        continue;
      }
      Coll fresh{};
      fresh.seq = seq;
      fresh.slice = slice;
      fresh.granule = granule;
      fresh.call = call;
      o.hist.push_back(fresh);
      o.any = true;
      o.last_seq = seq;
      c = &o.hist.back();
    } else if (c->slice != slice || c->granule != granule) {
      bad("slice/granule differ from the collective's first entry (" +
          std::to_string(c->slice) + "/" + std::to_string(c->granule) + ")");
      continue;
    }
    if (chunk == -2 && !o.publish_on_gpu) {
      bad("the data plane sent this piece itself (GPU-direct), but not every publish-triggered "
          "stream of the op was given to set_gpu_streams: their flag words would have two "
          "writers");
      continue;
    }
    if (chunk == CHUNK_LL) {
      if (!o.ll_ok) {
        bad("LL lines through the proxy need every stream of the op publish-triggered (no "
            "relays: a mesh) and none executed by the data plane");
        continue;
      }
      if (2 * slice > LL_SOURCE_BYTES) {
        bad("a slice of " + std::to_string(slice) + " bytes does not fit an LL block (" +
            std::to_string(LL_SOURCE_BYTES) + " bytes of lines)");
        continue;
      }
    }
    if ((chunk == CHUNK_LL) != (c->ll != 0)) {  // (then: was any piece consumed before?)
      uint32_t earlier = c->all | c->direct;
      for (uint32_t m : c->chunks) earlier |= m;
      if (earlier) {
        bad("LL lines and other pieces in one collective");
        continue;
      }
    }
    const uint32_t first = chunk == CHUNK_WHOLE ? 0 : piece;
    for (uint32_t q = first; q <= piece; ++q)
      if (!c->seen_ns[q]) {
        c->seen_ns[q] = q == first ? now_ns() : c->seen_ns[first];
        c->publish_ns[q] = publish_ns;
      }
    const uint8_t pieces = uint8_t((2u << piece) - (1u << first));
    if (chunk == CHUNK_DIRECT) c->direct |= pieces;
    if (chunk == CHUNK_LL) c->ll |= pieces;
    if (chunk < 0)
      c->all |= pieces;
    else
      c->chunks[piece] |= 1u << chunk;
  }
  if (progress) trim();
  return progress;
}

bool Proxy::advance_streams() {
  bool progress = false;
  for (StreamRow& s : streams_) {
    OpState& o = ops_[s.op];
    uint64_t idx = s.coll - o.base;
    if (idx >= o.hist.size()) continue;  // collective not issued here yet
    Coll& c = o.hist[idx];
    // A collective that leaves root 1 idle (geom::root1_idle: its pieces all go whole on
    // root 0): root 1's streams, relays too, send nothing for it, no call entry, no flag, and
    // nobody waits for their words. (A flag alone there still cost the H200's proxy path
    // 2.2 us on an 8 KiB all-reduce.)
    if (conns_[size_t(s.conn)].root == 1 && geom::root1_idle(c.slice, c.granule)) {
      s.piece = 0;
      ++s.coll;
      progress = true;
      continue;
    }
    const int p = s.piece;
    const uint64_t trigger = s.kind == 0 ? 0 : load_acquire(word_at(flags_, s.arg * FLAG_BYTES));
    auto ready = [&](int q) {
      if (s.kind != 0) return trigger >= geom::flag_value(c.seq, q);
      uint32_t mask = uint32_t(s.arg);
      return ((c.all >> q) & 1u) || (c.chunks[q] & mask) == mask;
    };
    if (!ready(p)) continue;
    // CHUNK_LL (o.ll_ok: publish streams only): the collective goes out whole, once every
    // piece's entry is in and the lines say they are written.
    if (c.ll && (c.all != uint8_t((1u << geom::PIECES) - 1) || !lines_written(c))) continue;
    // set_relay_lead: a publish stream's pieces all become ready at once (the data plane
    // publishes faster than a link drains), and a connection's queue is FIFO: posted
    // together they hold back the pieces this rank relays on the same connection, and with
    // them every rank further along the ring (benchmarks/efficiency_breakdown.txt, ring
    // world 6). So an own piece goes out only while the connection's relay streams are at
    // most relay_lead_ pieces behind it. No cycle: a relay's piece i waits only for the
    // upstream's piece i, which waits only for relays at piece i - relay_lead_.
    if (s.kind == 0 && relay_lead_ >= 0 && !relays_caught_up(s, p)) continue;
    if (p == 0) {
      const int sent = send_call(s, c);
      if (sent < 0) return progress;
      if (sent == 0) continue;  // a relay waits for its origin's call entry (send_call)
    }
    if (s.kind == 0 && s.gpu && ((c.direct >> p) & 1u)) {
      // The data plane wrote this piece's data and flag itself: nothing to post.
      n_gpu_pieces_.fetch_add(1, std::memory_order_relaxed);
      progress = true;
      if (++s.piece == geom::PIECES) {
        s.piece = 0;
        ++s.coll;
      }
      continue;
    }
    // BATCH_SLICE: every piece ready now goes with this one (not past a piece the data
    // plane sent itself, and not under a relay lead, which meters pieces one by one).
    int last = c.ll ? geom::PIECES - 1 : p;
    if (c.slice <= BATCH_SLICE && relay_lead_ < 0)
      while (last + 1 < geom::PIECES && ready(last + 1) &&
             !(s.kind == 0 && s.gpu && ((c.direct >> (last + 1)) & 1u)))
        ++last;
    if (!post_pieces(s, c, p, last)) return progress;
    if (s.kind == 0) {
      uint64_t t = now_ns();
      for (int q = p; q <= last; ++q) {
        if ((c.posted >> q) & 1u) continue;
        c.posted |= uint8_t(1u << q);
        if (c.seen_ns[q])
          record_delay(t - c.seen_ns[q],
                       c.publish_ns[q] && c.publish_ns[q] <= t ? t - c.publish_ns[q] : 0, q == 0);
      }
    }
    progress = true;
    s.piece = last;
    if (++s.piece == geom::PIECES) {
      s.piece = 0;
      ++s.coll;
    }
  }
  if (progress) trim();
  return progress;
}

bool Proxy::relays_caught_up(const StreamRow& s, int piece) const {
  for (size_t k : s.relays) {
    const StreamRow& r = streams_[k];
    if (r.coll > s.coll) continue;
    if (r.coll < s.coll || r.piece + relay_lead_ < piece) return false;
  }
  return true;
}

bool Proxy::sized(const Coll& c) {
  return (c.call >> CALL_KIND_SHIFT & 0xFF) == KIND_ALL_TO_ALL_SIZED;
}

uint64_t Proxy::chunk_offset(int region, int block, const Coll& c) const {
  return (c.seq % reg_.slots[region]) * reg_.stride[region].load(std::memory_order_acquire) +
         uint64_t(block) * c.slice;
}

bool Proxy::own_end(int region, int block, const Coll& c, uint64_t* end,
                    std::string* cause) const {
  const uint64_t off = chunk_offset(region, block, c);
  const uint64_t base = reg_.local_span(region, off, 8, cause);
  if (!base) return false;
  uint64_t h;
  std::memcpy(&h, reinterpret_cast<const void*>(static_cast<uintptr_t>(base + off)), 8);
  *end = geom::sized_bytes(h, c.slice);
  return true;
}

// Only where this proxy sends the data: a GPU-direct data plane wrote its chunks from
// device memory.
int Proxy::own_lengths(const StreamRow& s, const Coll& c, uint64_t* words) {
  uint64_t units[CALL_SIZED_CHUNKS];
  for (uint64_t& u : units) u = CALL_LEN_UNKNOWN;
  const uint32_t want = send_chunks_[s.op];
  if (s.op == OP_RS && !(c.direct & 1u)) {
    if (!(c.all & 1u) && (c.chunks[0] & want) != want) return 0;
    for (int j = 0; j < world_ && j < int(CALL_SIZED_CHUNKS); ++j) {
      if (!(want >> j & 1u)) continue;
      uint64_t end = 0;
      std::string cause;
      if (!own_end(REGION_RS_SEND, j, c, &end, &cause)) {
        fail(ABORT_TRANSPORT, "rank " + std::to_string(rank_) + ": " + op_name(s.op) +
                                  " seq " + std::to_string(c.seq) + ": the length of chunk " +
                                  std::to_string(j) + " for its call entry: " + cause);
        return -1;
      }
      units[j] = std::min<uint64_t>((end + 15) / 16, CALL_LEN_UNKNOWN);
    }
  }
  const uint64_t tag = call_tag(c.seq) << CALL_SLICE_TAG_SHIFT;
  for (uint64_t w = 0; w < CALL_SIZED_CHUNKS / 2; ++w)
    words[w] = units[2 * w] | units[2 * w + 1] << CALL_LEN_BITS | tag;
  return 1;
}

uint64_t Proxy::relayed_end(int origin, int target, const Coll& c) const {
  if (target < 0 || uint64_t(target) >= CALL_SIZED_CHUNKS) return c.slice;
  const uint64_t word = call_entry_word(world_, origin, c.seq) + CALL_SIZED + target / 2;
  const uint64_t v = load_acquire(word_at(flags_, word * FLAG_BYTES));
  if (v >> CALL_SLICE_TAG_SHIFT != call_tag(c.seq)) return c.slice;  // (send_call checked)
  const uint64_t units = v >> (CALL_LEN_BITS * uint64_t(target % 2)) & CALL_LEN_UNKNOWN;
  return units == CALL_LEN_UNKNOWN ? c.slice : std::min(units * 16, c.slice);
}

bool Proxy::post_pieces(StreamRow& s, Coll& c, int piece, int last) {
  std::string cause;
  bool ok = true;
  const uint64_t t0 = now_ns();
  uint64_t t_write = 0;  // the first write handed to the transport
  // Each item's part of pieces piece..last, in piece order; parts that follow each other in
  // both regions (one root, one direction: the pieces are contiguous) go as one write.
  uint64_t run_src = 0, run_dst = 0, run_len = 0;
  const ItemRow* run_item = nullptr;
  auto flush = [&]() {
    if (!run_len || !ok) return;
    if (!t_write) t_write = now_ns();
    ok = c.ll ? transport_->put_lines(s.conn, run_src, run_len, &cause)
              : transport_->write(s.conn, run_item->src_region, run_src, run_item->dst_region,
                                  run_dst, run_len, &cause);
    if (ok) {
      n_writes_.fetch_add(1, std::memory_order_relaxed);
      n_bytes_.fetch_add(run_len, std::memory_order_relaxed);
    }
    run_len = 0;
  };
  // A sized all-to-all (KIND_ALL_TO_ALL_SIZED): this rank's own chunks say their length in
  // their first 8 bytes, which the data plane wrote before it published piece 0; each part is
  // cut there, so the bytes past it never travel (a piece past it sends its flag alone). A
  // relay cuts at the length the origin's call entry says (the chunk's first bytes may have
  // come over the other root, or not this way at all).
  const bool cut = sized(c);
  // CHUNK_LL: the same parts, as lines of this rank's LL block (data byte x at line byte 2 x),
  // to the same place in the peer's LL area.
  const uint64_t ll_block = c.ll ? ll_block_offset(c.seq, rank_, world_) : 0;
  for (size_t i = s.first; i < s.first + s.n && ok; ++i) {
    const ItemRow& it = items_[i];
    const uint64_t chunk_off = chunk_offset(it.src_region, it.src_block, c);
    uint64_t end = c.slice;
    if (cut && s.kind == 0 && !own_end(it.src_region, it.src_block, c, &end, &cause)) {
      ok = false;
      break;
    }
    if (cut && s.kind != 0) end = relayed_end(s.origin, it.target, c);
    for (int q = piece; q <= last && ok; ++q) {
      auto pb = geom::piece_bounds(c.slice, q, c.granule);
      auto r = geom::sub_range(pb.first, pb.second, it.root, it.roots, it.half, it.halves);
      if (r.second > end) r.second = end > r.first ? end : r.first;
      uint64_t len = r.second - r.first;
      if (!len) continue;
      uint64_t src_off = chunk_off + r.first;
      uint64_t dst_off = chunk_offset(it.dst_region, it.dst_block, c) + r.first;
      if (c.ll) {
        src_off = dst_off = ll_block + 2 * r.first;
        len *= 2;
      }
      if (run_len && run_item == &it && run_src + run_len == src_off &&
          run_dst + run_len == dst_off) {
        run_len += len;
        continue;
      }
      flush();
      run_item = &it;
      run_src = src_off;
      run_dst = dst_off;
      run_len = len;
    }
  }
  flush();
  if (ok) ok = transport_->flag(s.conn, s.dst_flag, geom::flag_value(c.seq, last), &cause);
  const uint64_t t1 = now_ns();
  n_post_ns_.fetch_add(t1 - t0, std::memory_order_relaxed);
  if (ok && t_write) {
    std::lock_guard<std::mutex> lk(samples_mu_);
    keep_sample(write_flag_, write_flag_total_, t1 - t_write);
  }
  if (!ok) {
    const ConnInfo& cn = conns_[size_t(s.conn)];
    fail(ABORT_TRANSPORT,
         "rank " + std::to_string(rank_) + ": " + transport_->name() + " transport: connection " +
             std::to_string(s.conn) + " (peer " + std::to_string(cn.peer) + ", channel " +
             std::to_string(cn.channel) + ", root " + std::to_string(cn.root) + "), " +
             op_name(s.op) + " seq " + std::to_string(c.seq) + " piece " +
             std::to_string(last) + ": " + cause);
    return false;
  }
  n_flags_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

bool Proxy::lines_written(Coll& c) {
  if (c.lines_seen) return true;
  const uint64_t* line = word_at(flags_, reg_.ll_off + ll_block_offset(c.seq, rank_, world_));
  const uint64_t f = uint64_t(uint32_t(c.seq + 1));
  for (uint64_t k = 0; k < 2 * c.slice / 8; ++k)  // (each half: {4 data bytes, the flag})
    if (__atomic_load_n(line + k, __ATOMIC_ACQUIRE) >> 32 != f) return false;
  c.lines_seen = true;
  return true;
}

// The cross-rank check's delivery (docs/PROTOCOL.md "Call words"): before the first piece
// of a collective that a stream sends (the data plane's GPU-direct pieces too), the call
// entry of the stream's origin for that seq goes to the peer's call words: this rank's own
// entry for its data, the origin's (in this rank's call words) for a relay. The transport
// orders it before the piece's flag, so a rank that saw a source's flag finds the source's
// own entry, however many hops away. Once per (connection, origin) and seq: an
// all-reduce's RS and AG streams share one.
// A relay's trigger flag normally arrives after the origin's entry (the same ordering one
// hop back); where the origin's GPU wrote that flag itself (GPU-direct, CUDA over shm) the
// entry comes from the origin's proxy a moment later, and the relay waits for it: 0 ("not
// yet"). It always comes (an origin's proxy sends its own entry whatever its peers do), so
// the wait is bounded. -1: the transport failed (the communicator has failed); 1: go on.
int Proxy::send_call(const StreamRow& s, const Coll& c) {
  uint64_t& sent = calls_sent_[s.call_key];
  if (sent == c.seq + 1) return 1;
  uint64_t entry[CALL_ENTRY_WORDS];
  const uint64_t word = call_entry_word(world_, s.origin, c.seq);
  // The lengths' words travel only where a relay cuts at them (a sized all-to-all on a
  // plan with relays, the same on every rank of it): two more words on every connection of
  // every small collective cost tcp ~0.1 ms a call on two cores.
  const uint64_t n = relays_ && sized(c) ? CALL_ENTRY_WORDS : CALL_SIZED;
  if (s.origin == rank_) {
    entry[CALL_TAGGED] = call_tagged(c.call, c.seq);
    entry[CALL_SLICE] = call_slice(c.slice, c.seq);
    if (n == CALL_ENTRY_WORDS) {
      const int got = own_lengths(s, c, entry + CALL_SIZED);
      if (got <= 0) return got;
    }
  } else {
    for (uint64_t k = 0; k < n; ++k)
      entry[k] = load_acquire(word_at(flags_, (word + k) * FLAG_BYTES));
    const uint64_t want = call_tag(c.seq);
    uint64_t tags[CALL_ENTRY_WORDS];
    tags[CALL_TAGGED] =
        (entry[CALL_TAGGED] & 0xFF) | (entry[CALL_TAGGED] >> CALL_PIECE_SHIFT & 0xFF) << 8;
    for (uint64_t k = CALL_SLICE; k < n; ++k) tags[k] = entry[k] >> CALL_SLICE_TAG_SHIFT;
    bool mine = true;
    for (uint64_t k = 0; k < n; ++k) mine = mine && tags[k] == want;
    if (!mine) {
      // A later seq's entry in the slot (the origin is CALL_SLOTS collectives on, which the
      // collectives' dependencies rule out): nothing to forward, and nothing to wait for.
      for (uint64_t k = 0; k < n; ++k)
        if (tags[k] != want && ((tags[k] - want) & CALL_TAG_MASK) < CALL_TAG_MASK / 2)
          return 1;
      return 0;
    }
  }
  const ConnInfo& cn = conns_[size_t(s.conn)];
  std::string cause;
  if (!transport_->put_call(s.conn, word, entry, n, &cause)) {
    fail(ABORT_TRANSPORT,
         "rank " + std::to_string(rank_) + ": " + transport_->name() + " transport: connection " +
             std::to_string(s.conn) + " (peer " + std::to_string(cn.peer) + ", channel " +
             std::to_string(cn.channel) + ", root " + std::to_string(cn.root) + "), " +
             op_name(s.op) + " seq " + std::to_string(c.seq) + " call entry of rank " +
             std::to_string(s.origin) + ": " + cause);
    return -1;
  }
  sent = c.seq + 1;
  n_calls_.fetch_add(1, std::memory_order_relaxed);
  return 1;
}

void Proxy::trim() {
  for (auto& o : ops_) {
    uint64_t low = o.base + o.hist.size();
    for (size_t k : o.streams) low = std::min(low, streams_[k].coll);
    while (o.base < low && !o.hist.empty()) {
      o.hist.pop_front();
      ++o.base;
    }
  }
}

uint64_t Proxy::issued() const {
  uint64_t n = 0;
  for (auto& o : ops_)
    if (o.any) n = std::max(n, o.last_seq + 1);
  return n;
}

void Proxy::note_delivered() {
  // trim() drops a collective once every stream of its op is past it: no collective held
  // means every one consumed so far went out whole.
  for (auto& o : ops_)
    if (!o.hist.empty()) return;
  delivered_.store(issued(), std::memory_order_release);
}

void Proxy::watch() {
  for (int p = 0; p < world_ && !aborted_; ++p) {
    if (p == rank_) continue;
    auto& peer = reg_.peers[p];
    uint64_t pid = peer.pid.load(std::memory_order_acquire);
    uint64_t pctl = peer.ctl.load(std::memory_order_acquire);
    // A peer that left without close() (CTL_LEFT, shm: its control segment is mapped
    // here) delivered its collectives 0..left-2 first: this rank needs nothing more from it
    // until it is itself past them, whether its process still runs or not.
    const bool peer_aborted = pctl && abort_code(pctl) != ABORT_NONE;
    const uint64_t left = pid && pctl && !peer_aborted ? load_acquire(word_at(pctl, CTL_LEFT)) : 0;
    if (left && issued() >= left) {
      fail(ABORT_PEER, "rank " + std::to_string(rank_) + ": peer " + std::to_string(p) +
                           " (pid " + std::to_string(pid) + ") left the communicator without "
                           "close() " +
                           (left > 1 ? "after seq " + std::to_string(left - 2)
                                     : "before its first collective") +
                           "; this rank is at seq " + std::to_string(issued() - 1));
      break;
    }
    if (pid && !left && !pid_alive(pid)) {
      // A peer that aborted and then exited left its cause in its control segment (still
      // mapped here): name it, not just the exit (rank 0 failing on rank 2's death, then
      // exiting, would otherwise be reported to rank 1 as rank 0's death).
      std::string why = "rank " + std::to_string(rank_) + ": peer " + std::to_string(p) +
                        " (pid " + std::to_string(pid) + ") exited";
      if (peer_aborted) why += " after it aborted: " + error_text(pctl);
      fail(ABORT_PEER, why);
      break;
    }
    if (pctl && abort_code(pctl) != ABORT_NONE) {
      fail(ABORT_PEER, "rank " + std::to_string(rank_) + ": peer " + std::to_string(p) +
                           " aborted: " + error_text(pctl));
      break;
    }
  }
}

void Proxy::keep_sample(std::vector<uint64_t>& v, uint64_t& total, uint64_t x) {
  if (v.size() < MAX_SAMPLES)
    v.push_back(x);
  else
    v[total % MAX_SAMPLES] = x;
  ++total;
}

void Proxy::record_delay(uint64_t ns, uint64_t publish_ns, bool first_piece) {
  std::lock_guard<std::mutex> lk(samples_mu_);
  keep_sample(samples_, samples_total_, ns);
  if (publish_ns) keep_sample(publish_samples_, publish_total_, publish_ns);
  if (publish_ns && first_piece) {
    uint64_t total = first_total_;  // (both vectors fill in step)
    keep_sample(first_samples_, first_total_, publish_ns);
    keep_sample(first_delays_, total, ns);
  }
}

ProxyStats Proxy::stats() {
  ProxyStats st{};
  // The transport's flag samples first, then the proxy's counts: a flag is counted by the
  // proxy right after its push, so the workers' samples exceed the flags by at most the one
  // flag of the post in progress (read the other way round, every flag stored in between
  // counted on one side only). (attach() happens before start(): taken under life_mu_
  // so that a stats() racing attach() sees it whole or not at all).
  Transport* tr;
  {
    std::lock_guard<std::mutex> lk(life_mu_);
    tr = transport_.get();
  }
  Transport::Stats ts;
  if (tr) tr->stats(&ts);
  st.entries = n_entries_.load();
  st.stale_entries = n_stale_.load();
  st.writes = n_writes_.load();
  st.bytes = n_bytes_.load();
  st.flags = n_flags_.load();
  st.turns = n_turns_.load();
  st.naps = n_naps_.load();
  st.gpu_pieces = n_gpu_pieces_.load();
  st.post_ns = n_post_ns_.load();
  st.call_entries = n_calls_.load();
  std::vector<uint64_t> s, pub, first, first_delay, write_flag;
  {
    std::lock_guard<std::mutex> lk(samples_mu_);
    s = samples_;
    st.delay_samples = samples_total_;
    pub = publish_samples_;
    st.publish_samples = publish_total_;
    first = first_samples_;
    first_delay = first_delays_;
    st.first_samples = first_total_;
    write_flag = write_flag_;
    st.write_flag_samples = write_flag_total_;
  }
  auto percentiles = [](std::vector<uint64_t>& v, uint64_t* p50, uint64_t* p99) {
    if (v.empty()) return;
    std::sort(v.begin(), v.end());
    *p50 = v[v.size() / 2];
    *p99 = v[std::min(v.size() - 1, v.size() * 99 / 100)];
  };
  percentiles(s, &st.delay_p50_ns, &st.delay_p99_ns);
  percentiles(pub, &st.publish_p50_ns, &st.publish_p99_ns);
  percentiles(first, &st.first_p50_ns, &st.first_p99_ns);
  percentiles(first_delay, &st.first_delay_p50_ns, &st.first_delay_p99_ns);
  percentiles(write_flag, &st.write_flag_p50_ns, &st.write_flag_p99_ns);
  st.shm_flag_samples = ts.flags_sampled;
  st.shm_worker_sleeps = ts.worker_sleeps;
  std::vector<uint64_t> take, store, total;
  for (uint64_t x : ts.flag_samples) {
    take.push_back(x >> 32);
    store.push_back(x & 0xFFFFFFFFu);
    total.push_back((x >> 32) + (x & 0xFFFFFFFFu));
  }
  percentiles(take, &st.shm_flag_take_p50_ns, &st.shm_flag_take_p99_ns);
  percentiles(store, &st.shm_flag_store_p50_ns, &st.shm_flag_store_p99_ns);
  percentiles(total, &st.shm_flag_total_p50_ns, &st.shm_flag_total_p99_ns);
  return st;
}

}  // namespace sparkccl
