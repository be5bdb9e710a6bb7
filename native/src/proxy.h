// The proxy: one thread per rank that executes the rank's stream tables
// (RankPlan.to_tables(), docs/PROTOCOL.md "Streams") over a transport.
#pragma once
#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "geometry.h"
#include "layout.h"
#include "transport.h"

namespace sparkccl {

struct ProxyStats {
  uint64_t entries, stale_entries, writes, bytes, flags, turns, naps;
  uint64_t delay_samples, delay_p50_ns, delay_p99_ns;
  uint64_t gpu_pieces;  // stream pieces skipped: the data plane sent them (GPU-direct)
  // publish (data plane's clock stamp in the ring entry) -> first post of the piece
  uint64_t publish_samples, publish_p50_ns, publish_p99_ns;
  // the same for each collective's piece 0 only: no earlier piece of its collective queued
  // before it (the others wait for those posts too), so nearest the proxy's own latency
  uint64_t first_samples, first_p50_ns, first_p99_ns;
  // and of it, piece 0's ring entry consumed -> first post (the proxy's own turn)
  uint64_t first_delay_p50_ns, first_delay_p99_ns;
  // time inside the transport's write() and flag() calls of post_pieces: what posting costs
  // the proxy (verbs: building and posting the work requests, the NIC library's share
  // included), divided by writes + flags for a per-work-request figure
  uint64_t post_ns;
  // call entries posted (Transport::put_call): one per connection per collective
  uint64_t call_entries;
  // post_pieces: its first write handed to the transport -> its flag handed over (the
  // pushes of the post's writes and flag), per post with writes
  uint64_t write_flag_samples, write_flag_p50_ns, write_flag_p99_ns;
  // a data flag's way through the transport's workers (Transport::stats; shm only,
  // 0 elsewhere): pushed by the proxy -> taken from its connection's queue by the copy
  // worker (take), taken -> stored in the peer's flag word (store: the batch's earlier
  // copies, the fence), and pushed -> stored (total); the last 1024 per connection (and
  // as many of the flags the proxy stored itself, take 0: shm_transport.cpp's inline ops)
  uint64_t shm_flag_samples, shm_flag_take_p50_ns, shm_flag_take_p99_ns,
      shm_flag_store_p50_ns, shm_flag_store_p99_ns, shm_flag_total_p50_ns,
      shm_flag_total_p99_ns;
  // times a copy worker blocked on its queue's condition variable (each costs the proxy's
  // next push a futex wake and the worker a wake-up): near 0 while workers spin
  uint64_t shm_worker_sleeps;
};

class Proxy {
 public:
  Proxy(int rank, int world, uint64_t ctl, uint64_t flags,
        const std::vector<std::vector<int64_t>>& connections,
        const std::vector<std::vector<int64_t>>& streams,
        const std::vector<std::vector<int64_t>>& items, const std::vector<int>& slots,
        uint64_t spin_us, uint64_t nap_us);
  ~Proxy();
  Proxy(const Proxy&) = delete;
  Proxy& operator=(const Proxy&) = delete;

  void set_region(int region, uint64_t base, uint64_t stride, uint64_t size);
  void set_peer(int peer, uint64_t ctl, uint64_t flags, uint64_t pid);
  void set_peer_region(int peer, int region, uint64_t base, uint64_t size);
  // The transport, built from `source` on this proxy's registry and connections; once,
  // before start() (docs/ARCHITECTURE.md "Where to add things").
  void attach(TransportFactory& source);
  Transport* transport() { return transport_.get(); }  // null until set up
  bool started() const { return started_; }
  // Publish-triggered streams the data plane may execute itself (GPU-direct: it writes the
  // peers' mapped regions and flag words); before start(). For a collective whose ring
  // entries carry chunk -2 (CHUNK_DIRECT) the proxy skips these streams (still consuming
  // the entries, which relays need); other collectives go out as usual.
  void set_gpu_streams(const std::vector<int64_t>& streams);
  // Own pieces a connection may carry ahead of the pieces this rank relays on it (-1: no
  // limit, the default); before start(). See advance_streams.
  void set_relay_lead(int pieces);
  void start();
  // graceful: every rank is done (close() after its barrier): the transport flushes and
  // says goodbye, so that peers do not take the close for a failure.
  void stop(bool graceful = false);
  bool running() const { return thread_.joinable() && !stop_.load(); }
  ProxyStats stats();
  uint64_t outstanding() const;
  // N: every collective before seq N that this rank published has been posted whole on
  // every stream (own pieces and relays); outstanding() == 0 then says they completed. What
  // a rank leaving without close() waits for (sparkccl/wiring.py Wiring.depart).
  uint64_t delivered() const { return delivered_.load(std::memory_order_acquire); }

