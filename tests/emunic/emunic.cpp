// emunic: an emulated RoCE NIC for tests -- a libibverbs stand-in that processes on one host
// use to connect RC queue pairs to each other (tests/test_verbs_emunic.py; issue 19).
//
// Test infrastructure only: tests/testlibs.py compiles it on first use; the verbs transport
// loads it in place of libibverbs when SPARKCCL_IBVERBS_LIB names it. It exports exactly the
// libibverbs subset native/src/verbs_api.h declares, with the real ABI (same structs, the
// data path through the context's ops vector).
//
// Configuration: SPARKCCL_EMUNIC_CONFIG names a fake sysfs root (tests/fakesysfs.py; the
// same tree SPARKCCL_SYSFS_ROOT points sparkccl's discovery at). Devices, ports, port state,
// link layer, GIDs and the active MTU (from the netdev MTU, as mlx5 derives it) are read
// from it, so a GB10 tree gives one ConnectX with two ports, two PCIe functions (roots)
// each. An optional <root>/emunic.conf holds key=value lines:
//   rate_gbps=R     every root (device) sends at most R Gb/s (token bucket, see pace());
//                   0 = unlimited
//   pace_on_wake=1  a slot starts no earlier than the sender thread runs (the old limiter,
//                   for before/after measurements: it loses the time a late thread costs)
//   latency_us=L    a write lands L us after it was sent (one way; acks are not delayed)
//   trace=1         keep a record of every work request (when posted, when its bytes went out
//                   under the rate limit, when they landed at the responder) for
//                   benchmarks/efficiency_breakdown.py, read with emunic_trace() below
//   reorder_ms=D    PCIe reordering: the bytes of a non-inline RDMA WRITE become visible D ms
//                   after they arrive; inline writes (the inline-mode flag) at once; the
//                   receive completion of a WRITE_WITH_IMM only after every earlier write of
//                   its QP is visible (what real NICs guarantee, and strict ordering uses)
// <root>/emunic/ is the rendezvous: qp/<qpn> holds the pid of the process owning QP qpn
// (QP numbers are unique across processes); each process listens on the abstract Unix
// socket "sparkccl-emunic-<pid>".
//
// The wire: a QP in RTS connects one stream socket to the process owning its destination QP
// (hello: source QPN, destination QPN, destination GID). Each work request is a header plus
// payload; the receiving process's engine thread (the "NIC" of that process) checks the
// destination QP (state, pairing, GID), the rkey, bounds and access of its registered memory,
// writes the bytes into that memory (its DMA), consumes a posted receive for WRITE_WITH_IMM,
// and acks. Writes of one QP therefore execute in order. The sender's CQ gets a completion
// on the ack (signaled WRs, or any error). Statuses:
//   rkey / bounds / access refused at the responder  -> IBV_WC_REM_ACCESS_ERR
//   lkey / bounds of the local buffer                 -> IBV_WC_LOC_PROT_ERR
//   peer process dead (connection lost) or its QP gone, unreachable, or paired elsewhere
//                                                    -> IBV_WC_RETRY_EXC_ERR after the QP's
//      timeout x (retry_cnt + 1): 4.096 us x 2^timeout per attempt, as on the real NIC (a
//      live but slow peer never times out: its acks are only late, which real
//      retransmissions would hide)
//   WRITE_WITH_IMM without a posted receive         -> waits (rnr_retry 7), else after
//      rnr_retry x min_rnr_timer IBV_WC_RNR_RETRY_EXC_ERR
// then the QP is in ERR and later work requests are flushed (IBV_WC_WR_FLUSH_ERR).
// Async events: IBV_EVENT_PORT_ERR / IBV_EVENT_PORT_ACTIVE when a port's sysfs state file
// changes (tests flip it), IBV_EVENT_DEVICE_FATAL when <root>/emunic/fatal-<device> exists.
#include <arpa/inet.h>
#include <stdarg.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <dirent.h>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

#include "verbs_api.h"
#include "verbs_names.h"

namespace emunic {

using namespace sparkccl::ibv;

namespace {

uint64_t now_ns() {
  return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now().time_since_epoch())
                      .count());
}

void sleep_ns(uint64_t ns) { std::this_thread::sleep_for(std::chrono::nanoseconds(ns)); }

std::string read_text(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "r");
  if (!f) return std::string();
  char buf[256];
  size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  std::string s(buf, n);
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

