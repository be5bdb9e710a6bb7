// verbs transport: see verbs_transport.h.
//
// Send queue accounting: WRs complete in order on an RC QP, so one signaled completion
// retires every earlier WR of its QP. Only flags are signaled; a run of more than
// send_depth / 2 unsignaled writes (never in practice: a piece has a few) gets one signaled
// write so that a full queue can always drain. A post that would overflow the send queue
// polls the CQs until there is room. Each device's CQ holds send_depth entries per QP on
// it, at least the number of signaled WRs that can be outstanding, so it never overflows;
// likewise the receive CQ (strict mode) holds recv_depth entries per QP.
//
// Strict mode's immediate: bits [value_bits, 32) the flag word, [0, value_bits) the value's
// low bits. The receiver, the only one storing that word, rebuilds the value from its
// current one: v = cur + ((low - cur) mod 2^value_bits). That is exact while a flag word
// moves by less than 2^value_bits per message, so a sender whose next value is further
// ahead first sends intermediate values (harmless: no collective waits for a value between
// two consecutive values of one word).
#include "verbs_transport.h"

#include <arpa/inet.h>
#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <random>
#include <stdexcept>

#include "control.h"

namespace sparkccl {

using namespace ibv;

namespace {

// A send WR's wr_id: its connection in the top 16 bits, its post counter below.
constexpr uint64_t WR_COUNTER_MASK = (uint64_t(1) << 48) - 1;
uint64_t wr_id_of(int conn, uint64_t counter) {
  return (uint64_t(conn) << 48) | (counter & WR_COUNTER_MASK);
}
uint64_t wr_conn(uint64_t wr_id) { return wr_id >> 48; }
uint64_t wr_counter(uint64_t wr_id) { return wr_id & WR_COUNTER_MASK; }
constexpr uint64_t MAX_MESSAGE = uint64_t(1) << 30;  // split writes above 1 GiB
constexpr int POLL_BATCH = 32;
constexpr uint64_t ASYNC_CHECK_NS = 1000000;  // look at async events every ~1 ms

std::string hex(uint64_t v) {
  char b[32];
  std::snprintf(b, sizeof b, "0x%llx", static_cast<unsigned long long>(v));
  return b;
}

const char* key_name(int k) {
  static const char* names[] = {"AG", "RS_SEND", "RS_RECV", "flags", "inbox"};
  return (k >= 0 && k < VERBS_KEYS) ? names[k] : "?";
}

const char* state_name(int s) {
  static const char* names[] = {"RESET", "INIT", "RTR", "RTS", "SQD", "SQE", "ERR"};
  return (s >= 0 && s <= QPS_ERR) ? names[s] : "UNKNOWN";
}

std::string errno_text(int e) {
  return std::string(std::strerror(e)) + " (errno " + std::to_string(e) + ")";
}

int bit_width(uint64_t v) {
  int n = 0;
  while (v) {
    ++n;
    v >>= 1;
  }
  return n;
}

// What a fatal async event hits; NONE for the informational ones (COMM_EST, PORT_ACTIVE, ...).
enum class EventScope { NONE, QP, PORT, DEVICE };

EventScope fatal_scope(int t) {
  switch (t) {
    case EVENT_QP_FATAL: case EVENT_QP_REQ_ERR: case EVENT_QP_ACCESS_ERR: case EVENT_PATH_MIG_ERR:
      return EventScope::QP;
    case EVENT_PORT_ERR:
      return EventScope::PORT;
    case EVENT_CQ_ERR: case EVENT_DEVICE_FATAL: case EVENT_SRQ_ERR: case EVENT_WQ_FATAL:
      return EventScope::DEVICE;
    default:
      return EventScope::NONE;
  }
}

}  // namespace

// The endpoint's internals, declared in verbs_transport.h.
namespace verbs_detail {

// What a posted WR was, to describe it if it fails.
struct WrDesc {
  enum Kind : uint8_t { NONE, WRITE, FLAG_INLINE, FLAG_IMM } kind = NONE;
  int8_t src_key = -1, dst_key = -1;
  uint64_t src_off = 0, dst_off = 0, len = 0, word = 0, value = 0, remote = 0;
  uint32_t rkey = 0;
};

std::string describe(const WrDesc& d) {
  switch (d.kind) {
    case WrDesc::WRITE:
      return "RDMA WRITE of " + std::to_string(d.len) + " bytes from " + key_name(d.src_key) +
             "+" + hex(d.src_off) + " to the peer's " + key_name(d.dst_key) + "+" +
             hex(d.dst_off) + " (remote " + hex(d.remote) + ", rkey " + hex(d.rkey) + ")";
    case WrDesc::FLAG_INLINE:
      return std::string(d.len > 8 ? "call entry" : "flag") + " write (inline RDMA WRITE) of " +
             "value " + std::to_string(d.value) + " to word " + std::to_string(d.word) +
             " (remote " + hex(d.remote) + ", rkey " + hex(d.rkey) + ")";
    case WrDesc::FLAG_IMM:
      return "flag (RDMA WRITE_WITH_IMM) of value " + std::to_string(d.value) +
             " for flag word " + std::to_string(d.word);
    default:
      return "an unknown work request";
  }
}

struct Dev {
  std::string name;
  context* ctx = nullptr;
  pd* prot = nullptr;
  cq* scq = nullptr;
  cq* rcq = nullptr;
  bool async_ok = false;
  int nqps = 0;
  struct Key {
    std::atomic<bool> ready{false};
    mr* m = nullptr;
    uint64_t addr = 0, size = 0;
    uint32_t lkey = 0, rkey = 0;
  } keys[VERBS_KEYS];
};

struct Lane {
  int dev = 0, port = 1, gid_index = 0;
  port_attr attr{};
  gid g{};
};

struct Qp {
  qp* q = nullptr;
  int lane = 0, dev = 0;
  uint32_t psn = 0, remote_qpn = 0;
  int state = QPS_RESET;
  std::atomic<bool> key_set[VERBS_KEYS]{};
  uint32_t rkey[VERBS_KEYS]{};
  uint64_t posted = 0;        // WRs posted (proxy thread)
  uint64_t since_signal = 0;  // unsignaled WRs since the last signaled one
  std::atomic<uint64_t> posted_a{0}, completed{0};
  std::vector<WrDesc> ring;   // posted WRs by counter % send_depth
  std::vector<uint64_t> last_flag;  // strict: last value sent per flag word
  uint32_t max_inline = 8;          // bytes the QP inlines (at least a flag's 8)
  uint64_t inbox_remote = 0;  // our slot in the peer's abort inbox
  uint32_t inbox_rkey = 0;
  std::atomic<bool> inbox_set{false};
};

}  // namespace verbs_detail

using namespace verbs_detail;

// ---------------------------------------------------------------------------- setup

void VerbsEndpoint::setup_error(const std::string& what) {
  close();
  throw std::runtime_error("verbs transport: rank " + std::to_string(rank_) + ": " + what);
}

VerbsEndpoint::VerbsEndpoint(int rank, int world, const std::vector<VerbsLane>& lanes,
                             const std::vector<ConnInfo>& conns,
                             const std::vector<int>& conn_lane, const VerbsSettings& s)
    : rank_(rank), s_(s), num_flags_(layout::num_flag_words(world)),
      conns_(conns) {
  if (world < 1 || rank < 0 || rank >= world) throw std::invalid_argument("verbs: bad rank/world");
  if (conn_lane.size() != conns.size())
    throw std::invalid_argument("verbs: conn_lane must have one entry per connection");
  for (int l : conn_lane)
    if (l < 0 || size_t(l) >= lanes.size()) throw std::invalid_argument("verbs: lane out of range");
  if (s.send_depth < 8 || s.recv_depth < 1)
    throw std::invalid_argument("verbs: send_depth >= 8 and recv_depth >= 1 needed");
  value_bits_ = 32 - std::max(1, bit_width(num_flags_ - 1));
  if (value_bits_ < 8) throw std::invalid_argument("verbs: world too large for strict mode's immediate");

  std::string err;
  api_ = ibv::api(&err);
  if (!api_) throw std::runtime_error("verbs transport: " + err);

  int ndev = 0;
  errno = 0;
  device** list = api_->get_device_list(&ndev);
  if (!list) {
    int e = errno;
    std::string why = e == ENOSYS ? "no RDMA subsystem in this kernel (no /sys/class/infiniband; "
                                    "are ib_core and the NIC's RDMA driver, e.g. mlx5_ib, loaded?)"
                                  : "ibv_get_device_list failed: " + errno_text(e);
    std::string names;
    for (const VerbsLane& l : lanes) names += (names.empty() ? "" : ", ") + l.device;
    setup_error("cannot open RDMA device(s) " + names + ": " + why);
  }
  std::string found;
  for (int i = 0; i < ndev; ++i)
    found += std::string(found.empty() ? "" : ", ") + api_->get_device_name(list[i]);
  // Open each distinct device once.
  for (const VerbsLane& l : lanes) {
    int di = -1;
    for (size_t k = 0; k < devs_.size(); ++k)
      if (devs_[k]->name == l.device) di = int(k);
    if (di < 0) {
      device* d = nullptr;
      for (int i = 0; i < ndev; ++i)
        if (l.device == api_->get_device_name(list[i])) d = list[i];
      if (!d) {
        api_->free_device_list(list);
        setup_error("RDMA device " + l.device + " not found (" +
                    (found.empty() ? std::string("libibverbs lists no RDMA devices")
                                   : "libibverbs lists: " + found) + ")");
      }
      std::unique_ptr<Dev> dev(new Dev);
      dev->name = l.device;
      dev->ctx = api_->open_device(d);
      if (!dev->ctx) {
        int e = errno;
        api_->free_device_list(list);
        setup_error("ibv_open_device(" + l.device + ") failed: " + errno_text(e));
      }
      devs_.push_back(std::move(dev));
      di = int(devs_.size()) - 1;
    }
    Lane lane;
    lane.dev = di;
    lane.port = l.port;
    lane.gid_index = l.gid_index;
    lanes_.push_back(lane);
  }
  api_->free_device_list(list);

  for (Lane& lane : lanes_) {
    Dev& d = *devs_[size_t(lane.dev)];
    // The exported ibv_query_port may fill an older (shorter) layout: give it room.
    union {
      port_attr a;
      uint8_t room[256];
    } pa;
    std::memset(&pa, 0, sizeof pa);
    int rc = api_->query_port(d.ctx, uint8_t(lane.port), &pa.a);
    if (rc) setup_error("ibv_query_port(" + d.name + ", port " + std::to_string(lane.port) +
                        ") failed: " + errno_text(rc > 0 ? rc : errno));
    lane.attr = pa.a;
    if (lane.attr.state != PORT_ACTIVE)
      setup_error(d.name + " port " + std::to_string(lane.port) + " is not ACTIVE (state " +
                  std::to_string(lane.attr.state) + ")");
    if (!mtu_bytes(lane.attr.active_mtu))
      setup_error(d.name + " port " + std::to_string(lane.port) + " reports active MTU enum " +
                  std::to_string(lane.attr.active_mtu));
    if (api_->query_gid(d.ctx, uint8_t(lane.port), lane.gid_index, &lane.g))
      setup_error("ibv_query_gid(" + d.name + ", port " + std::to_string(lane.port) +
                  ", index " + std::to_string(lane.gid_index) + ") failed: " +
                  errno_text(errno));
  }

  for (int l : conn_lane) devs_[size_t(lanes_[size_t(l)].dev)]->nqps++;
  for (auto& dp : devs_) {
    Dev& d = *dp;
    d.prot = api_->alloc_pd(d.ctx);
    if (!d.prot) setup_error("ibv_alloc_pd(" + d.name + ") failed: " + errno_text(errno));
    int cqe = std::max(1, d.nqps) * s_.send_depth + 16;
    d.scq = api_->create_cq(d.ctx, cqe, nullptr, nullptr, 0);
    if (!d.scq)
      setup_error("ibv_create_cq(" + d.name + ", " + std::to_string(cqe) +
                  " entries) failed: " + errno_text(errno));
    if (s_.strict) {
      int rcqe = std::max(1, d.nqps) * s_.recv_depth + 16;
      d.rcq = api_->create_cq(d.ctx, rcqe, nullptr, nullptr, 0);
      if (!d.rcq)
        setup_error("ibv_create_cq(" + d.name + ", " + std::to_string(rcqe) +
                    " entries) failed: " + errno_text(errno));
    }
    if (d.ctx->async_fd >= 0) {
      int fl = fcntl(d.ctx->async_fd, F_GETFL);
      d.async_ok = fl >= 0 && fcntl(d.ctx->async_fd, F_SETFL, fl | O_NONBLOCK) == 0;
    }
  }

  std::random_device rd;
  std::mt19937 gen(rd() ^ (uint32_t(rank) * 2654435761u));
  for (size_t i = 0; i < conns_.size(); ++i) {
    std::unique_ptr<Qp> q(new Qp);
    q->lane = conn_lane[i];
    q->dev = lanes_[size_t(q->lane)].dev;
    q->psn = gen() & 0xFFFFFF;
    q->ring.resize(size_t(s_.send_depth));
    if (s_.strict) q->last_flag.assign(num_flags_, 0);
    Dev& d = *devs_[size_t(q->dev)];
    const Lane& lane = lanes_[size_t(q->lane)];
    qp_init_attr ia;
    std::memset(&ia, 0, sizeof ia);
    ia.send_cq = d.scq;
    ia.recv_cq = s_.strict ? d.rcq : d.scq;
    ia.cap.max_send_wr = uint32_t(s_.send_depth);
    ia.cap.max_recv_wr = s_.strict ? uint32_t(s_.recv_depth) : 1;
    ia.cap.max_send_sge = 1;
    ia.cap.max_recv_sge = 1;
    ia.cap.max_inline_data = 64;
    ia.qp_type = QPT_RC;
    ia.sq_sig_all = 0;
    q->q = api_->create_qp(d.prot, &ia);
    if (!q->q) {  // some devices inline less: 8 bytes (the flag) is all we need
      ia.cap.max_inline_data = 8;
      q->q = api_->create_qp(d.prot, &ia);
    }
    if (!q->q)
      setup_error("ibv_create_qp(" + d.name + ", RC, " + std::to_string(s_.send_depth) +
                  " send WRs) for peer " + std::to_string(conns_[i].peer) +
                  " failed: " + errno_text(errno));
    qps_.push_back(std::move(q));
    Qp& qq = *qps_.back();
    if (ia.cap.max_inline_data < 8)
      setup_error(d.name + ": QP inlines only " + std::to_string(ia.cap.max_inline_data) +
                  " bytes, the flag needs 8");
    qq.max_inline = ia.cap.max_inline_data;
    qp_attr a;
    std::memset(&a, 0, sizeof a);
    a.qp_state = QPS_INIT;
    a.pkey_index = 0;
    a.port_num = uint8_t(lane.port);
    a.qp_access_flags = ACCESS_REMOTE_WRITE;
    int rc = api_->modify_qp(qq.q, &a, ATTR_STATE | ATTR_PKEY_INDEX | ATTR_PORT | ATTR_ACCESS_FLAGS);
    if (rc) setup_error(where(int(i)) + ": ibv_modify_qp(RESET -> INIT) failed: " + errno_text(rc));
    qq.state = QPS_INIT;
    if (s_.strict) {
      for (int k = 0; k < s_.recv_depth; ++k) {
        recv_wr w;
        std::memset(&w, 0, sizeof w);
        w.wr_id = i;
        recv_wr* bad = nullptr;
        int prc = post_recv(qq.q, &w, &bad);
        if (prc) setup_error(where(int(i)) + ": ibv_post_recv failed: " + errno_text(prc));
      }
    }
  }
}

VerbsEndpoint::~VerbsEndpoint() { close(); }

void VerbsEndpoint::close() {
  std::lock_guard<std::mutex> lk(setup_mu_);
  if (closed_.load()) return;
  if (api_ && abort_notices_) {
    // Abort notices posted just before a teardown: give them a moment to leave (a QP
    // destroyed with WRs still queued drops them), polling as the proxy (stopped) would.
    const uint64_t deadline = now_ns() + 200000000ull;
    wc w[POLL_BATCH];
    for (;;) {
      bool pending = false;
      for (auto& q : qps_)
        if (q->q && q->state == QPS_RTS &&
            q->completed.load(std::memory_order_acquire) < q->posted)
          pending = true;
      if (!pending || now_ns() > deadline) break;
      for (auto& d : devs_) {
        int n = d->scq ? poll_cq(d->scq, POLL_BATCH, w) : 0;
        for (int i = 0; i < n; ++i) {
          uint64_t conn = wr_conn(w[i].wr_id);
          if (conn >= qps_.size()) continue;
          if (w[i].status != WC_SUCCESS) qps_[size_t(conn)]->state = QPS_ERR;
          else qps_[size_t(conn)]->completed.store(wr_counter(w[i].wr_id) + 1);
        }
      }
      sleep_ns(100000);
    }
  }
  closed_.store(true);
  if (!api_) return;
  for (auto& q : qps_)
    if (q && q->q) {
      api_->destroy_qp(q->q);
      q->q = nullptr;
    }
  for (auto& dp : devs_) {
    Dev& d = *dp;
    for (auto& k : d.keys)
      if (k.m) {
        api_->dereg_mr(k.m);
        k.m = nullptr;
        k.ready.store(false);
      }
    if (d.scq) api_->destroy_cq(d.scq);
    if (d.rcq) api_->destroy_cq(d.rcq);
    if (d.prot) api_->dealloc_pd(d.prot);
    if (d.ctx) api_->close_device(d.ctx);
    d.scq = d.rcq = nullptr;
    d.prot = nullptr;
    d.ctx = nullptr;
  }
}

std::string VerbsEndpoint::where(int conn) const {
  const Qp& q = *qps_[size_t(conn)];
  const Lane& lane = lanes_[size_t(q.lane)];
  std::string s = "device " + devs_[size_t(q.dev)]->name + " port " + std::to_string(lane.port) +
                  " QP " + (q.q ? hex(q.q->qp_num) : std::string("?")) + " (to peer " +
                  std::to_string(conns_[size_t(conn)].peer);
  if (q.remote_qpn) s += " QP " + hex(q.remote_qpn);
  return s + ")";
}

std::vector<VerbsLaneInfo> VerbsEndpoint::lanes() const {
  std::vector<VerbsLaneInfo> out;
  for (const Lane& l : lanes_) {
    VerbsLaneInfo i;
    i.device = devs_[size_t(l.dev)]->name;
    i.port = l.port;
    i.gid_index = l.gid_index;
    i.state = l.attr.state;
    i.active_mtu = l.attr.active_mtu;
    i.link_layer = l.attr.link_layer;
    i.lid = l.attr.lid;
    i.gid.assign(reinterpret_cast<const char*>(l.g.raw), 16);
    out.push_back(i);
  }
  return out;
}

std::vector<VerbsConnInfo> VerbsEndpoint::connections() const {
  std::vector<VerbsConnInfo> out;
  for (auto& q : qps_) out.push_back(VerbsConnInfo{q->q ? q->q->qp_num : 0, q->psn, q->lane});
  return out;
}

std::vector<int> VerbsEndpoint::qp_states() const {
  std::lock_guard<std::mutex> lk(setup_mu_);
  std::vector<int> out;
  for (auto& q : qps_) out.push_back(q->state);
  return out;
}

std::vector<std::pair<uint32_t, uint32_t>> VerbsEndpoint::register_memory(int key, uint64_t addr,
                                                                          uint64_t size) {
  std::lock_guard<std::mutex> lk(setup_mu_);
  if (closed_) throw std::runtime_error("verbs transport: endpoint is closed");
  if (key < 0 || key >= VERBS_KEYS) throw std::invalid_argument("verbs: memory key out of range");
  if (!addr || !size) throw std::invalid_argument("verbs: cannot register an empty range");
  for (auto& dp : devs_) {
    Dev& d = *dp;
    auto& k = d.keys[key];
    if (k.m)
      throw std::runtime_error(std::string("verbs transport: ") + key_name(key) +
                               " is registered already");
    mr* m = api_->reg_mr(d.prot, reinterpret_cast<void*>(static_cast<uintptr_t>(addr)),
                         size_t(size), ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE);
    if (!m) {
      int e = errno;
      std::string hint = (e == ENOMEM || e == EPERM || e == EFAULT)
                             ? "; is the locked-memory limit high enough (ulimit -l; "
                               "docker run --ulimit memlock=-1)? `sparkccl doctor` shows it"
                             : "";
      throw std::runtime_error("verbs transport: rank " + std::to_string(rank_) +
                               ": ibv_reg_mr(" + d.name + ", " + key_name(key) + ", " +
                               std::to_string(size) + " bytes) failed: " + errno_text(e) + hint);
    }
    k.m = m;
    k.addr = addr;
    k.size = size;
    k.lkey = m->lkey;
    k.rkey = m->rkey;
    k.ready.store(true, std::memory_order_release);
  }
  std::vector<std::pair<uint32_t, uint32_t>> out;
  for (const Lane& l : lanes_) {
    auto& k = devs_[size_t(l.dev)]->keys[key];
    out.emplace_back(k.lkey, k.rkey);
  }
  return out;
}

void VerbsEndpoint::set_remote_key(int conn, int key, uint32_t rkey) {
  std::lock_guard<std::mutex> lk(setup_mu_);
  if (conn < 0 || size_t(conn) >= qps_.size()) throw std::invalid_argument("verbs: conn out of range");
  if (key < 0 || key >= VERBS_KEYS) throw std::invalid_argument("verbs: memory key out of range");
  Qp& q = *qps_[size_t(conn)];
  q.rkey[key] = rkey;
  q.key_set[key].store(true, std::memory_order_release);
}

void VerbsEndpoint::set_abort_inbox(int conn, uint64_t remote_addr, uint32_t rkey) {
  std::lock_guard<std::mutex> lk(setup_mu_);
  if (conn < 0 || size_t(conn) >= qps_.size()) throw std::invalid_argument("verbs: conn out of range");
  Qp& q = *qps_[size_t(conn)];
  q.inbox_remote = remote_addr;
  q.inbox_rkey = rkey;
  q.inbox_set.store(true, std::memory_order_release);
}

// Best effort, from the proxy thread once the communicator failed: on every connected QP,
// write the text into our inbox slot at the peer, then the abort word (inline). No waiting:
// a full send queue or a broken QP just skips that connection (the peer has another one,
// or finds out by its own timeout).
void VerbsEndpoint::notify_abort(const std::string& text) {
  if (closed_.load(std::memory_order_acquire)) return;
  const size_t n = std::min(text.size(), size_t(layout::ERROR_BYTES - 1));
  for (size_t i = 0; i < qps_.size(); ++i) {
    Qp& q = *qps_[i];
    if (!q.q || q.state != QPS_RTS || !q.inbox_set.load(std::memory_order_acquire)) continue;
    Dev& d = *devs_[size_t(q.dev)];
    const Dev::Key& k = d.keys[VERBS_KEY_INBOX];
    if (!k.ready.load(std::memory_order_acquire) ||
        (uint64_t(rank_) + 1) * layout::CTL_BYTES > k.size)
      continue;
    if (q.posted - q.completed.load(std::memory_order_acquire) + 2 > uint64_t(s_.send_depth))
      continue;
    const uint64_t stage = k.addr + uint64_t(rank_) * layout::CTL_BYTES + layout::CTL_ERROR;
    std::memcpy(reinterpret_cast<void*>(static_cast<uintptr_t>(stage)), text.data(), n);
    reinterpret_cast<char*>(static_cast<uintptr_t>(stage))[n] = 0;
    sge sg{stage, uint32_t(n + 1), k.lkey};
    send_wr w1;
    std::memset(&w1, 0, sizeof w1);
    w1.sg_list = &sg;
    w1.num_sge = 1;
    w1.opcode = WR_RDMA_WRITE;
    w1.rdma.remote_addr = q.inbox_remote + layout::CTL_ERROR;
    w1.rdma.rkey = q.inbox_rkey;
    uint64_t code = layout::ABORT_PEER;
    sge sg2{reinterpret_cast<uint64_t>(&code), 8, 0};
    send_wr w2;
    std::memset(&w2, 0, sizeof w2);
    w2.sg_list = &sg2;
    w2.num_sge = 1;
    w2.opcode = WR_RDMA_WRITE;
    w2.send_flags = SEND_INLINE | SEND_SIGNALED;
    w2.rdma.remote_addr = q.inbox_remote + layout::CTL_ABORT;
    w2.rdma.rkey = q.inbox_rkey;
    WrDesc d1, d2;
    d1.kind = WrDesc::WRITE;
    d1.src_key = d1.dst_key = int8_t(VERBS_KEY_INBOX);
    d1.len = n + 1;
    d1.remote = w1.rdma.remote_addr;
    d2.kind = WrDesc::FLAG_INLINE;
    d2.value = code;
    d2.remote = w2.rdma.remote_addr;
    const uint64_t idx = q.posted;
    w1.wr_id = wr_id_of(int(i), idx);
    w2.wr_id = wr_id_of(int(i), idx + 1);
    q.ring[size_t(idx % uint64_t(s_.send_depth))] = d1;
    q.ring[size_t((idx + 1) % uint64_t(s_.send_depth))] = d2;
    w1.next = &w2;
    send_wr* bad = nullptr;
    if (post_send(q.q, &w1, &bad) == 0) {
      abort_notices_ = true;
      q.posted = idx + 2;
      q.posted_a.store(idx + 2, std::memory_order_release);
      q.since_signal = 0;
    }
  }
}

void VerbsEndpoint::connect(int conn, uint32_t qpn, uint32_t psn, uint32_t lid,
                            const std::string& g, int path_mtu, bool global_route) {
  std::lock_guard<std::mutex> lk(setup_mu_);
  if (closed_) throw std::runtime_error("verbs transport: endpoint is closed");
  if (conn < 0 || size_t(conn) >= qps_.size()) throw std::invalid_argument("verbs: conn out of range");
  if (g.size() != 16) throw std::invalid_argument("verbs: gid must be 16 bytes");
  if (!mtu_bytes(path_mtu)) throw std::invalid_argument("verbs: path_mtu must be an ibv_mtu (1..5)");
  Qp& q = *qps_[size_t(conn)];
  const Lane& lane = lanes_[size_t(q.lane)];
  if (q.state != QPS_INIT)
    throw std::runtime_error("verbs transport: " + where(conn) + " is " + state_name(q.state) +
                             ", not INIT: connect() twice?");
  q.remote_qpn = qpn;
  qp_attr a;
  std::memset(&a, 0, sizeof a);
  a.qp_state = QPS_RTR;
  a.path_mtu = path_mtu;
  a.dest_qp_num = qpn;
  a.rq_psn = psn & 0xFFFFFF;
  a.max_dest_rd_atomic = 1;
  a.min_rnr_timer = uint8_t(s_.min_rnr_timer);
  a.ah.is_global = global_route ? 1 : 0;
  a.ah.dlid = uint16_t(lid);
  a.ah.sl = uint8_t(s_.service_level);
  a.ah.src_path_bits = 0;
  a.ah.port_num = uint8_t(lane.port);
  if (global_route) {
    std::memcpy(a.ah.grh.dgid.raw, g.data(), 16);
    a.ah.grh.sgid_index = uint8_t(lane.gid_index);
    a.ah.grh.hop_limit = 255;
    a.ah.grh.traffic_class = uint8_t(s_.traffic_class);
    a.ah.grh.flow_label = 0;
  }
  int rc = api_->modify_qp(q.q, &a,
                           ATTR_STATE | ATTR_AV | ATTR_PATH_MTU | ATTR_DEST_QPN | ATTR_RQ_PSN |
                               ATTR_MAX_DEST_RD_ATOMIC | ATTR_MIN_RNR_TIMER);
  if (rc)
    throw std::runtime_error("verbs transport: rank " + std::to_string(rank_) + ": " +
                             where(conn) + ": ibv_modify_qp(INIT -> RTR, path MTU " +
                             std::to_string(mtu_bytes(path_mtu)) + ") failed: " + errno_text(rc));
  q.state = QPS_RTR;
  std::memset(&a, 0, sizeof a);
  a.qp_state = QPS_RTS;
  a.timeout = uint8_t(s_.timeout);
  a.retry_cnt = uint8_t(s_.retry_cnt);
  a.rnr_retry = uint8_t(s_.rnr_retry);
  a.sq_psn = q.psn;
  a.max_rd_atomic = 1;
  rc = api_->modify_qp(q.q, &a,
                       ATTR_STATE | ATTR_TIMEOUT | ATTR_RETRY_CNT | ATTR_RNR_RETRY | ATTR_SQ_PSN |
                           ATTR_MAX_QP_RD_ATOMIC);
  if (rc)
    throw std::runtime_error("verbs transport: rank " + std::to_string(rank_) + ": " +
                             where(conn) + ": ibv_modify_qp(RTR -> RTS) failed: " + errno_text(rc));
  q.state = QPS_RTS;
}

// ---------------------------------------------------------------------------- data path

bool VerbsEndpoint::fail(int conn, const std::string& cause) {
  if (!failed_) {
    failed_ = true;
    fail_conn_ = conn;
    fail_cause_ = cause;
  }
  return false;
}

bool VerbsEndpoint::usable(int conn, std::string* cause) const {
  if (failed_) {
    *cause = fail_cause_;
    return false;
  }
  if (closed_.load(std::memory_order_acquire)) {
    *cause = "the verbs endpoint is closed";
    return false;
  }
  const Qp& q = *qps_[size_t(conn)];
  if (q.state != QPS_RTS) {
    *cause = where(conn) + " is not connected (QP state " + state_name(q.state) + ")";
    return false;
  }
  return true;
}

bool VerbsEndpoint::room(int conn, uint64_t n, std::string* cause) {
  Qp& q = *qps_[size_t(conn)];
  const uint64_t depth = uint64_t(s_.send_depth);
  if (q.posted - q.completed.load(std::memory_order_acquire) + n <= depth) return true;
  const uint64_t deadline = now_ns() + uint64_t(s_.stall_s * 1e9);
  for (;;) {
    if (!drain()) {
      *cause = fail_cause_;
      return false;
    }
    if (q.posted - q.completed.load(std::memory_order_acquire) + n <= depth) return true;
    if (now_ns() > deadline) {
      *cause = where(conn) + ": send queue full (" + std::to_string(depth) +
               " work requests) and no completion for " + std::to_string(s_.stall_s) + " s";
      return fail(conn, *cause);
    }
    cpu_relax();
  }
}

bool VerbsEndpoint::post(int conn, send_wr* wr, const WrDesc& d, uint64_t reserve_after,
                         std::string* cause) {
  Qp& q = *qps_[size_t(conn)];
  if (!room(conn, 1 + reserve_after, cause)) return false;
  const uint64_t idx = q.posted;
  bool sig = (wr->send_flags & SEND_SIGNALED) != 0;
  if (!sig && q.since_signal + 1 >= uint64_t(s_.send_depth) / 2) {
    wr->send_flags |= SEND_SIGNALED;
    sig = true;
  }
  wr->wr_id = wr_id_of(conn, idx);
  wr->next = nullptr;
  q.ring[size_t(idx % uint64_t(s_.send_depth))] = d;
  send_wr* bad = nullptr;
  int rc = post_send(q.q, wr, &bad);
  if (rc) {
    *cause = where(conn) + ": ibv_post_send failed: " + errno_text(rc) + " on " + describe(d);
    return fail(conn, *cause);
  }
  q.posted = idx + 1;
  q.posted_a.store(idx + 1, std::memory_order_release);
  q.since_signal = sig ? 0 : q.since_signal + 1;
  return true;
}

bool VerbsEndpoint::write(Registry* reg, int conn, int src_region, uint64_t src_off,
                          int dst_region, uint64_t dst_off, uint64_t len, std::string* cause) {
  if (!usable(conn, cause)) return false;
  Qp& q = *qps_[size_t(conn)];
  const ConnInfo& c = conns_[size_t(conn)];
  Dev& d = *devs_[size_t(q.dev)];
  const Dev::Key& k = d.keys[src_region];
  uint64_t src_base = reg->base[src_region].load(std::memory_order_acquire);
  if (!src_base || !k.ready.load(std::memory_order_acquire)) {
    *cause = std::string("local region ") + key_name(src_region) +
             " is not registered with device " + d.name;
    return false;
  }
  uint64_t src_size = reg->local_size(src_region);
  if (src_off > src_size || len > src_size - src_off) {
    *cause = std::string("write reads [") + std::to_string(src_off) + ", " +
             std::to_string(src_off + len) + ") past the end of local region " +
             key_name(src_region) + " (" + std::to_string(src_size) + " bytes)";
    return false;
  }
  const uint64_t laddr = src_base + src_off;
  if (laddr < k.addr || laddr + len > k.addr + k.size) {
    *cause = std::string("write reads local ") + key_name(src_region) + " bytes outside its " +
             "memory registration on " + d.name;
    return false;
  }
  uint64_t dst_base = reg->peers[c.peer].base[dst_region].load(std::memory_order_acquire);
  if (!dst_base) {
    *cause = std::string("the address of the peer's region ") + key_name(dst_region) +
             " is unknown";
    return false;
  }
  uint64_t dst_size = reg->peer_size(c.peer, dst_region);
  if (dst_off > dst_size || len > dst_size - dst_off) {
    *cause = std::string("write to [") + std::to_string(dst_off) + ", " +
             std::to_string(dst_off + len) + ") past the end of the peer's region " +
             key_name(dst_region) + " (" + std::to_string(dst_size) + " bytes)";
    return false;
  }
  if (!q.key_set[dst_region].load(std::memory_order_acquire)) {
    *cause = std::string("no rkey for the peer's region ") + key_name(dst_region) +
             " (not registered by the peer yet)";
    return false;
  }
  return post_write(conn, laddr, k.lkey, src_region, src_off, dst_base + dst_off,
                    q.rkey[dst_region], dst_region, dst_off, len, cause);
}

bool VerbsEndpoint::post_write(int conn, uint64_t laddr, uint32_t lkey, int src_key,
                               uint64_t src_off, uint64_t remote, uint32_t rkey, int dst_key,
                               uint64_t dst_off, uint64_t len, std::string* cause) {
  for (uint64_t done = 0; done < len;) {
    uint64_t n = std::min(len - done, MAX_MESSAGE);
    sge sg{laddr + done, uint32_t(n), lkey};
    send_wr wr;
    std::memset(&wr, 0, sizeof wr);
    wr.sg_list = &sg;
    wr.num_sge = 1;
    wr.opcode = WR_RDMA_WRITE;
    wr.send_flags = 0;
    wr.rdma.remote_addr = remote + done;
    wr.rdma.rkey = rkey;
    WrDesc desc;
    desc.kind = WrDesc::WRITE;
    desc.src_key = int8_t(src_key);
    desc.dst_key = int8_t(dst_key);
    desc.src_off = src_off + done;
    desc.dst_off = dst_off + done;
    desc.len = n;
    desc.remote = wr.rdma.remote_addr;
    desc.rkey = rkey;
    // Keep room for the flag that follows the piece's writes.
    if (!post(conn, &wr, desc, 1, cause)) return false;
    done += n;
  }
  return true;
}

// The LL area lies in the flag words' registration (sparkccl/transport/verbs.py registers
// the flag words, the call words and the LL area as one: VERBS_KEY_FLAGS), on both sides.
bool VerbsEndpoint::put_lines(Registry* reg, int conn, uint64_t off, uint64_t len,
                              std::string* cause) {
  if (!usable(conn, cause)) return false;
  if (!lines_in_range(*reg, off, len, cause)) return false;
  Qp& q = *qps_[size_t(conn)];
  Dev& d = *devs_[size_t(q.dev)];
  const Dev::Key& k = d.keys[VERBS_KEY_FLAGS];
  const uint64_t at = reg->ll_off + off;  // (from the flag words)
  if (!k.ready.load(std::memory_order_acquire) || at + len > k.size) {
    *cause = "the LL area [" + std::to_string(at) + ", " + std::to_string(at + len) +
             ") past the flag words is not in their memory registration on " + d.name;
    return false;
  }
  const uint64_t fbase = peer_flags(reg, conn, cause);
  if (!fbase) return false;
  return post_write(conn, k.addr + at, k.lkey, VERBS_KEY_FLAGS, at, fbase + at,
                    q.rkey[VERBS_KEY_FLAGS], VERBS_KEY_FLAGS, at, len, cause);
}

bool VerbsEndpoint::post_imm(int conn, uint64_t word, uint64_t value, uint64_t remote,
                             uint32_t rkey, std::string* cause) {
  const uint64_t mask = (uint64_t(1) << value_bits_) - 1;
  send_wr wr;
  std::memset(&wr, 0, sizeof wr);
  wr.sg_list = nullptr;
  wr.num_sge = 0;
  wr.opcode = WR_RDMA_WRITE_WITH_IMM;
  wr.send_flags = SEND_SIGNALED;
  wr.imm_data = htonl(uint32_t((word << value_bits_) | (value & mask)));
  wr.rdma.remote_addr = remote;
  wr.rdma.rkey = rkey;
  WrDesc d;
  d.kind = WrDesc::FLAG_IMM;
  d.word = word;
  d.value = value;
  d.remote = remote;
  d.rkey = rkey;
  return post(conn, &wr, d, 0, cause);
}

bool VerbsEndpoint::flag(Registry* reg, int conn, uint64_t word, uint64_t value,
                         std::string* cause) {
  if (!usable(conn, cause)) return false;
  Qp& q = *qps_[size_t(conn)];
  const ConnInfo& c = conns_[size_t(conn)];
  if (word >= num_flags_ || word >= reg->num_flags) {
    *cause = "flag word " + std::to_string(word) + " out of range (" +
             std::to_string(num_flags_) + " words)";
    return false;
  }
  uint64_t fbase = reg->peers[c.peer].flags.load(std::memory_order_acquire);
  if (!fbase) {
    *cause = "the address of the peer's flag words is unknown";
    return false;
  }
  if (!q.key_set[VERBS_KEY_FLAGS].load(std::memory_order_acquire)) {
    *cause = "no rkey for the peer's flag words";
    return false;
  }
  const uint32_t rkey = q.rkey[VERBS_KEY_FLAGS];
  const uint64_t remote = fbase + word * layout::FLAG_BYTES;
  if (!s_.strict) return post_words(conn, word, &value, 1, remote, rkey, true, cause);
  uint64_t& last = q.last_flag[size_t(word)];
  const uint64_t step = (uint64_t(1) << value_bits_) - 2;
  while (value > last + step) {
    if (!post_imm(conn, word, last + step, remote, rkey, cause)) return false;
    last += step;
  }
  if (!post_imm(conn, word, value, remote, rkey, cause)) return false;
  last = std::max(last, value);
  return true;
}

bool VerbsEndpoint::post_words(int conn, uint64_t word, const uint64_t* values, uint32_t n,
                               uint64_t remote, uint32_t rkey, bool signaled,
                               std::string* cause) {
  // Inline: the NIC driver copies the values at post time.
  sge sg{reinterpret_cast<uint64_t>(values), n * 8, 0};
  send_wr wr;
  std::memset(&wr, 0, sizeof wr);
  wr.sg_list = &sg;
  wr.num_sge = 1;
  wr.opcode = WR_RDMA_WRITE;
  wr.send_flags = SEND_INLINE | (signaled ? SEND_SIGNALED : 0);
  wr.rdma.remote_addr = remote;
  wr.rdma.rkey = rkey;
  WrDesc d;
  d.kind = WrDesc::FLAG_INLINE;
  d.word = word;
  d.value = values[0];
  d.len = n * 8;
  d.remote = remote;
  d.rkey = rkey;
  return post(conn, &wr, d, signaled ? 0 : 1, cause);
}

// The peer's flag words' address, once its rkey is known too (put_call, put_lines); 0 and
// *cause otherwise.
uint64_t VerbsEndpoint::peer_flags(Registry* reg, int conn, std::string* cause) const {
  const uint64_t fbase = reg->peers[conns_[size_t(conn)].peer].flags.load(std::memory_order_acquire);
  if (fbase && qps_[size_t(conn)]->key_set[VERBS_KEY_FLAGS].load(std::memory_order_acquire))
    return fbase;
  *cause = "the address or rkey of the peer's flag words is unknown";
  return 0;
}

bool VerbsEndpoint::put_call(Registry* reg, int conn, uint64_t word, const uint64_t* values,
                             uint64_t n_words, std::string* cause) {
  if (!usable(conn, cause)) return false;
  if (!call_entry_in_range(*reg, word, n_words, cause)) return false;
  Qp& q = *qps_[size_t(conn)];
  const uint64_t fbase = peer_flags(reg, conn, cause);
  if (!fbase) return false;
  // A plain (unsignaled, like a data write) RDMA WRITE in both modes: strict mode's
  // immediate carries only a flag's low bits. One WR where the QP inlines the entry.
  const uint32_t rkey = q.rkey[VERBS_KEY_FLAGS];
  const uint64_t remote = fbase + word * layout::FLAG_BYTES;
  const uint32_t n = uint32_t(n_words);
  if (q.max_inline >= n * 8) return post_words(conn, word, values, n, remote, rkey, false, cause);
  for (uint32_t k = 0; k < n; ++k)
    if (!post_words(conn, word + k, values + k, 1, remote + 8 * k, rkey, false, cause))
      return false;
  return true;
}

bool VerbsEndpoint::drain() {
  if (failed_) return false;
  wc w[POLL_BATCH];
  for (size_t di = 0; di < devs_.size(); ++di) {
    Dev& d = *devs_[di];
    for (;;) {
      int n = poll_cq(d.scq, POLL_BATCH, w);
      if (n < 0)
        return fail(first_conn_on(int(di), -1),
                    "device " + d.name + ": ibv_poll_cq failed (" + std::to_string(n) + ")");
      for (int i = 0; i < n; ++i) {
        uint64_t conn = wr_conn(w[i].wr_id), idx = wr_counter(w[i].wr_id);
        if (conn >= qps_.size())
          return fail(first_conn_on(int(di), -1), "device " + d.name +
                                                      ": completion with unknown wr_id " +
                                                      hex(w[i].wr_id));
        Qp& q = *qps_[size_t(conn)];
        if (w[i].status != WC_SUCCESS) {
          const char* st = api_->wc_status_str(w[i].status);
          q.state = QPS_ERR;
          return fail(int(conn), where(int(conn)) + ": " + (st ? st : "?") + " (status " +
                                     std::to_string(w[i].status) + ", vendor_err " +
                                     hex(w[i].vendor_err) + ") on " +
                                     describe(q.ring[size_t(idx % uint64_t(s_.send_depth))]));
        }
        q.completed.store(idx + 1, std::memory_order_release);
      }
      if (n < POLL_BATCH) break;
    }
    if (!d.rcq) continue;
    const Dev::Key& fk = d.keys[VERBS_KEY_FLAGS];
    const uint64_t mask = (uint64_t(1) << value_bits_) - 1;
    for (;;) {
      int n = poll_cq(d.rcq, POLL_BATCH, w);
      if (n < 0)
        return fail(first_conn_on(int(di), -1),
                    "device " + d.name + ": ibv_poll_cq (receive) failed (" + std::to_string(n) + ")");
      for (int i = 0; i < n; ++i) {
        uint64_t conn = w[i].wr_id;
        if (conn >= qps_.size())
          return fail(first_conn_on(int(di), -1), "device " + d.name +
                                                      ": receive completion with unknown wr_id " +
                                                      hex(w[i].wr_id));
        Qp& q = *qps_[size_t(conn)];
        if (w[i].status != WC_SUCCESS) {
          const char* st = api_->wc_status_str(w[i].status);
          q.state = QPS_ERR;
          return fail(int(conn), where(int(conn)) + ": receive completion: " + (st ? st : "?") +
                                     " (status " + std::to_string(w[i].status) +
                                     ", vendor_err " + hex(w[i].vendor_err) + ")");
        }
        if (!(w[i].wc_flags & WC_WITH_IMM) || w[i].opcode != WC_RECV_RDMA_WITH_IMM)
          return fail(int(conn), where(int(conn)) + ": receive completion without an RDMA "
                                 "WRITE_WITH_IMM (opcode " + std::to_string(w[i].opcode) + ")");
        if (!fk.ready.load(std::memory_order_acquire))
          return fail(int(conn), where(int(conn)) + ": a flag arrived before the flag words "
                                 "were registered");
        uint32_t imm = ntohl(w[i].imm_data);
        uint64_t word = imm >> value_bits_, low = imm & mask;
        if (word >= num_flags_)
          return fail(int(conn), where(int(conn)) + ": flag for word " + std::to_string(word) +
                                     " out of range (" + std::to_string(num_flags_) + " words)");
        uint64_t* p = word_at(fk.addr, word * layout::FLAG_BYTES);
        uint64_t cur = load_relaxed(p);
        uint64_t v = cur + ((low - (cur & mask)) & mask);
        if (v != cur) store_release(p, v);
        recv_wr rw;
        std::memset(&rw, 0, sizeof rw);
        rw.wr_id = conn;
        recv_wr* bad = nullptr;
        int rc = post_recv(q.q, &rw, &bad);
        if (rc) return fail(int(conn), where(int(conn)) + ": ibv_post_recv failed: " + errno_text(rc));
      }
      if (n < POLL_BATCH) break;
    }
  }
  return true;
}

int VerbsEndpoint::conn_of_qp(const qp* x) const {
  for (size_t i = 0; i < qps_.size(); ++i)
    if (qps_[i]->q == x) return int(i);
  return -1;
}

int VerbsEndpoint::first_conn_on(int dev, int port) const {
  for (size_t i = 0; i < qps_.size(); ++i)
    if (qps_[i]->dev == dev && (port < 0 || lanes_[size_t(qps_[i]->lane)].port == port))
      return int(i);
  return qps_.empty() ? 0 : -1;
}

void VerbsEndpoint::check_async() {
  for (size_t di = 0; di < devs_.size() && !failed_; ++di) {
    Dev& d = *devs_[di];
    if (!d.async_ok) continue;
    for (int k = 0; k < 16 && !failed_; ++k) {
      async_event ev;
      std::memset(&ev, 0, sizeof ev);
      if (api_->get_async_event(d.ctx, &ev) != 0) break;
      const int t = ev.event_type;
      const EventScope scope = fatal_scope(t);
      if (scope != EventScope::NONE) {
        const char* name = api_->event_type_str(t);
        std::string what = std::string("async event ") + (name ? name : "?") + " (event " +
                           std::to_string(t) + ")";
        int conn = -1;
        if (scope == EventScope::QP) {
          conn = conn_of_qp(ev.element.q);
          if (conn >= 0) qps_[size_t(conn)]->state = QPS_ERR;
        } else if (scope == EventScope::PORT) {
          conn = first_conn_on(int(di), ev.element.port_num);
          what += " on port " + std::to_string(ev.element.port_num);
        } else {
          conn = first_conn_on(int(di), -1);
        }
        // conn < 0: a port we do not use, or a QP that is not ours: not our failure.
        if (conn >= 0)
          fail(conn, (scope == EventScope::QP ? where(conn) : "device " + d.name) + ": " + what);
      }
      api_->ack_async_event(&ev);
    }
  }
}

bool VerbsEndpoint::poll(int* conn, std::string* cause) {
  if (!failed_ && !closed_.load(std::memory_order_acquire)) {
    drain();
    uint64_t t = now_ns();
    if (!failed_ && t - last_async_ns_ >= ASYNC_CHECK_NS) {
      last_async_ns_ = t;
      check_async();
    }
  }
  if (failed_) {
    *conn = fail_conn_ < 0 ? 0 : fail_conn_;
    *cause = fail_cause_;
    return false;
  }
  return true;
}

uint64_t VerbsEndpoint::outstanding() const {
  uint64_t n = 0;
  for (auto& q : qps_)
    n += q->posted_a.load(std::memory_order_acquire) - q->completed.load(std::memory_order_acquire);
  return n;
}

// ---------------------------------------------------------------------------- adapters

namespace {

class VerbsTransport final : public Transport {
 public:
  VerbsTransport(VerbsEndpoint* ep, Registry* reg) : ep_(ep), reg_(reg) {}
  const char* name() const override { return "verbs"; }
  void start() override {}
  void stop() override {}
  bool write(int conn, int src_region, uint64_t src_off, int dst_region, uint64_t dst_off,
             uint64_t len, std::string* cause) override {
    return ep_->write(reg_, conn, src_region, src_off, dst_region, dst_off, len, cause);
  }
  bool flag(int conn, uint64_t word, uint64_t value, std::string* cause) override {
    return ep_->flag(reg_, conn, word, value, cause);
  }
  bool put_call(int conn, uint64_t word, const uint64_t* values, uint64_t n,
                std::string* cause) override {
    return ep_->put_call(reg_, conn, word, values, n, cause);
  }
  bool put_lines(int conn, uint64_t off, uint64_t len, std::string* cause) override {
    return ep_->put_lines(reg_, conn, off, len, cause);
  }
  bool poll(int* conn, std::string* cause) override { return ep_->poll(conn, cause); }
  void on_abort(const std::string& text) override { ep_->notify_abort(text); }
  uint64_t outstanding() const override { return ep_->outstanding(); }

 private:
  VerbsEndpoint* ep_;  // outlives this: see VerbsEndpoint in verbs_transport.h
  Registry* reg_;
};

}  // namespace

std::unique_ptr<Transport> VerbsEndpoint::make(const ProxySide& side) {
  // Connection i of the proxy's plan must be this endpoint's QP i.
  const auto& mine = conns_;
  bool same = mine.size() == side.conns.size();
  for (size_t i = 0; same && i < mine.size(); ++i)
    same = mine[i].peer == side.conns[i].peer && mine[i].channel == side.conns[i].channel &&
           mine[i].root == side.conns[i].root;
  if (!same)
    throw std::invalid_argument("VerbsEndpoint: its connections differ from the proxy's plan");
  return std::unique_ptr<Transport>(new VerbsTransport(this, side.reg));
}

}  // namespace sparkccl