 private:
  struct StreamRow {
    int op, conn;
    uint64_t dst_flag;
    int kind;       // 0: publish trigger, 1: relay (flag) trigger
    uint64_t arg;   // chunk mask, or local flag word
    size_t first, n;
    uint64_t coll = 0;  // cursor: collective index within its op
    int piece = 0;
    bool gpu = false;   // set_gpu_streams: skipped for GPU-direct collectives
    int origin = 0;     // the rank whose data the stream carries (from dst_flag)
    size_t call_key = 0;  // index of (conn, origin) in calls_sent_ (send_call)
    std::vector<size_t> relays;  // publish streams: the relay streams of the same op and
                                 // connection (their pieces go first, see advance_streams)
  };
  struct ItemRow {
    int src_region, src_block, dst_region, dst_block, root, roots, half, halves;
    int target;  // the rank the bytes are for (the origin's chunk, for a reduce-scatter)
  };
  struct Coll {
    uint64_t seq, slice, granule;
    uint64_t call;                      // the entries' call word (the peers' check)
    uint32_t chunks[geom::PIECES];      // chunks published per piece
    uint8_t all = 0;                    // pieces published for every chunk (chunk -1, -2)
    uint8_t direct = 0;                 // pieces the data plane sent itself (chunk -2)
    uint8_t posted = 0;                 // pieces that went out on some publish stream
    uint8_t ll = 0;                     // pieces whose entries said CHUNK_LL
    bool lines_seen = false;            // CHUNK_LL: every line of ours carries the seq's flag
    uint64_t seen_ns[geom::PIECES];     // when the piece's first entry was consumed
    uint64_t publish_ns[geom::PIECES];  // its ENT_PUBLISH_NS stamp (0: none)
  };
  struct OpState {
    std::deque<Coll> hist;  // collectives still needed by some stream, in issue order
    uint64_t base = 0;      // index of hist.front()
    bool any = false;
    uint64_t last_seq = 0;
    std::vector<size_t> streams;
    bool publish_on_gpu = false;  // set_gpu_streams covers every publish-triggered stream
    bool ll_ok = false;  // CHUNK_LL may come: publish streams only, none on the GPU (start())
  };

  void run();
  bool consume_ring();
  bool advance_streams();
  // Pieces piece..last of collective c on stream s: their writes, then one flag (last's).
  bool post_pieces(StreamRow& s, Coll& c, int piece, int last);
  // CHUNK_LL: whether every line of collective c in this rank's own LL block carries its
  // flag (the data plane hands the entries off without a fence: the lines say they are there).
  bool lines_written(Coll& c);
  int send_call(const StreamRow& s, const Coll& c);
  // A sized all-to-all (KIND_ALL_TO_ALL_SIZED) and its cuts (docs/PROTOCOL.md "Sized blocks").
  static bool sized(const Coll& c);
  // The offset in `region` of block `block` of collective c's slot.
  uint64_t chunk_offset(int region, int block, const Coll& c) const;
  // Where this rank's own block `block` of `region` ends for collective c: geom::sized_bytes
  // of the length in its first 8 bytes. False with *cause where they cannot be read.
  bool own_end(int region, int block, const Coll& c, uint64_t* end, std::string* cause) const;
  // Words CALL_SIZED.. of this rank's own call entry for c (a sized all-to-all on a plan
  // with relays): its chunks' ends, or CALL_LEN_UNKNOWN where this proxy does not send the
  // data. 0: not yet (a sent chunk's piece 0 is not published: its length may not be
  // written); -1: failed; 1: written to `words`.
  int own_lengths(const StreamRow& s, const Coll& c, uint64_t* words);
  // Where a relay cuts origin's chunk `target` of collective c: the length in the origin's
  // call entry, or c.slice where it does not say.
  uint64_t relayed_end(int origin, int target, const Coll& c) const;
  bool relays_caught_up(const StreamRow& s, int piece) const;
  void trim();
  void note_delivered();
  uint64_t issued() const;  // 1 + the highest seq published here (0: none)
  void watch();
  void fail(uint64_t code, const std::string& message);
  // consume -> first post, and publish -> first post (0: no stamp); under one lock so that
  // stats() sees both or neither.
  void record_delay(uint64_t ns, uint64_t publish_ns, bool first_piece);
  // The last MAX_SAMPLES of a sample series (under samples_mu_).
  static void keep_sample(std::vector<uint64_t>& v, uint64_t& total, uint64_t x);

  const int rank_, world_;
  const uint64_t ctl_, flags_;
  const uint64_t spin_ns_, nap_ns_;
  Registry reg_;
  std::vector<ConnInfo> conns_;
  std::vector<StreamRow> streams_;
  std::vector<ItemRow> items_;
  // per (connection, origin) of the streams: seq + 1 of the call entry posted last
  // (send_call; an all-reduce's RS and AG streams share one)
  std::vector<uint64_t> calls_sent_;
  OpState ops_[layout::NUM_OPS];
  uint32_t send_chunks_[layout::NUM_OPS] = {};  // per op: the chunks the publish streams send
  bool relays_ = false;  // the plan relays (a ring): own call entries carry sized lengths
  std::unique_ptr<Transport> transport_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::mutex life_mu_;  // start/stop from several Python threads
  bool started_ = false;
  int relay_lead_ = -1;
  bool aborted_ = false;
  bool abort_told_ = false;  // transport_->on_abort() called
  bool stopped_ = false;     // stop() has run (once is enough)
  uint64_t tail_ = 0;
  std::atomic<uint64_t> delivered_{0};

  std::atomic<uint64_t> n_entries_{0}, n_stale_{0}, n_writes_{0}, n_bytes_{0}, n_flags_{0},
      n_turns_{0}, n_naps_{0}, n_gpu_pieces_{0}, n_post_ns_{0}, n_calls_{0};
  std::mutex samples_mu_;
  std::vector<uint64_t> samples_;
  uint64_t samples_total_ = 0;
  std::vector<uint64_t> publish_samples_;
  uint64_t publish_total_ = 0;
  std::vector<uint64_t> first_samples_;  // publish -> first post of piece 0
  std::vector<uint64_t> first_delays_;   // its consume -> first post (same samples)
  uint64_t first_total_ = 0;
  std::vector<uint64_t> write_flag_;  // post_pieces: first write -> flag pushed
  uint64_t write_flag_total_ = 0;
};

}  // namespace sparkccl