std::vector<std::string> list_dir(const std::string& path) {
  std::vector<std::string> out;
  DIR* d = opendir(path.c_str());
  if (!d) return out;
  while (dirent* e = readdir(d))
    if (e->d_name[0] != '.') out.push_back(e->d_name);
  closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

// "fe80:0000:...:0001" (8 groups) -> 16 bytes; empty on a malformed entry.
std::string parse_gid(const std::string& text) {
  std::string out;
  unsigned g[8];
  if (std::sscanf(text.c_str(), "%x:%x:%x:%x:%x:%x:%x:%x", &g[0], &g[1], &g[2], &g[3], &g[4],
                  &g[5], &g[6], &g[7]) != 8)
    return out;
  for (unsigned v : g) {
    out.push_back(char(v >> 8));
    out.push_back(char(v & 0xff));
  }
  return out;
}

// "4: ACTIVE" -> 4
int leading_int(const std::string& s, int fallback) {
  char* end = nullptr;
  long v = std::strtol(s.c_str(), &end, 10);
  return end == s.c_str() ? fallback : int(v);
}

// What mlx5 reports as the active MTU of a RoCE port: the largest IB MTU that fits in the
// netdev MTU less the RoCE headers (sparkccl/fabric/discovery.py: roce_active_mtu).
int roce_mtu_enum(int netdev_mtu) {
  int best = 0;
  for (int e = MTU_256; e <= MTU_4096; ++e)
    if (mtu_bytes(e) <= netdev_mtu - 96) best = e;
  return best;
}

// ---- configuration ------------------------------------------------------------------------

struct PortCfg {
  int num = 1;
  std::string dir;  // <root>/class/infiniband/<dev>/ports/<num>
  int link_layer = LINK_LAYER_ETHERNET;
  int active_mtu = MTU_4096;
  std::vector<std::string> gids;  // 16 bytes, or empty for an unused slot
  int state() const { return leading_int(read_text(dir + "/state"), PORT_DOWN); }
};

struct DevCfg {
  std::string name;
  std::vector<PortCfg> ports;
  const PortCfg* port(int n) const {
    for (auto& p : ports)
      if (p.num == n) return &p;
    return nullptr;
  }
};

struct Conf {
  std::string root, rv;  // sysfs root, rendezvous directory
  std::vector<DevCfg> devs;
  double rate_gbps = 0;
  double latency_us = 0;
  double reorder_ms = 0;
  bool trace = false;
  bool pace_on_wake = false;
  std::string error;  // why there are no devices
};

Conf load_conf() {
  Conf c;
  const char* env = std::getenv("SPARKCCL_EMUNIC_CONFIG");
  if (!env || !*env) {
    c.error = "SPARKCCL_EMUNIC_CONFIG is not set (a fake sysfs root, tests/fakesysfs.py)";
    return c;
  }
  c.root = env;
  c.rv = c.root + "/emunic";
  mkdir(c.rv.c_str(), 0777);
  mkdir((c.rv + "/qp").c_str(), 0777);
  const std::string ib = c.root + "/class/infiniband";
  for (const std::string& name : list_dir(ib)) {
    DevCfg d;
    d.name = name;
    const std::string dd = ib + "/" + name;
    int netdev_mtu = 1500;
    std::vector<std::string> nets = list_dir(dd + "/device/net");
    if (!nets.empty()) netdev_mtu = leading_int(read_text(dd + "/device/net/" + nets[0] + "/mtu"), 1500);
    for (const std::string& pn : list_dir(dd + "/ports")) {
      PortCfg p;
      p.num = leading_int(pn, 1);
      p.dir = dd + "/ports/" + pn;
      p.link_layer = read_text(p.dir + "/link_layer") == "InfiniBand" ? LINK_LAYER_INFINIBAND
                                                                     : LINK_LAYER_ETHERNET;
      p.active_mtu = p.link_layer == LINK_LAYER_ETHERNET ? roce_mtu_enum(netdev_mtu) : MTU_4096;
      std::vector<std::string> idx = list_dir(p.dir + "/gids");
      std::sort(idx.begin(), idx.end(), [](const std::string& a, const std::string& b) {
        return leading_int(a, 0) < leading_int(b, 0);
      });
      for (const std::string& k : idx) {
        size_t i = size_t(leading_int(k, 0));
        if (p.gids.size() <= i) p.gids.resize(i + 1);
        std::string g = parse_gid(read_text(p.dir + "/gids/" + k));
        if (g.size() == 16 && g != std::string(16, '\0')) p.gids[i] = g;
      }
      d.ports.push_back(p);
    }
    c.devs.push_back(d);
  }
  if (c.devs.empty()) c.error = "no devices under " + ib;
  FILE* f = std::fopen((c.root + "/emunic.conf").c_str(), "r");
  if (f) {
    char line[256];
    while (std::fgets(line, sizeof line, f)) {
      double v = 0;
      if (std::sscanf(line, "rate_gbps=%lf", &v) == 1) c.rate_gbps = v;
      else if (std::sscanf(line, "latency_us=%lf", &v) == 1) c.latency_us = v;
      else if (std::sscanf(line, "reorder_ms=%lf", &v) == 1) c.reorder_ms = v;
      else if (std::sscanf(line, "trace=%lf", &v) == 1) c.trace = v != 0;
      else if (std::sscanf(line, "pace_on_wake=%lf", &v) == 1) c.pace_on_wake = v != 0;
    }
    std::fclose(f);
  }
  return c;
}

bool access_ok(const std::string& path) { return ::access(path.c_str(), F_OK) == 0; }

// ---- objects ------------------------------------------------------------------------------

struct Nic;
Nic& nic();

struct Ctx {
  context ctx{};  // first: the context* handed out points here
  const DevCfg* dev = nullptr;
  std::mutex mu;
  std::deque<async_event> events;
  std::map<int, int> port_state;  // last seen, for PORT_ERR / PORT_ACTIVE
  bool fatal_sent = false;
  uint64_t last_check_ns = 0;
};

struct Pd {
  pd p{};
};

struct Mr {
  mr m{};
  int access = 0;
};

struct Cq {
  cq c{};
  std::mutex mu;
  std::deque<wc> entries;
};

struct Wr {
  uint64_t wr_id = 0, seq = 0;
  uint64_t posted_ns = 0;  // ibv_post_send: the earliest its slot on the link can start
  int opcode = 0;
  bool signaled = false, inline_ = false;
  std::string inline_data;
  uint64_t laddr = 0, raddr = 0;
  uint32_t len = 0, lkey = 0, rkey = 0, imm = 0;
};

struct Qp {
  qp q{};  // first: the qp* handed out points here
  Ctx* owner = nullptr;
  Pd* prot = nullptr;
  Cq* scq = nullptr;
  Cq* rcq = nullptr;
  qp_init_attr init{};
  std::atomic<int> state{QPS_RESET};
  int port = 1, access = 0, path_mtu = 0, timeout = 14, retry_cnt = 7, rnr_retry = 7,
      min_rnr_timer = 12;
  uint32_t dest_qpn = 0;
  gid dgid{};
  std::string qpn_file;
  // send side (sender and acker threads, from RTS on)
  std::mutex smu;
  std::condition_variable scv;
  std::deque<Wr> sq;        // posted, not yet sent
  std::deque<Wr> inflight;  // sent (or unsendable), not yet acked
  uint64_t next_seq = 0;
  int fd = -1;
  bool broken = false, stop = false;
  uint64_t broken_ns = 0;
  std::thread sender, acker;
  // receive side
  std::mutex rmu;
  std::condition_variable rcv;
  std::deque<uint64_t> rq;  // posted receive wr_ids
  bool destroyed = false;
};

// Bytes of a reordered write still on their way to memory.
struct Deferred {
  Qp* dst;
  uint64_t due_ns, addr;
  uint32_t rkey;
  std::string data;
};

struct Wire {
  static constexpr uint32_t MAGIC = 0x454d4e43;  // "EMNC"
  struct Hello {
    uint32_t magic, src_qpn, dst_qpn, pad;
    uint8_t dgid[16];
  };
  struct Header {
    uint64_t seq, raddr, sent_ns;  // sent_ns: steady clock, the same in every process
    uint32_t rkey, len, imm;
    uint8_t opcode, inline_, pad[2];
  };
  struct Ack {
    uint64_t seq;
    int32_t status;
    uint32_t pad;
  };
};

struct Nic {
  Conf conf;
  std::mutex mu;  // tables below
  std::vector<std::unique_ptr<char>> tokens;  // opaque device* values, one per device
  std::vector<Ctx*> ctxs;
  std::map<uint32_t, Qp*> qps;
  std::shared_mutex mr_mu;  // held (shared) while bytes land in registered memory
  std::map<uint32_t, Mr*> by_lkey, by_rkey;
  uint32_t next_key = 0;
  std::mutex dmu;
  std::condition_variable dcv;
  std::deque<Deferred> deferred;
  struct Bucket {
    std::mutex mu;
    uint64_t next_free_ns = 0;
  };
  std::map<std::string, std::unique_ptr<Bucket>> buckets;
  // trace=1: one line per event, handed out (and cleared) by emunic_trace()
  std::mutex tmu;
  std::string trace_text;
  std::atomic<uint64_t> post_calls{0}, post_wrs{0}, post_ns{0};  // inside ibv_post_send
  void trace(const char* fmt, ...) __attribute__((format(printf, 2, 3)));
  int listen_fd = -1;
  bool started = false;

  Nic() {
    conf = load_conf();
    for (size_t i = 0; i < conf.devs.size(); ++i) tokens.emplace_back(new char(0));
    for (auto& d : conf.devs) buckets[d.name].reset(new Bucket);
    next_key = (uint32_t(getpid()) * 2654435761u) & 0x00ffff00u;
  }
  void start();
};

void Nic::trace(const char* fmt, ...) {
  char line[256];
  va_list ap;
  va_start(ap, fmt);
  int n = std::vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  std::lock_guard<std::mutex> lk(tmu);
  trace_text.append(line, size_t(std::min<int>(n, int(sizeof line) - 1)));
}

// Never destroyed: engine threads may run until the process exits.
Nic& nic() {
  static Nic* n = new Nic;
  return *n;
}

const char* socket_name_prefix = "sparkccl-emunic-";

sockaddr_un abstract_addr(int pid, socklen_t* len) {
  sockaddr_un a;
  std::memset(&a, 0, sizeof a);
  a.sun_family = AF_UNIX;
  std::string name = socket_name_prefix + std::to_string(pid);
  std::memcpy(a.sun_path + 1, name.data(), name.size());
  *len = socklen_t(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return a;
}

bool read_full(int fd, void* buf, size_t n) {
  char* p = static_cast<char*>(buf);
  while (n) {
    ssize_t r = recv(fd, p, n, MSG_WAITALL);
    if (r <= 0) {
      if (r < 0 && errno == EINTR) continue;
      return false;
    }
    p += r;
    n -= size_t(r);
  }
  return true;
}

bool write_full(int fd, const void* a, size_t na, const void* b = nullptr, size_t nb = 0) {
  iovec v[2] = {{const_cast<void*>(a), na}, {const_cast<void*>(b), nb}};
  int cnt = nb ? 2 : 1;
  int i = 0;
  while (i < cnt) {
    msghdr m;
    std::memset(&m, 0, sizeof m);
    m.msg_iov = v + i;
    m.msg_iovlen = size_t(cnt - i);
    ssize_t r = sendmsg(fd, &m, MSG_NOSIGNAL);
    if (r < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    size_t left = size_t(r);
    while (i < cnt && left >= v[i].iov_len) left -= v[i++].iov_len;
    if (i < cnt) {
      v[i].iov_base = static_cast<char*>(v[i].iov_base) + left;
      v[i].iov_len -= left;
    }
  }
  return true;
}

void push_cqe(Cq* c, const wc& w) {
  std::lock_guard<std::mutex> lk(c->mu);
  // A full CQ is a CQ overrun on real hardware (async CQ_ERR); sparkccl sizes its CQs so
  // that it never happens, so report it the same way.
  if (int(c->entries.size()) >= c->c.cqe) {
    Ctx* x = reinterpret_cast<Ctx*>(c->c.ctx);
    std::lock_guard<std::mutex> l2(x->mu);
    async_event ev{};
    ev.element.c = &c->c;
    ev.event_type = EVENT_CQ_ERR;
    x->events.push_back(ev);
    return;
  }
  c->entries.push_back(w);
}

// Completion of a send WR (signaled ones, and every error).
void complete(Qp* q, const Wr& w, int status) {
  if (status == WC_SUCCESS && !w.signaled && !q->init.sq_sig_all) return;
  wc c{};
  c.wr_id = w.wr_id;
  c.status = status;
  c.opcode = WC_RDMA_WRITE;
  c.qp_num = q->q.qp_num;
  c.vendor_err = status == WC_SUCCESS ? 0 : 0x100 + uint32_t(status);
  push_cqe(q->scq, c);
}

// The QP is in error: complete the first unfinished WR with `status` and flush the rest.
// Called with q->smu held.
void to_error(Qp* q, int status) {
  q->state.store(QPS_ERR);
  q->q.state = QPS_ERR;
  bool first = true;
  for (auto* list : {&q->inflight, &q->sq}) {
    for (auto& w : *list) {
      complete(q, w, first ? status : WC_WR_FLUSH_ERR);
      first = false;
    }
    list->clear();
  }
}

uint64_t retry_ns(const Qp* q) {
  // 4.096 us x 2^timeout per attempt, 1 + retry_cnt attempts (timeout 0: infinite on real
  // hardware; here the largest value)
  int t = q->timeout ? q->timeout : 31;
  return uint64_t(4096.0 * double(uint64_t(1) << t) * (q->retry_cnt + 1));
}

// Returns when the bytes may go: the start of their slot on the root's link. The slot starts
// when the link is free and the work request was posted, as on a NIC: not when this
// process's sender thread got round to it. A thread that runs late (a busy host) sends
// the backlog at once and the link loses no time; it can never get ahead of the link,
// since every slot starts after the previous one ended (benchmarks/efficiency_breakdown.py
// measured what a late thread used to cost: up to 3.6% of a call on 2 busy CPUs).
uint64_t pace(const std::string& dev, uint64_t bytes, uint64_t posted_ns) {
  Nic& n = nic();
  if (n.conf.rate_gbps <= 0) return now_ns();
  Nic::Bucket& b = *n.buckets[dev];
  uint64_t start;
  {
    std::lock_guard<std::mutex> lk(b.mu);
    start = std::max(n.conf.pace_on_wake ? now_ns() : posted_ns, b.next_free_ns);
    b.next_free_ns = start + uint64_t(double(bytes) * 8.0 / n.conf.rate_gbps);
  }
  const uint64_t now = now_ns();
  if (start > now) sleep_ns(start - now);
  return start;
}

Mr* find_mr(std::map<uint32_t, Mr*>& table, uint32_t key, Pd* prot, uint64_t addr, uint64_t len,
            int need) {
  auto it = table.find(key);
  if (it == table.end()) return nullptr;
  Mr* m = it->second;
  const uint64_t a = reinterpret_cast<uint64_t>(m->m.addr);
  if (m->m.owner != &prot->p || addr < a || addr + len > a + m->m.length || addr + len < addr)
    return nullptr;
  if ((m->access & need) != need) return nullptr;
  return m;
}

// ---- the sending side -------------------------------------------------------------------

int connect_peer(Qp* q) {
  Nic& n = nic();
  char name[32];
  std::snprintf(name, sizeof name, "%06x", q->dest_qpn);
  int pid = leading_int(read_text(n.conf.rv + "/qp/" + name), 0);
  if (pid <= 0) return -1;
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  socklen_t len;
  sockaddr_un a = abstract_addr(pid, &len);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), len) != 0) {
    close(fd);
    return -1;
  }
  Wire::Hello h{};
  h.magic = Wire::MAGIC;
  h.src_qpn = q->q.qp_num;
  h.dst_qpn = q->dest_qpn;
  std::memcpy(h.dgid, q->dgid.raw, 16);
  int32_t status = -1;
  if (!write_full(fd, &h, sizeof h) || !read_full(fd, &status, sizeof status) || status != 0) {
    close(fd);  // no such QP there, or not ours: packets that are dropped, then retried
    return -1;
  }
  return fd;
}

