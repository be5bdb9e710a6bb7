// verbs transport (docs/PROTOCOL.md "The transport contract"): RDMA RC queue pairs over libibverbs (loaded at run time).
//
// One RC QP per plan connection (peer, channel, root), on the device ("lane") Python chose
// for that (channel, root). Data = RDMA WRITE, unsignaled; flag = the 8-byte value as an
// inline RDMA WRITE on the same QP, signaled (ordering mode "inline"), or ("strict") a
// zero-length RDMA WRITE_WITH_IMM whose immediate carries the flag word and the value's low
// bits: the receiving proxy sees it as a receive completion, i.e. after the NIC reported
// every earlier write of that QP as placed, and only then stores the flag itself.
//
// Setup is driven from Python (sparkccl/transport/verbs.py: Python computes, native
// executes): open the lanes and create the QPs (RESET -> INIT), register memory, exchange
// connection records through the store, then connect() each QP (INIT -> RTR -> RTS) with
// the peer's record. The endpoint is then handed to Proxy::attach like any transport
// factory; the proxy thread is then the only one posting and polling.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "transport.h"
#include "verbs_api.h"

namespace sparkccl {

struct VerbsSettings {
  int timeout = 18;         // QP local ACK timeout: 4.096 us * 2^timeout per attempt
  int retry_cnt = 7;        // transport retries before IBV_WC_RETRY_EXC_ERR
  int rnr_retry = 7;        // receiver-not-ready retries (7 = forever); strict mode only
  int min_rnr_timer = 12;   // 0.64 ms
  int traffic_class = 0;    // RoCE: the IP header's DSCP/ECN byte
  int service_level = 0;
  bool strict = false;      // ordering mode: false = inline flag, true = WRITE_WITH_IMM
  int send_depth = 512;     // send queue entries per QP
  int recv_depth = 256;     // receives kept posted per QP (strict mode)
  double stall_s = 120.0;   // a full send queue without any completion for this long fails
};

struct VerbsLane {
  std::string device;
  int port = 1;
  int gid_index = 0;
};

// What this side reports to its peers (and Python) for one lane / one connection.
struct VerbsLaneInfo {
  std::string device;
  int port, gid_index, state, active_mtu, link_layer, lid;
  std::string gid;  // 16 raw bytes
};
struct VerbsConnInfo {
  uint32_t qpn, psn;
  int lane;
};

// Memory keys: regions 0..2, the flag words, and the abort inbox: world slots of
// layout::CTL_BYTES laid out like a control block (abort word, error text). A rank that
// aborts writes its abort record into its slot in every peer's inbox (Transport::on_abort);
// the peer's proxy watches that slot as the peer's control block (Proxy::set_peer), exactly
// as it watches a mapped peer with shm. A rank's own slot in its inbox stages the text.
constexpr int VERBS_KEY_FLAGS = layout::NUM_REGIONS;
constexpr int VERBS_KEY_INBOX = layout::NUM_REGIONS + 1;
constexpr int VERBS_KEYS = layout::NUM_REGIONS + 2;

namespace verbs_detail {  // defined in verbs_transport.cpp
struct Dev;
struct Lane;
struct Qp;
struct WrDesc;
}  // namespace verbs_detail

// The endpoint object Python holds; the transport make() returns posts and polls on it.
// That transport only borrows the endpoint: Proxy.attach keeps the factory's Python object
// alive as long as the proxy (module.cpp), so one object serves setup and the data path.
class VerbsEndpoint final : public TransportFactory {
 public:
  VerbsEndpoint(int rank, int world, const std::vector<VerbsLane>& lanes,
                const std::vector<ConnInfo>& conns, const std::vector<int>& conn_lane,
                const VerbsSettings& settings);
  ~VerbsEndpoint() override;
  std::vector<VerbsLaneInfo> lanes() const;
  std::vector<VerbsConnInfo> connections() const;
  // Register [addr, addr + size) on every lane's device: (lkey, rkey) per lane.
  std::vector<std::pair<uint32_t, uint32_t>> register_memory(int key, uint64_t addr,
                                                             uint64_t size);
  void set_remote_key(int conn, int key, uint32_t rkey);
  // Where this rank's abort record goes at the peer of `conn` (its inbox slot for us).
  void set_abort_inbox(int conn, uint64_t remote_addr, uint32_t rkey);
  // INIT -> RTR -> RTS against the peer's QP. path_mtu: enum ibv_mtu (1..5).
  void connect(int conn, uint32_t qpn, uint32_t psn, uint32_t lid, const std::string& gid,
               int path_mtu, bool global_route);
  // QP states as this side believes them (RESET/INIT/RTR/RTS/ERR per connection).
  std::vector<int> qp_states() const;
  const char* kind() const override { return "verbs"; }
  std::unique_ptr<Transport> make(const ProxySide& side) override;
  void close();  // destroy QPs, MRs, CQs, PDs, contexts; idempotent
  const std::string& library() const { return api_->source; }