void sender_main(Qp* q) {
  std::unique_lock<std::mutex> lk(q->smu);
  for (;;) {
    q->scv.wait(lk, [&] { return q->stop || !q->sq.empty(); });
    if (q->stop) return;
    if (q->state.load() == QPS_ERR) {  // flushed
      to_error(q, WC_WR_FLUSH_ERR);
      continue;
    }
    Wr w = q->sq.front();
    q->sq.pop_front();
    if (!w.inline_ && w.len) {
      std::shared_lock<std::shared_mutex> ml(nic().mr_mu);
      if (!find_mr(nic().by_lkey, w.lkey, q->prot, w.laddr, w.len, 0)) {
        q->inflight.push_back(w);
        to_error(q, WC_LOC_PROT_ERR);
        continue;
      }
    }
    q->inflight.push_back(w);
    if (q->broken) {  // the acker fails it when the retries are over
      q->scv.notify_all();
      continue;
    }
    if (q->fd < 0) {
      // Packets to a QP that is not there (yet) are dropped and retransmitted: try until
      // the QP's retries are over.
      const uint64_t give_up = now_ns() + retry_ns(q);
      int fd;
      for (;;) {
        lk.unlock();
        fd = connect_peer(q);
        lk.lock();
        if (fd >= 0 || q->stop || now_ns() > give_up) break;
        q->scv.wait_for(lk, std::chrono::milliseconds(2));
      }
      if (q->stop) {
        if (fd >= 0) close(fd);
        return;
      }
      if (fd < 0) {  // the retries are over already
        q->broken = true;
        q->broken_ns = now_ns() - retry_ns(q);
        q->scv.notify_all();
        continue;
      }
      q->fd = fd;
      q->scv.notify_all();  // the acker starts reading
    }
    const int fd = q->fd;
    lk.unlock();
    const uint64_t slot_ns = pace(q->owner->dev->name, w.len + 64, w.posted_ns);
    const uint64_t go_ns = now_ns();
    Wire::Header h{};
    h.seq = w.seq;
    h.raddr = w.raddr;
    h.sent_ns = now_ns();
    h.rkey = w.rkey;
    h.len = w.len;
    h.imm = w.imm;
    h.opcode = uint8_t(w.opcode);
    h.inline_ = w.inline_;
    bool ok;
    if (w.inline_) {
      ok = write_full(fd, &h, sizeof h, w.inline_data.data(), w.inline_data.size());
    } else {
      std::shared_lock<std::shared_mutex> ml(nic().mr_mu);
      ok = write_full(fd, &h, sizeof h, reinterpret_cast<const void*>(w.laddr), w.len);
    }
    if (nic().conf.trace)  // S dev qpn seq opcode len posted slot go sent
      nic().trace("S %s %u %llu %d %u %llu %llu %llu %llu\n", q->owner->dev->name.c_str(),
                  q->q.qp_num, (unsigned long long)w.seq, w.opcode, w.len,
                  (unsigned long long)w.posted_ns, (unsigned long long)slot_ns,
                  (unsigned long long)go_ns, (unsigned long long)now_ns());
    lk.lock();
    if (!ok && !q->broken) {
      q->broken = true;
      q->broken_ns = now_ns();
      q->scv.notify_all();
    }
  }
}

void acker_main(Qp* q) {
  std::unique_lock<std::mutex> lk(q->smu);
  for (;;) {
    q->scv.wait(lk, [&] { return q->stop || q->fd >= 0 || q->broken; });
    if (q->stop) return;
    if (q->broken) break;
    const int fd = q->fd;
    lk.unlock();
    Wire::Ack a{};
    bool ok = read_full(fd, &a, sizeof a);
    lk.lock();
    if (q->stop) return;
    if (!ok) {
      if (!q->broken) {
        q->broken = true;
        q->broken_ns = now_ns();
      }
      break;
    }
    if (q->inflight.empty() || q->inflight.front().seq != a.seq) {
      to_error(q, WC_GENERAL_ERR);  // cannot happen: acks come in order
      return;
    }
    if (a.status != WC_SUCCESS) {
      to_error(q, a.status);
      return;
    }
    complete(q, q->inflight.front(), WC_SUCCESS);
    q->inflight.pop_front();
  }
  // The peer is gone: every attempt of the oldest WR times out, then the QP fails.
  const uint64_t deadline = q->broken_ns + retry_ns(q);
  while (!q->stop && now_ns() < deadline)
    q->scv.wait_for(lk, std::chrono::milliseconds(5));
  if (q->stop) return;
  if (q->inflight.empty() && q->sq.empty()) {
    // Nothing was outstanding when the connection dropped: the next WR fails after its
    // own retries.
    q->scv.wait(lk, [&] { return q->stop || !q->inflight.empty(); });
    if (q->stop) return;
    const uint64_t d2 = now_ns() + retry_ns(q);
    while (!q->stop && now_ns() < d2) q->scv.wait_for(lk, std::chrono::milliseconds(5));
    if (q->stop) return;
  }
  to_error(q, WC_RETRY_EXC_ERR);
}