  // The data path, called by the transport from make() on the proxy thread only.
  bool write(Registry* reg, int conn, int src_region, uint64_t src_off, int dst_region,
             uint64_t dst_off, uint64_t len, std::string* cause);
  bool flag(Registry* reg, int conn, uint64_t word, uint64_t value, std::string* cause);
  bool put_call(Registry* reg, int conn, uint64_t word, const uint64_t* values, uint64_t n,
                std::string* cause);
  bool put_lines(Registry* reg, int conn, uint64_t off, uint64_t len, std::string* cause);
  bool poll(int* conn, std::string* cause);
  uint64_t outstanding() const;
  void notify_abort(const std::string& text);

 private:
  [[noreturn]] void setup_error(const std::string& what);
  std::string where(int conn) const;
  bool fail(int conn, const std::string& cause);
  bool usable(int conn, std::string* cause) const;
  bool room(int conn, uint64_t n, std::string* cause);
  bool post(int conn, ibv::send_wr* wr, const verbs_detail::WrDesc& d, uint64_t reserve_after,
            std::string* cause);
  uint64_t peer_flags(Registry* reg, int conn, std::string* cause) const;
  // RDMA WRITEs of [laddr, laddr + len) to remote (keys and offsets: for the messages).
  bool post_write(int conn, uint64_t laddr, uint32_t lkey, int src_key, uint64_t src_off,
                  uint64_t remote, uint32_t rkey, int dst_key, uint64_t dst_off, uint64_t len,
                  std::string* cause);
  // An inline RDMA WRITE of n u64 values to remote (words word.. of the peer's flag section).
  bool post_words(int conn, uint64_t word, const uint64_t* values, uint32_t n, uint64_t remote,
                  uint32_t rkey, bool signaled, std::string* cause);
  bool post_imm(int conn, uint64_t word, uint64_t value, uint64_t remote, uint32_t rkey,
                std::string* cause);
  bool drain();
  void check_async();
  int conn_of_qp(const ibv::qp* q) const;
  int first_conn_on(int dev, int port) const;

  const ibv::Api* api_ = nullptr;
  const int rank_;
  const VerbsSettings s_;
  const uint64_t num_flags_;
  int value_bits_ = 32;
  std::vector<std::unique_ptr<verbs_detail::Dev>> devs_;
  std::vector<verbs_detail::Lane> lanes_;
  std::vector<ConnInfo> conns_;
  std::vector<std::unique_ptr<verbs_detail::Qp>> qps_;
  mutable std::mutex setup_mu_;  // setup calls from Python threads
  std::atomic<bool> closed_{false};
  bool failed_ = false;
  int fail_conn_ = 0;
  std::string fail_cause_;
  uint64_t last_async_ns_ = 0;
  bool abort_notices_ = false;  // notify_abort posted something
};

}  // namespace sparkccl