// ---- the receiving side (this process's NIC engine) --------------------------------------

void apply_deferred(Qp* only, bool all_due) {
  Nic& n = nic();
  std::vector<Deferred> ready;
  {
    std::lock_guard<std::mutex> lk(n.dmu);
    const uint64_t now = now_ns();
    for (auto it = n.deferred.begin(); it != n.deferred.end();) {
      if ((only && it->dst == only) || (all_due && it->due_ns <= now)) {
        ready.push_back(std::move(*it));
        it = n.deferred.erase(it);
      } else {
        ++it;
      }
    }
  }
  std::shared_lock<std::shared_mutex> ml(n.mr_mu);
  for (auto& d : ready)  // memory deregistered meanwhile (its owner gave up): dropped
    if (find_mr(n.by_rkey, d.rkey, d.dst->prot, d.addr, d.data.size(), ACCESS_REMOTE_WRITE))
      std::memcpy(reinterpret_cast<void*>(d.addr), d.data.data(), d.data.size());
}

void reorder_main() {
  Nic& n = nic();
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(n.dmu);
      n.dcv.wait_for(lk, std::chrono::milliseconds(1));
    }
    apply_deferred(nullptr, true);
  }
}

bool gid_is_mine(const Qp* q, const uint8_t* g) {
  const PortCfg* p = q->owner->dev->port(q->port);
  if (!p) return false;
  if (p->link_layer != LINK_LAYER_ETHERNET) return true;  // IB: routed by LID
  for (auto& x : p->gids)
    if (x.size() == 16 && std::memcmp(x.data(), g, 16) == 0) return true;
  return false;
}

bool discard(int fd, uint64_t n) {
  char buf[4096];
  while (n) {
    size_t k = size_t(std::min<uint64_t>(n, sizeof buf));
    if (!read_full(fd, buf, k)) return false;
    n -= k;
  }
  return true;
}

void engine_conn(int fd) {
  Nic& n = nic();
  Wire::Hello h{};
  if (!read_full(fd, &h, sizeof h) || h.magic != Wire::MAGIC) {
    close(fd);
    return;
  }
  Qp* q = nullptr;
  {
    std::lock_guard<std::mutex> lk(n.mu);
    auto it = n.qps.find(h.dst_qpn);
    if (it != n.qps.end()) q = it->second;
  }
  int32_t st = 0;
  if (!q || q->destroyed || (q->state.load() != QPS_RTR && q->state.load() != QPS_RTS) ||
      q->dest_qpn != h.src_qpn || !gid_is_mine(q, h.dgid))
    st = 1;
  if (!write_full(fd, &st, sizeof st) || st) {
    close(fd);
    return;
  }
  const bool reorder = n.conf.reorder_ms > 0;
  for (;;) {
    Wire::Header m{};
    if (!read_full(fd, &m, sizeof m)) break;
    const uint64_t arrive_ns = now_ns();
    int status = WC_SUCCESS;
    if (q->destroyed || q->state.load() == QPS_ERR) break;  // dropped: the sender retries
    if (n.conf.latency_us > 0) {  // in flight until then (later writes queue behind it)
      const uint64_t due = m.sent_ns + uint64_t(n.conf.latency_us * 1e3), t = now_ns();
      if (due > t) sleep_ns(due - t);
    }
    {
      std::shared_lock<std::shared_mutex> ml(n.mr_mu);
      bool ok = (q->access & ACCESS_REMOTE_WRITE) &&
                (m.len == 0 || find_mr(n.by_rkey, m.rkey, q->prot, m.raddr, m.len,
                                       ACCESS_REMOTE_WRITE));
      if (!ok) {
        status = WC_REM_ACCESS_ERR;
        if (!discard(fd, m.len)) break;
      } else if (m.len && reorder && !m.inline_) {
        Deferred d{q, now_ns() + uint64_t(n.conf.reorder_ms * 1e6), m.raddr, m.rkey,
                   std::string(m.len, '\0')};
        if (!read_full(fd, &d.data[0], m.len)) break;
        std::lock_guard<std::mutex> dl(n.dmu);
        n.deferred.push_back(std::move(d));
      } else if (m.len) {
        if (!read_full(fd, reinterpret_cast<void*>(m.raddr), m.len)) break;
      }
    }
    if (n.conf.trace)  // R qpn src_qpn seq opcode len sent arrived landed
      n.trace("R %u %u %llu %d %u %llu %llu %llu\n", q->q.qp_num, h.src_qpn,
              (unsigned long long)m.seq, int(m.opcode), m.len, (unsigned long long)m.sent_ns,
              (unsigned long long)arrive_ns, (unsigned long long)now_ns());
    if (status == WC_SUCCESS && m.opcode == WR_RDMA_WRITE_WITH_IMM) {
      uint64_t wr_id = 0;
      bool got = false;
      {
        std::unique_lock<std::mutex> rl(q->rmu);
        // Receiver not ready: 7 retries forever; else rnr_retry x min_rnr_timer (0.01 ms x
        // 2^(timer/2), roughly the IB table) before the sender gives up.
        const uint64_t wait = q->rnr_retry >= 7 ? UINT64_MAX
                                                : uint64_t(q->rnr_retry + 1) *
                                                      (uint64_t(10000) << (q->min_rnr_timer / 2));
        const uint64_t t0 = now_ns();
        while (!got) {
          if (!q->rq.empty()) {
            wr_id = q->rq.front();
            q->rq.pop_front();
            got = true;
          } else if (q->destroyed || now_ns() - t0 > wait) {
            break;
          } else {
            q->rcv.wait_for(rl, std::chrono::milliseconds(2));
          }
        }
      }
      if (!got) {
        status = WC_RNR_RETRY_EXC_ERR;
      } else {
        apply_deferred(q, false);  // the receive completion follows every earlier write
        wc c{};
        c.wr_id = wr_id;
        c.status = WC_SUCCESS;
        c.opcode = WC_RECV_RDMA_WITH_IMM;
        c.wc_flags = WC_WITH_IMM;
        c.imm_data = m.imm;
        c.byte_len = m.len;
        c.qp_num = q->q.qp_num;
        c.src_qp = h.src_qpn;
        push_cqe(q->rcq, c);
      }
    }
    Wire::Ack a{};
    a.seq = m.seq;
    a.status = status;
    if (!write_full(fd, &a, sizeof a)) break;
  }
  close(fd);
}

void accept_main(int lfd) {
  for (;;) {
    int fd = accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      sleep_ns(1000000);
      continue;
    }
    std::thread(engine_conn, fd).detach();
  }
}

void Nic::start() {
  // with mu held
  if (started) return;
  started = true;
  listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  socklen_t len;
  sockaddr_un a = abstract_addr(getpid(), &len);
  if (listen_fd < 0 || bind(listen_fd, reinterpret_cast<sockaddr*>(&a), len) != 0 ||
      listen(listen_fd, 256) != 0) {
    std::fprintf(stderr, "emunic: cannot listen on @%s%d: %s\n", socket_name_prefix, getpid(),
                 std::strerror(errno));
    return;
  }
  std::thread(accept_main, listen_fd).detach();
  if (conf.reorder_ms > 0) std::thread(reorder_main).detach();
}

// ---- verbs ----------------------------------------------------------------------------------

Ctx* ctx_of(context* c) { return reinterpret_cast<Ctx*>(c); }
Qp* qp_of(qp* q) { return reinterpret_cast<Qp*>(q); }
Cq* cq_of(cq* c) { return reinterpret_cast<Cq*>(c); }

int e_post_send(qp* x, send_wr* wr, send_wr** bad) {
  Qp* q = qp_of(x);
  const uint64_t t0 = now_ns();
  struct Count {  // the call's own cost, for the per-work-request figure (trace=1)
    uint64_t t0, wrs = 0;
    ~Count() {
      Nic& n = nic();
      if (!n.conf.trace) return;
      n.post_calls.fetch_add(1);
      n.post_wrs.fetch_add(wrs);
      n.post_ns.fetch_add(now_ns() - t0);
    }
  } count{t0};
  std::lock_guard<std::mutex> lk(q->smu);
  for (; wr; wr = wr->next) {
    int e = 0;
    const int st = q->state.load();
    if (st != QPS_RTS && st != QPS_ERR) e = EINVAL;
    else if (wr->opcode != WR_RDMA_WRITE && wr->opcode != WR_RDMA_WRITE_WITH_IMM) e = EINVAL;
    else if (wr->num_sge < 0 || wr->num_sge > 1 || uint32_t(wr->num_sge) > q->init.cap.max_send_sge) e = EINVAL;
    else if (q->sq.size() + q->inflight.size() >= q->init.cap.max_send_wr) e = ENOMEM;
    Wr w;
    if (!e) {
      w.wr_id = wr->wr_id;
      w.opcode = wr->opcode;
      w.signaled = (wr->send_flags & SEND_SIGNALED) != 0;
      w.inline_ = (wr->send_flags & SEND_INLINE) != 0;
      w.raddr = wr->rdma.remote_addr;
      w.rkey = wr->rdma.rkey;
      w.imm = wr->imm_data;
      if (wr->num_sge == 1) {
        w.laddr = wr->sg_list[0].addr;
        w.len = wr->sg_list[0].length;
        w.lkey = wr->sg_list[0].lkey;
      }
      if (w.inline_) {
        if (w.len > q->init.cap.max_inline_data) e = EINVAL;
        else w.inline_data.assign(reinterpret_cast<const char*>(w.laddr), w.len);  // copied now
      }
    }
    if (e) {
      *bad = wr;
      return e;
    }
    w.seq = q->next_seq++;
    w.posted_ns = t0;
    ++count.wrs;
    q->sq.push_back(std::move(w));
  }
  q->scv.notify_all();
  return 0;
}

int e_post_recv(qp* x, recv_wr* wr, recv_wr** bad) {
  Qp* q = qp_of(x);
  std::lock_guard<std::mutex> lk(q->rmu);
  for (; wr; wr = wr->next) {
    if (q->state.load() == QPS_RESET || q->rq.size() >= q->init.cap.max_recv_wr) {
      *bad = wr;
      return q->state.load() == QPS_RESET ? EINVAL : ENOMEM;
    }
    q->rq.push_back(wr->wr_id);
  }
  q->rcv.notify_all();
  return 0;
}

int e_poll_cq(cq* x, int num, wc* out) {
  Cq* c = cq_of(x);
  std::lock_guard<std::mutex> lk(c->mu);
  int k = 0;
  while (k < num && !c->entries.empty()) {
    out[k++] = c->entries.front();
    c->entries.pop_front();
  }
  return k;
}

}  // namespace
}  // namespace emunic

// ---- libibverbs' exported names -------------------------------------------------------------

using namespace sparkccl::ibv;
using emunic::Ctx;
using emunic::Nic;
using emunic::nic;

extern "C" {

device** ibv_get_device_list(int* num) {
  Nic& n = nic();
  if (n.conf.devs.empty()) {
    std::fprintf(stderr, "emunic: %s\n", n.conf.error.c_str());
    errno = ENOSYS;
    return nullptr;
  }
  device** list = new device*[n.tokens.size() + 1];
  for (size_t i = 0; i < n.tokens.size(); ++i) list[i] = reinterpret_cast<device*>(n.tokens[i].get());
  list[n.tokens.size()] = nullptr;
  if (num) *num = int(n.tokens.size());
  return list;
}

void ibv_free_device_list(device** list) { delete[] list; }

const char* ibv_get_device_name(device* d) {
  Nic& n = nic();
  for (size_t i = 0; i < n.tokens.size(); ++i)
    if (reinterpret_cast<device*>(n.tokens[i].get()) == d) return n.conf.devs[i].name.c_str();
  return nullptr;
}

context* ibv_open_device(device* d) {
  Nic& n = nic();
  std::lock_guard<std::mutex> lk(n.mu);
  for (size_t i = 0; i < n.tokens.size(); ++i) {
    if (reinterpret_cast<device*>(n.tokens[i].get()) != d) continue;
    n.start();
    Ctx* c = new Ctx;
    c->dev = &n.conf.devs[i];
    c->ctx.dev = d;
    c->ctx.ops.poll_cq = emunic::e_poll_cq;
    c->ctx.ops.post_send = emunic::e_post_send;
    c->ctx.ops.post_recv = emunic::e_post_recv;
    c->ctx.cmd_fd = -1;
    c->ctx.async_fd = eventfd(0, EFD_CLOEXEC);
    c->ctx.num_comp_vectors = 1;
    for (auto& p : c->dev->ports) c->port_state[p.num] = p.state();
    n.ctxs.push_back(c);
    return &c->ctx;
  }
  errno = ENODEV;
  return nullptr;
}

int ibv_close_device(context* x) {
  Ctx* c = emunic::ctx_of(x);
  if (c->ctx.async_fd >= 0) close(c->ctx.async_fd);
  c->ctx.async_fd = -1;
  return 0;  // the Ctx stays: engine threads may still name it
}

int ibv_query_port(context* x, uint8_t port, port_attr* a) {
  const emunic::PortCfg* p = emunic::ctx_of(x)->dev->port(port);
  if (!p) return EINVAL;
  std::memset(a, 0, sizeof *a);
  a->state = p->state();
  a->max_mtu = MTU_4096;
  a->active_mtu = p->active_mtu;
  a->gid_tbl_len = int(std::max<size_t>(p->gids.size(), 16));
  a->max_msg_sz = 1u << 31;
  a->pkey_tbl_len = 1;
  a->lid = p->link_layer == LINK_LAYER_INFINIBAND ? uint16_t(0x10 + port) : 0;
  a->active_width = 2;    // 2X
  a->active_speed = 128;  // NDR
  a->phys_state = a->state == PORT_ACTIVE ? 5 : 3;
  a->link_layer = uint8_t(p->link_layer);
  return 0;
}

int ibv_query_gid(context* x, uint8_t port, int index, gid* g) {
  const emunic::PortCfg* p = emunic::ctx_of(x)->dev->port(port);
  if (!p || index < 0 || index >= 256) {
    errno = EINVAL;
    return -1;
  }
  std::memset(g->raw, 0, 16);
  if (size_t(index) < p->gids.size() && p->gids[size_t(index)].size() == 16)
    std::memcpy(g->raw, p->gids[size_t(index)].data(), 16);
  return 0;
}

pd* ibv_alloc_pd(context* x) {
  emunic::Pd* p = new emunic::Pd;
  p->p.ctx = x;
  p->p.handle = 1;
  return &p->p;
}

int ibv_dealloc_pd(pd*) { return 0; }  // kept: QPs (kept too) name it

mr* ibv_reg_mr(pd* p, void* addr, size_t length, int access) {
  if (!addr || !length) {
    errno = EINVAL;
    return nullptr;
  }
  Nic& n = nic();
  // A registration the kernel refuses (pinned memory exhausted: ENOMEM, as GB10 kernels do
  // when CMA runs out): while the file <root>/emunic/reg_mr_enomem exists
  // (tests/emunic refuse_registrations), looked at on every call.
  if (emunic::access_ok(n.conf.rv + "/reg_mr_enomem")) {
    errno = ENOMEM;
    return nullptr;
  }
  emunic::Mr* m = new emunic::Mr;
  m->m.ctx = p->ctx;
  m->m.owner = p;
  m->m.addr = addr;
  m->m.length = length;
  m->access = access;
  std::unique_lock<std::shared_mutex> lk(n.mr_mu);
  m->m.lkey = ++n.next_key;
  m->m.rkey = ++n.next_key;
  n.by_lkey[m->m.lkey] = m;
  n.by_rkey[m->m.rkey] = m;
  return &m->m;
}

int ibv_dereg_mr(mr* x) {
  Nic& n = nic();
  std::unique_lock<std::shared_mutex> lk(n.mr_mu);  // waits for bytes landing in it
  n.by_lkey.erase(x->lkey);
  n.by_rkey.erase(x->rkey);
  delete reinterpret_cast<emunic::Mr*>(x);
  return 0;
}

cq* ibv_create_cq(context* x, int cqe, void* cq_context, comp_channel* ch, int) {
  if (cqe < 1 || ch) {
    errno = EINVAL;
    return nullptr;
  }
  emunic::Cq* c = new emunic::Cq;
  c->c.ctx = x;
  c->c.cq_context = cq_context;
  c->c.cqe = cqe;
  return &c->c;
}

int ibv_destroy_cq(cq*) { return 0; }  // kept: a late completion may still name it

qp* ibv_create_qp(pd* p, qp_init_attr* ia) {
  if (ia->qp_type != QPT_RC || !ia->send_cq || !ia->recv_cq || ia->shared_rq) {
    errno = EINVAL;
    return nullptr;
  }
  if (ia->cap.max_inline_data > 256 || ia->cap.max_send_sge > 1 || ia->cap.max_send_wr > 16384) {
    errno = EINVAL;
    return nullptr;
  }
  Nic& n = nic();
  emunic::Qp* q = new emunic::Qp;
  q->owner = emunic::ctx_of(p->ctx);
  q->prot = reinterpret_cast<emunic::Pd*>(p);
  q->scq = emunic::cq_of(ia->send_cq);
  q->rcq = emunic::cq_of(ia->recv_cq);
  q->init = *ia;
  q->q.ctx = p->ctx;
  q->q.owner = p;
  q->q.send_cq = ia->send_cq;
  q->q.recv_cq = ia->recv_cq;
  q->q.qp_context = ia->qp_context;
  q->q.qp_type = QPT_RC;
  q->q.state = QPS_RESET;
  // A QP number no process on this host uses: claim its rendezvous file.
  uint32_t start = (uint32_t(getpid()) * 40503u + uint32_t(emunic::now_ns() >> 10)) & 0xffffff;
  for (uint32_t k = 0; k < 0x1000000; ++k) {
    uint32_t qpn = (start + k) & 0xffffff;
    if (qpn < 0x100) continue;
    char name[32];
    std::snprintf(name, sizeof name, "%06x", qpn);
    std::string path = n.conf.rv + "/qp/" + name;
    int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0) {
      if (errno == EEXIST) continue;
      delete q;
      return nullptr;
    }
    std::string pid = std::to_string(getpid()) + "\n";
    ssize_t w = write(fd, pid.data(), pid.size());
    close(fd);
    if (w != ssize_t(pid.size())) {
      unlink(path.c_str());
      delete q;
      errno = EIO;
      return nullptr;
    }
    q->q.qp_num = qpn;
    q->qpn_file = path;
    break;
  }
  std::lock_guard<std::mutex> lk(n.mu);
  n.qps[q->q.qp_num] = q;
  return &q->q;
}

int ibv_modify_qp(qp* x, qp_attr* a, int mask) {
  emunic::Qp* q = emunic::qp_of(x);
  const int from = q->state.load();
  const int to = (mask & ATTR_STATE) ? a->qp_state : from;
  int need = 0;
  if (from == QPS_RESET && to == QPS_INIT)
    need = ATTR_STATE | ATTR_PKEY_INDEX | ATTR_PORT | ATTR_ACCESS_FLAGS;
  else if (from == QPS_INIT && to == QPS_RTR)
    need = ATTR_STATE | ATTR_AV | ATTR_PATH_MTU | ATTR_DEST_QPN | ATTR_RQ_PSN |
           ATTR_MAX_DEST_RD_ATOMIC | ATTR_MIN_RNR_TIMER;
  else if (from == QPS_RTR && to == QPS_RTS)
    need = ATTR_STATE | ATTR_SQ_PSN | ATTR_TIMEOUT | ATTR_RETRY_CNT | ATTR_RNR_RETRY |
           ATTR_MAX_QP_RD_ATOMIC;
  else if (to == QPS_ERR)
    need = ATTR_STATE;
  else
    return EINVAL;
  if ((mask & need) != need) return EINVAL;
  if (from == QPS_RESET && to == QPS_INIT) {
    if (!q->owner->dev->port(a->port_num)) return EINVAL;
    q->port = a->port_num;
    q->access = int(a->qp_access_flags);
  } else if (from == QPS_INIT && to == QPS_RTR) {
    const emunic::PortCfg* p = q->owner->dev->port(q->port);
    if (a->path_mtu < MTU_256 || a->path_mtu > p->active_mtu) return EINVAL;
    if (p->link_layer == LINK_LAYER_ETHERNET) {
      if (!a->ah.is_global) return EINVAL;  // RoCE needs the GRH
      size_t si = a->ah.grh.sgid_index;
      if (si >= p->gids.size() || p->gids[si].empty()) return EINVAL;
    }
    q->path_mtu = a->path_mtu;
    q->dest_qpn = a->dest_qp_num;
    q->dgid = a->ah.grh.dgid;
    q->min_rnr_timer = a->min_rnr_timer;
  } else if (from == QPS_RTR && to == QPS_RTS) {
    if (a->timeout > 31 || a->retry_cnt > 7 || a->rnr_retry > 7) return EINVAL;
    q->timeout = a->timeout;
    q->retry_cnt = a->retry_cnt;
    q->rnr_retry = a->rnr_retry;
    q->state.store(QPS_RTS);
    q->q.state = QPS_RTS;
    q->sender = std::thread(emunic::sender_main, q);
    q->acker = std::thread(emunic::acker_main, q);
    return 0;
  } else {  // -> ERR
    std::lock_guard<std::mutex> lk(q->smu);
    emunic::to_error(q, WC_WR_FLUSH_ERR);
    q->scv.notify_all();
    return 0;
  }
  q->state.store(to);
  q->q.state = to;
  return 0;
}

int ibv_destroy_qp(qp* x) {
  emunic::Qp* q = emunic::qp_of(x);
  Nic& n = nic();
  {
    std::lock_guard<std::mutex> lk(q->smu);
    q->stop = true;
    if (q->fd >= 0) shutdown(q->fd, SHUT_RDWR);
    q->scv.notify_all();
  }
  {
    std::lock_guard<std::mutex> lk(q->rmu);
    q->destroyed = true;
    q->rcv.notify_all();
  }
  if (q->sender.joinable()) q->sender.join();
  if (q->acker.joinable()) q->acker.join();
  if (q->fd >= 0) close(q->fd);
  q->fd = -1;
  if (!q->qpn_file.empty()) unlink(q->qpn_file.c_str());
  std::lock_guard<std::mutex> lk(n.mu);
  n.qps.erase(q->q.qp_num);
  return 0;  // the Qp stays allocated: an engine thread may still hold it
}

int ibv_get_async_event(context* x, async_event* ev) {
  Ctx* c = emunic::ctx_of(x);
  Nic& n = nic();
  std::lock_guard<std::mutex> lk(c->mu);
  const uint64_t t = emunic::now_ns();
  if (t - c->last_check_ns > 20000000ull) {  // sysfs is looked at every 20 ms at most
    c->last_check_ns = t;
    for (auto& p : c->dev->ports) {
      int s = p.state();
      int& last = c->port_state[p.num];
      if ((s == PORT_ACTIVE) != (last == PORT_ACTIVE)) {
        async_event e{};
        e.element.port_num = p.num;
        e.event_type = s == PORT_ACTIVE ? EVENT_PORT_ACTIVE : EVENT_PORT_ERR;
        c->events.push_back(e);
      }
      last = s;
    }
    struct stat st;
    if (!c->fatal_sent && stat((n.conf.rv + "/fatal-" + c->dev->name).c_str(), &st) == 0) {
      c->fatal_sent = true;
      async_event e{};
      e.event_type = EVENT_DEVICE_FATAL;
      c->events.push_back(e);
    }
  }
  if (c->events.empty()) {
    errno = EAGAIN;  // the transport made async_fd non-blocking
    return -1;
  }
  *ev = c->events.front();
  c->events.pop_front();
  return 0;
}

void ibv_ack_async_event(async_event*) {}

// Test harness (trace=1 in emunic.conf): this process's trace lines since the last call,
// then "P calls wrs ns" (the time spent inside ibv_post_send, lock to notify). Copies at
// most cap - 1 bytes into buf and returns the length the whole text needs: call again with
// a larger buf if it did not fit (the text is kept until it fits).
size_t emunic_trace(char* buf, size_t cap) {
  Nic& n = nic();
  std::lock_guard<std::mutex> lk(n.tmu);
  char tail[96];
  std::snprintf(tail, sizeof tail, "P %llu %llu %llu\n",
                (unsigned long long)n.post_calls.load(), (unsigned long long)n.post_wrs.load(),
                (unsigned long long)n.post_ns.load());
  const std::string text = n.trace_text + tail;
  if (text.size() + 1 > cap) return text.size() + 1;
  std::memcpy(buf, text.c_str(), text.size() + 1);
  n.trace_text.clear();
  return text.size() + 1;
}

// Test harness (benchmarks/lifetimes.py): the memory registrations of this process alive
// now; their bytes to *bytes.
size_t emunic_live_mrs(unsigned long long* bytes) {
  Nic& n = nic();
  std::shared_lock<std::shared_mutex> lk(n.mr_mu);
  unsigned long long sum = 0;
  for (const auto& kv : n.by_lkey) sum += kv.second->m.length;
  *bytes = sum;
  return n.by_lkey.size();
}

const char* ibv_wc_status_str(int s) { return wc_status_text(s); }
const char* ibv_event_type_str(int t) { return event_type_text(t); }

}  // extern "C"
