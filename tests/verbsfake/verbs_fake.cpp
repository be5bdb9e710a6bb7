// A fake libibverbs for tests without RDMA hardware (tests/test_verbs_fake.py). Test code
// only: tests/testlibs.py compiles it into a shared library that the verbs transport loads
// in place of libibverbs (SPARKCCL_IBVERBS_LIB); tests/verbsfake.py drives the harness
// (the fakeverbs_* C functions at the end) through ctypes. It is never part of the
// installed package.
//
// Once installed, every verbs call of this process goes to the functions below (exported
// under libibverbs' names), and the data path still dispatches through the context's ops
// vector exactly as with the real library. The fake is one in-process
// "fabric": every ibv_open_device makes a new NIC (its GIDs get the context id in bytes
// 4..7, so two ranks opening the same device name are two NICs), QPs are found by
// (GID, QP number) when a packet "arrives", and RDMA writes are executed into the
// destination's registered memory of this same process. It checks what real hardware
// checks (QP states and transitions, path MTU against the ports, PSNs, lkeys and rkeys and
// their ranges and access rights, inline sizes, send/receive queue and CQ capacities) and
// records every call (QP transitions with attributes and masks, work requests with
// addresses, keys, lengths, inline data, signaling) for the tests to read back. Tests can
// inject completion errors, async events, failing calls, and pause execution.
//
// Execution is deferred: posted WRs run when any CQ is polled (in order per QP), so
// completions arrive later than posts, and send queues really fill up.
//
// Reorder mode plays a host whose PCIe bridge lets posted writes pass each other: the
// bytes of non-inline RDMA writes become visible only after a delay, inline ones (the
// inline-mode flags) at once; a WRITE_WITH_IMM's receive completion is generated only after
// every earlier write of its QP is visible (what strict ordering relies on).
#include <arpa/inet.h>
#include <errno.h>

#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <chrono>
#include <fcntl.h>

#include "verbs_api.h"
#include "verbs_names.h"

namespace sparkccl {
namespace fakeverbs {

using namespace ibv;

struct DeviceSpec {
  std::string name;
  int port = 1;
  int state = ibv::PORT_ACTIVE;
  int active_mtu = ibv::MTU_4096;
  int link_layer = ibv::LINK_LAYER_ETHERNET;
  int lid = 0;
  int max_inline = 64;
  std::vector<std::string> gids;  // 16 raw bytes per index; empty = unused slot
};

// One recorded call. Fields not meaningful for a kind stay 0.
struct Record {
  std::string kind;  // open_device, reg_mr, create_cq, create_qp, modify_qp, post_send, ...
  std::string device;
  int ctx = 0;
  uint32_t qpn = 0;
  uint64_t wr_id = 0;
  int opcode = 0, num_sge = 0, result = 0, access = 0, mask = 0;
  int from_state = 0, to_state = 0;
  bool signaled = false, inline_ = false;
  uint64_t local_addr = 0, length = 0, remote_addr = 0, inline_value = 0;
  uint32_t lkey = 0, rkey = 0, imm = 0;  // imm in host byte order
  uint32_t max_send_wr = 0, max_recv_wr = 0, max_inline = 0;
  int sq_sig_all = 0, cqe_send = 0, cqe_recv = 0;
  ibv::qp_attr attr{};
};

struct QpState {
  uint32_t qpn = 0, dest_qpn = 0;
  int ctx = 0, state = 0, path_mtu = 0;
  std::string device;
  uint64_t pending = 0, unretired = 0, recvs = 0;
  bool open = true;
};

namespace {

uint64_t now_ns() {
  return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now().time_since_epoch()).count());
}

// The verbs transport makes a context's async_fd non-blocking before it polls events: give
// it a real descriptor (events themselves come from the fake's queue).
int async_fd() {
  static int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  return fd;
}

struct FakeCtx;

struct FakeMr {
  mr m{};
  FakeCtx* owner = nullptr;
  pd* prot = nullptr;
  int access = 0;
};

struct FakeCq {
  cq c{};
  FakeCtx* owner = nullptr;
  std::deque<wc> entries;
  bool overflowed = false;
};

struct PendingWr {
  send_wr wr{};
  std::vector<sge> sges;
  std::string inline_data;
};

struct FakeQp {
  qp q{};
  FakeCtx* owner = nullptr;
  qp_init_attr init{};
  qp_attr attr{};  // accumulated modify_qp attributes
  int state = QPS_RESET;
  std::deque<PendingWr> sq;         // posted, not executed
  std::deque<uint64_t> unretired;  // wr_ids posted, until a CQE at or after them is polled
  std::deque<uint64_t> rq;          // posted receive wr_ids
  bool first_packet = true;
  struct Inject {
    uint64_t after;
    int status;
    uint32_t vendor_err;
  };
  std::deque<Inject> injects;
};

struct FakeCtx {
  context ctx{};  // first member: the context* handed out points here
  int id = 0;
  DeviceSpec spec;
  bool open = true;
  std::vector<std::unique_ptr<pd>> pds;
  std::vector<std::unique_ptr<FakeMr>> mrs;
  std::vector<std::unique_ptr<FakeCq>> cqs;
  std::vector<std::unique_ptr<FakeQp>> qps;
  std::deque<async_event> events;
  std::string gid(int index) const {
    std::string g = spec.gids[size_t(index)];
    uint32_t be = htonl(uint32_t(id));
    std::memcpy(&g[4], &be, 4);
    return g;
  }
};

// A data write whose bytes become visible later (reorder mode).
struct Deferred {
  uint32_t src_qpn;
  uint64_t due_ns;
  uint64_t dst;
  std::string data;
};

struct Fabric {
  std::mutex mu;
  uint64_t reorder_ns = 0;  // > 0: non-inline data lands this much later (see reorder())
  std::deque<Deferred> deferred;
  std::vector<DeviceSpec> devices;
  std::vector<std::unique_ptr<char>> device_tokens;  // opaque device* values
  std::vector<std::unique_ptr<FakeCtx>> ctxs;
  std::vector<Record> log;
  std::map<std::string, std::deque<int>> fail_next;  // call -> errno values
  uint32_t next_qpn = 0x100, next_key = 0x1000, next_handle = 1;
  int next_ctx = 1;
  bool paused = false;
  uint64_t cq_overflows = 0;
};

Fabric* g = nullptr;  // created by install, kept (tests may install again)

bool take_failure(const char* call, int* e) {
  auto it = g->fail_next.find(call);
  if (it == g->fail_next.end() || it->second.empty()) return false;
  *e = it->second.front();
  it->second.pop_front();
  return true;
}

Record rec(const char* kind) {
  Record r;
  r.kind = kind;
  return r;
}

FakeQp* find_qp(const std::string& gid, uint32_t qpn) {
  for (auto& c : g->ctxs) {
    if (!c->open) continue;
    bool match = false;
    for (size_t i = 0; i < c->spec.gids.size() && !match; ++i)
      match = !c->spec.gids[i].empty() && c->gid(int(i)) == gid;
    if (!match && c->spec.link_layer != LINK_LAYER_ETHERNET) match = true;  // IB: by LID below
    if (!match) continue;
    for (auto& q : c->qps)
      if (q->q.qp_num == qpn) return q.get();
  }
  return nullptr;
}

FakeQp* find_qp_by_lid(uint16_t lid, uint32_t qpn) {
  for (auto& c : g->ctxs) {
    if (!c->open || c->spec.lid != lid) continue;
    for (auto& q : c->qps)
      if (q->q.qp_num == qpn) return q.get();
  }
  return nullptr;
}

FakeQp* qp_of(qp* x) {
  for (auto& c : g->ctxs)
    for (auto& q : c->qps)
      if (&q->q == x) return q.get();
  return nullptr;
}

FakeCq* cq_of(cq* x) {
  for (auto& c : g->ctxs)
    for (auto& q : c->cqs)
      if (&q->c == x) return q.get();
  return nullptr;
}

void push_cqe(FakeCq* c, const wc& w) {
  if (int(c->entries.size()) >= c->c.cqe) {
    c->overflowed = true;
    ++g->cq_overflows;
    async_event ev{};
    ev.element.c = &c->c;
    ev.event_type = EVENT_CQ_ERR;
    c->owner->events.push_back(ev);
    return;
  }
  c->entries.push_back(w);
}

FakeMr* find_mr(FakeCtx* ctx, pd* prot, uint32_t key, bool remote, uint64_t addr, uint64_t len,
                int need_access) {
  for (auto& m : ctx->mrs) {
    if (m->prot != prot) continue;
    if ((remote ? m->m.rkey : m->m.lkey) != key) continue;
    uint64_t a = reinterpret_cast<uint64_t>(m->m.addr);
    if (addr < a || addr + len > a + m->m.length) return nullptr;
    if ((m->access & need_access) != need_access) return nullptr;
    return m.get();
  }
  return nullptr;
}

void to_error(FakeQp* q) {
  q->state = QPS_ERR;
  q->q.state = QPS_ERR;
}

// Complete WR `p` of `q` with `status` (and flush the rest of the queue if it failed).
void complete(FakeQp* q, const PendingWr& p, int status, uint32_t vendor_err) {
  bool signaled = (p.wr.send_flags & SEND_SIGNALED) || q->init.sq_sig_all;
  if (status != WC_SUCCESS || signaled) {
    wc w{};
    w.wr_id = p.wr.wr_id;
    w.status = status;
    w.opcode = WC_RDMA_WRITE;
    w.vendor_err = vendor_err;
    w.qp_num = q->q.qp_num;
    push_cqe(cq_of(q->init.send_cq), w);
  } else {
    // An unsignaled success: its send queue slot is freed with a later CQE.
  }
}

void flush(FakeQp* q) {
  while (!q->sq.empty()) {
    complete(q, q->sq.front(), WC_WR_FLUSH_ERR, 0);
    q->sq.pop_front();
  }
}

// Execute one WR; false when it must wait (RNR with infinite retries).
bool execute(FakeQp* q, PendingWr& p) {
  if (q->state == QPS_ERR) {
    complete(q, p, WC_WR_FLUSH_ERR, 0);
    return true;
  }
  if (!q->injects.empty()) {
    if (q->injects.front().after == 0) {
      auto inj = q->injects.front();
      q->injects.pop_front();
      complete(q, p, inj.status, inj.vendor_err);
      to_error(q);
      return true;
    }
    q->injects.front().after--;
  }
  auto fail = [&](int status, uint32_t vendor, FakeQp* remote_too) {
    complete(q, p, status, vendor);
    to_error(q);
    if (remote_too) to_error(remote_too);
    return true;
  };
  // Route the packet.
  FakeQp* dst = nullptr;
  const ah_attr& ah = q->attr.ah;
  if (ah.is_global)
    dst = find_qp(std::string(reinterpret_cast<const char*>(ah.grh.dgid.raw), 16), q->attr.dest_qp_num);
  else
    dst = find_qp_by_lid(ah.dlid, q->attr.dest_qp_num);
  if (!dst || (dst->state != QPS_RTR && dst->state != QPS_RTS) ||
      dst->attr.dest_qp_num != q->q.qp_num || dst->attr.path_mtu < q->attr.path_mtu)
    return fail(WC_RETRY_EXC_ERR, 0x81, nullptr);
  if (q->first_packet) {
    if (dst->attr.rq_psn != q->attr.sq_psn) return fail(WC_RETRY_EXC_ERR, 0x81, nullptr);
    q->first_packet = false;
  }
  // Local data.
  std::string data;
  if (p.wr.send_flags & SEND_INLINE) {
    data = p.inline_data;
  } else {
    for (const sge& s : p.sges) {
      if (!s.length) continue;
      if (!find_mr(q->owner, q->q.owner, s.lkey, false, s.addr, s.length, 0))
        return fail(WC_LOC_PROT_ERR, 0x56, nullptr);
      data.append(reinterpret_cast<const char*>(static_cast<uintptr_t>(s.addr)), s.length);
    }
  }
  // Remote access.
  if (!(dst->attr.qp_access_flags & ACCESS_REMOTE_WRITE)) return fail(WC_REM_ACCESS_ERR, 0x88, dst);
  if (!data.empty()) {
    FakeMr* m = find_mr(dst->owner, dst->q.owner, p.wr.rdma.rkey, true, p.wr.rdma.remote_addr,
                        data.size(), ACCESS_REMOTE_WRITE);
    if (!m) return fail(WC_REM_ACCESS_ERR, 0x88, dst);
  }
  if (p.wr.opcode == WR_RDMA_WRITE_WITH_IMM) {
    if (dst->rq.empty()) {
      if (q->attr.rnr_retry == 7) return false;  // retried forever: wait for a receive
      return fail(WC_RNR_RETRY_EXC_ERR, 0x82, nullptr);
    }
  }
  if (!data.empty()) {
    if (g->reorder_ns && !(p.wr.send_flags & SEND_INLINE))
      g->deferred.push_back(Deferred{q->q.qp_num, now_ns() + g->reorder_ns,
                                     p.wr.rdma.remote_addr, data});
    else
      std::memcpy(reinterpret_cast<void*>(static_cast<uintptr_t>(p.wr.rdma.remote_addr)),
                  data.data(), data.size());
  }
  if (p.wr.opcode == WR_RDMA_WRITE_WITH_IMM) {
    // A receive completion means every earlier write of this QP is visible.
    for (auto it = g->deferred.begin(); it != g->deferred.end();) {
      if (it->src_qpn == q->q.qp_num) {
        std::memcpy(reinterpret_cast<void*>(static_cast<uintptr_t>(it->dst)), it->data.data(),
                    it->data.size());
        it = g->deferred.erase(it);
      } else {
        ++it;
      }
    }
    wc w{};
    w.wr_id = dst->rq.front();
    dst->rq.pop_front();
    w.status = WC_SUCCESS;
    w.opcode = WC_RECV_RDMA_WITH_IMM;
    w.wc_flags = WC_WITH_IMM;
    w.imm_data = p.wr.imm_data;
    w.byte_len = uint32_t(data.size());
    w.qp_num = dst->q.qp_num;
    w.src_qp = q->q.qp_num;
    push_cqe(cq_of(dst->init.recv_cq), w);
  }
  complete(q, p, WC_SUCCESS, 0);
  return true;
}

void progress() {
  if (g->paused) return;
  const uint64_t now = now_ns();
  while (!g->deferred.empty() && g->deferred.front().due_ns <= now) {
    Deferred& d = g->deferred.front();
    std::memcpy(reinterpret_cast<void*>(static_cast<uintptr_t>(d.dst)), d.data.data(),
                d.data.size());
    g->deferred.pop_front();
  }
  for (auto& c : g->ctxs)
    for (auto& q : c->qps)
      while (!q->sq.empty()) {
        if (q->state == QPS_ERR) {
          flush(q.get());
          break;
        }
        if (!execute(q.get(), q->sq.front())) break;
        q->sq.pop_front();
      }
}

// ---- the data path (reached through context ops) ---------------------------------------

int f_post_send(qp* x, send_wr* wr, send_wr** bad) {
  std::lock_guard<std::mutex> lk(g->mu);
  FakeQp* q = qp_of(x);
  for (; wr; wr = wr->next) {
    Record r = rec("post_send");
    r.qpn = x->qp_num;
    r.wr_id = wr->wr_id;
    r.opcode = wr->opcode;
    r.signaled = (wr->send_flags & SEND_SIGNALED) != 0;
    r.inline_ = (wr->send_flags & SEND_INLINE) != 0;
    r.num_sge = wr->num_sge;
    if (wr->num_sge > 0) {
      r.local_addr = wr->sg_list[0].addr;
      r.lkey = wr->sg_list[0].lkey;
      r.length = wr->sg_list[0].length;
    }
    r.remote_addr = wr->rdma.remote_addr;
    r.rkey = wr->rdma.rkey;
    r.imm = ntohl(wr->imm_data);
    int e = 0;
    if (!q) e = EINVAL;
    else if (q->state < QPS_RTS && q->state != QPS_ERR) e = EINVAL;  // cannot send before RTS
    else if (wr->opcode != WR_RDMA_WRITE && wr->opcode != WR_RDMA_WRITE_WITH_IMM) e = EINVAL;
    else if (wr->num_sge < 0 || uint32_t(wr->num_sge) > q->init.cap.max_send_sge) e = EINVAL;
    else if (q->unretired.size() >= q->init.cap.max_send_wr) e = ENOMEM;  // send queue full
    PendingWr p;
    if (!e) {
      p.wr = *wr;
      for (int i = 0; i < wr->num_sge; ++i) p.sges.push_back(wr->sg_list[i]);
      p.wr.sg_list = nullptr;
      p.wr.next = nullptr;
      if (wr->send_flags & SEND_INLINE) {
        uint64_t total = 0;
        for (auto& s : p.sges) total += s.length;
        if (total > q->init.cap.max_inline_data) {
          e = EINVAL;
        } else {
          for (auto& s : p.sges)  // copied now, as the driver does
            p.inline_data.append(reinterpret_cast<const char*>(static_cast<uintptr_t>(s.addr)),
                                 s.length);
          if (p.inline_data.size() == 8) std::memcpy(&r.inline_value, p.inline_data.data(), 8);
        }
      }
    }
    r.result = e;
    g->log.push_back(r);
    if (e) {
      *bad = wr;
      return e;
    }
    q->unretired.push_back(p.wr.wr_id);
    q->sq.push_back(std::move(p));
  }
  return 0;
}

int f_post_recv(qp* x, recv_wr* wr, recv_wr** bad) {
  std::lock_guard<std::mutex> lk(g->mu);
  FakeQp* q = qp_of(x);
  for (; wr; wr = wr->next) {
    Record r = rec("post_recv");
    r.qpn = x->qp_num;
    r.wr_id = wr->wr_id;
    r.num_sge = wr->num_sge;
    int e = 0;
    if (!q || q->state == QPS_RESET) e = EINVAL;
    else if (q->rq.size() >= q->init.cap.max_recv_wr) e = ENOMEM;
    r.result = e;
    g->log.push_back(r);
    if (e) {
      *bad = wr;
      return e;
    }
    q->rq.push_back(wr->wr_id);
  }
  return 0;
}

int f_poll_cq(cq* x, int n, wc* out) {
  std::lock_guard<std::mutex> lk(g->mu);
  progress();
  FakeCq* c = cq_of(x);
  if (!c) return -1;
  int k = 0;
  while (k < n && !c->entries.empty()) {
    out[k] = c->entries.front();
    c->entries.pop_front();
    // A send CQE retires its WR and every earlier one of that QP.
    if (!(out[k].opcode & WC_RECV)) {
      for (auto& ctx : g->ctxs)
        for (auto& q : ctx->qps)
          if (q->q.qp_num == out[k].qp_num && q->owner == c->owner)
            while (!q->unretired.empty()) {
              bool last = q->unretired.front() == out[k].wr_id;
              q->unretired.pop_front();
              if (last) break;
            }
    }
    ++k;
  }
  return k;
}

// ---- exported functions ------------------------------------------------------------------

device** f_get_device_list(int* num) {
  std::lock_guard<std::mutex> lk(g->mu);
  int e;
  if (take_failure("get_device_list", &e)) {
    errno = e;
    return nullptr;
  }
  auto** list = new device*[g->devices.size() + 1];
  for (size_t i = 0; i < g->devices.size(); ++i)
    list[i] = reinterpret_cast<device*>(g->device_tokens[i].get());
  list[g->devices.size()] = nullptr;
  if (num) *num = int(g->devices.size());
  return list;
}

void f_free_device_list(device** list) { delete[] list; }

const char* f_get_device_name(device* d) {
  std::lock_guard<std::mutex> lk(g->mu);
  for (size_t i = 0; i < g->devices.size(); ++i)
    if (reinterpret_cast<device*>(g->device_tokens[i].get()) == d) return g->devices[i].name.c_str();
  return nullptr;
}

context* f_open_device(device* d) {
  std::lock_guard<std::mutex> lk(g->mu);
  int e;
  if (take_failure("open_device", &e)) {
    errno = e;
    return nullptr;
  }
  for (size_t i = 0; i < g->devices.size(); ++i) {
    if (reinterpret_cast<device*>(g->device_tokens[i].get()) != d) continue;
    std::unique_ptr<FakeCtx> c(new FakeCtx);
    c->id = g->next_ctx++;
    c->spec = g->devices[i];
    c->ctx.dev = d;
    c->ctx.ops.poll_cq = f_poll_cq;
    c->ctx.ops.post_send = f_post_send;
    c->ctx.ops.post_recv = f_post_recv;
    c->ctx.cmd_fd = -1;
    c->ctx.async_fd = async_fd();
    Record r = rec("open_device");
    r.device = c->spec.name;
    r.ctx = c->id;
    g->log.push_back(r);
    g->ctxs.push_back(std::move(c));
    return &g->ctxs.back()->ctx;
  }
  errno = ENODEV;
  return nullptr;
}

FakeCtx* ctx_of(context* x) {
  for (auto& c : g->ctxs)
    if (&c->ctx == x) return c.get();
  return nullptr;
}

int f_close_device(context* x) {
  std::lock_guard<std::mutex> lk(g->mu);
  FakeCtx* c = ctx_of(x);
  if (!c) return EINVAL;
  c->open = false;
  Record r = rec("close_device");
  r.ctx = c->id;
  r.device = c->spec.name;
  g->log.push_back(r);
  return 0;
}

int f_query_port(context* x, uint8_t port, port_attr* a) {
  std::lock_guard<std::mutex> lk(g->mu);
  FakeCtx* c = ctx_of(x);
  if (!c || port != c->spec.port) return EINVAL;
  // Fill only the older prefix (up to and including link_layer), like an old library would.
  port_attr full{};
  full.state = c->spec.state;
  full.max_mtu = MTU_4096;
  full.active_mtu = c->spec.active_mtu;
  full.gid_tbl_len = int(c->spec.gids.size());
  full.lid = uint16_t(c->spec.lid);
  full.link_layer = uint8_t(c->spec.link_layer);
  full.phys_state = c->spec.state == PORT_ACTIVE ? 5 : 3;
  std::memcpy(a, &full, offsetof(port_attr, link_layer) + 1);
  return 0;
}

int f_query_gid(context* x, uint8_t port, int index, gid* out) {
  std::lock_guard<std::mutex> lk(g->mu);
  FakeCtx* c = ctx_of(x);
  if (!c || port != c->spec.port || index < 0 || size_t(index) >= c->spec.gids.size() ||
      c->spec.gids[size_t(index)].empty()) {
    errno = EINVAL;
    return -1;
  }
  std::string s = c->gid(index);
  std::memcpy(out->raw, s.data(), 16);
  return 0;
}

pd* f_alloc_pd(context* x) {
  std::lock_guard<std::mutex> lk(g->mu);
  FakeCtx* c = ctx_of(x);
  if (!c) return nullptr;
  c->pds.emplace_back(new pd{x, g->next_handle++});
  return c->pds.back().get();
}

int f_dealloc_pd(pd*) { return 0; }

mr* f_reg_mr(pd* p, void* addr, size_t length, int access) {
  std::lock_guard<std::mutex> lk(g->mu);
  int e;
  if (take_failure("reg_mr", &e)) {
    errno = e;
    return nullptr;
  }
  FakeCtx* c = ctx_of(p->ctx);
  if (!c || !addr || !length) {
    errno = EINVAL;
    return nullptr;
  }
  std::unique_ptr<FakeMr> m(new FakeMr);
  m->owner = c;
  m->prot = p;
  m->access = access;
  m->m.ctx = p->ctx;
  m->m.owner = p;
  m->m.addr = addr;
  m->m.length = length;
  m->m.handle = g->next_handle++;
  m->m.lkey = g->next_key++;
  m->m.rkey = g->next_key++;
  Record r = rec("reg_mr");
  r.ctx = c->id;
  r.device = c->spec.name;
  r.local_addr = reinterpret_cast<uint64_t>(addr);
  r.length = length;
  r.access = access;
  r.lkey = m->m.lkey;
  r.rkey = m->m.rkey;
  g->log.push_back(r);
  c->mrs.push_back(std::move(m));
  return &c->mrs.back()->m;
}

int f_dereg_mr(mr* x) {
  std::lock_guard<std::mutex> lk(g->mu);
  FakeCtx* c = ctx_of(x->ctx);
  if (!c) return EINVAL;
  for (auto it = c->mrs.begin(); it != c->mrs.end(); ++it)
    if (&(*it)->m == x) {
      Record r = rec("dereg_mr");
      r.ctx = c->id;
      r.lkey = x->lkey;
      g->log.push_back(r);
      c->mrs.erase(it);
      return 0;
    }
  return EINVAL;
}

cq* f_create_cq(context* x, int cqe, void* cq_context, comp_channel*, int) {
  std::lock_guard<std::mutex> lk(g->mu);
  FakeCtx* c = ctx_of(x);
  if (!c || cqe < 1) {
    errno = EINVAL;
    return nullptr;
  }
  std::unique_ptr<FakeCq> q(new FakeCq);
  q->owner = c;
  q->c.ctx = x;
  q->c.cq_context = cq_context;
  q->c.cqe = cqe;
  q->c.handle = g->next_handle++;
  Record r = rec("create_cq");
  r.ctx = c->id;
  r.length = uint64_t(cqe);
  g->log.push_back(r);
  c->cqs.push_back(std::move(q));
  return &c->cqs.back()->c;
}

int f_destroy_cq(cq*) { return 0; }

qp* f_create_qp(pd* p, qp_init_attr* ia) {
  std::lock_guard<std::mutex> lk(g->mu);
  int e;
  if (take_failure("create_qp", &e)) {
    errno = e;
    return nullptr;
  }
  FakeCtx* c = ctx_of(p->ctx);
  if (!c || ia->qp_type != QPT_RC || !ia->send_cq || !ia->recv_cq ||
      ia->cap.max_inline_data > uint32_t(c->spec.max_inline) || ia->cap.max_send_wr < 1) {
    errno = EINVAL;
    return nullptr;
  }
  std::unique_ptr<FakeQp> q(new FakeQp);
  q->owner = c;
  q->init = *ia;
  q->q.ctx = p->ctx;
  q->q.owner = p;
  q->q.send_cq = ia->send_cq;
  q->q.recv_cq = ia->recv_cq;
  q->q.qp_num = g->next_qpn++;
  q->q.qp_type = QPT_RC;
  q->q.state = QPS_RESET;
  q->q.handle = g->next_handle++;
  Record r = rec("create_qp");
  r.ctx = c->id;
  r.device = c->spec.name;
  r.qpn = q->q.qp_num;
  r.max_send_wr = ia->cap.max_send_wr;
  r.max_recv_wr = ia->cap.max_recv_wr;
  r.max_inline = ia->cap.max_inline_data;
  r.sq_sig_all = ia->sq_sig_all;
  r.cqe_send = cq_of(ia->send_cq) ? cq_of(ia->send_cq)->c.cqe : -1;
  r.cqe_recv = cq_of(ia->recv_cq) ? cq_of(ia->recv_cq)->c.cqe : -1;
  g->log.push_back(r);
  c->qps.push_back(std::move(q));
  return &c->qps.back()->q;
}

int f_modify_qp(qp* x, qp_attr* a, int mask) {
  std::lock_guard<std::mutex> lk(g->mu);
  FakeQp* q = qp_of(x);
  if (!q) return EINVAL;
  Record r = rec("modify_qp");
  r.qpn = x->qp_num;
  r.mask = mask;
  r.from_state = q->state;
  r.to_state = (mask & ATTR_STATE) ? a->qp_state : q->state;
  r.attr = *a;
  int e = 0;
  if (take_failure("modify_qp", &e)) {
  } else if (!(mask & ATTR_STATE)) {
    e = EINVAL;
  } else {
    const int from = q->state, to = a->qp_state;
    // The required (and allowed) attributes of RC transitions.
    int need = 0;
    if (from == QPS_RESET && to == QPS_INIT)
      need = ATTR_STATE | ATTR_PKEY_INDEX | ATTR_PORT | ATTR_ACCESS_FLAGS;
    else if (from == QPS_INIT && to == QPS_RTR)
      need = ATTR_STATE | ATTR_AV | ATTR_PATH_MTU | ATTR_DEST_QPN | ATTR_RQ_PSN |
             ATTR_MAX_DEST_RD_ATOMIC | ATTR_MIN_RNR_TIMER;
    else if (from == QPS_RTR && to == QPS_RTS)
      need = ATTR_STATE | ATTR_SQ_PSN | ATTR_TIMEOUT | ATTR_RETRY_CNT | ATTR_RNR_RETRY |
             ATTR_MAX_QP_RD_ATOMIC;
    else if (to == QPS_ERR || to == QPS_RESET)
      need = ATTR_STATE;
    else
      e = EINVAL;
    if (!e && (mask & need) != need) e = EINVAL;
    if (!e && from == QPS_RESET && to == QPS_INIT && a->port_num != q->owner->spec.port) e = EINVAL;
    if (!e && from == QPS_INIT && to == QPS_RTR) {
      if (a->path_mtu < MTU_256 || a->path_mtu > q->owner->spec.active_mtu) e = EINVAL;
      if (q->owner->spec.link_layer == LINK_LAYER_ETHERNET && !a->ah.is_global) e = EINVAL;
      if (a->ah.is_global && (size_t(a->ah.grh.sgid_index) >= q->owner->spec.gids.size() ||
                              q->owner->spec.gids[a->ah.grh.sgid_index].empty()))
        e = EINVAL;
    }
    if (!e && from == QPS_RTR && to == QPS_RTS &&
        (a->timeout > 31 || a->retry_cnt > 7 || a->rnr_retry > 7))
      e = EINVAL;
    if (!e) {
      if (mask & ATTR_PORT) q->attr.port_num = a->port_num;
      if (mask & ATTR_ACCESS_FLAGS) q->attr.qp_access_flags = a->qp_access_flags;
      if (mask & ATTR_PKEY_INDEX) q->attr.pkey_index = a->pkey_index;
      if (mask & ATTR_AV) q->attr.ah = a->ah;
      if (mask & ATTR_PATH_MTU) q->attr.path_mtu = a->path_mtu;
      if (mask & ATTR_DEST_QPN) q->attr.dest_qp_num = a->dest_qp_num;
      if (mask & ATTR_RQ_PSN) q->attr.rq_psn = a->rq_psn;
      if (mask & ATTR_SQ_PSN) q->attr.sq_psn = a->sq_psn;
      if (mask & ATTR_TIMEOUT) q->attr.timeout = a->timeout;
      if (mask & ATTR_RETRY_CNT) q->attr.retry_cnt = a->retry_cnt;
      if (mask & ATTR_RNR_RETRY) q->attr.rnr_retry = a->rnr_retry;
      if (mask & ATTR_MIN_RNR_TIMER) q->attr.min_rnr_timer = a->min_rnr_timer;
      if (mask & ATTR_MAX_QP_RD_ATOMIC) q->attr.max_rd_atomic = a->max_rd_atomic;
      if (mask & ATTR_MAX_DEST_RD_ATOMIC) q->attr.max_dest_rd_atomic = a->max_dest_rd_atomic;
      q->state = to;
      q->q.state = to;
      if (to == QPS_ERR) flush(q);
    }
  }
  r.result = e;
  g->log.push_back(r);
  return e;
}

int f_destroy_qp(qp* x) {
  std::lock_guard<std::mutex> lk(g->mu);
  for (auto& c : g->ctxs)
    for (auto it = c->qps.begin(); it != c->qps.end(); ++it)
      if (&(*it)->q == x) {
        Record r = rec("destroy_qp");
        r.qpn = x->qp_num;
        g->log.push_back(r);
        c->qps.erase(it);
        return 0;
      }
  return EINVAL;
}

int f_get_async_event(context* x, async_event* ev) {
  std::lock_guard<std::mutex> lk(g->mu);
  FakeCtx* c = ctx_of(x);
  if (!c || c->events.empty()) {
    errno = EAGAIN;
    return -1;
  }
  *ev = c->events.front();
  c->events.pop_front();
  return 0;
}

void f_ack_async_event(async_event*) {}

const char* f_wc_status_str(int s) { return wc_status_text(s); }
const char* f_event_type_str(int t) { return event_type_text(t); }

FakeQp* qp_by_num(uint32_t qpn) {
  for (auto& c : g->ctxs)
    for (auto& q : c->qps)
      if (q->q.qp_num == qpn) return q.get();
  return nullptr;
}

}  // namespace

// ---- harness ----------------------------------------------------------------------------

void install(const std::vector<DeviceSpec>& devices) {
  if (!g) g = new Fabric;  // never freed: QPs of earlier tests may still be referenced
  {
    std::lock_guard<std::mutex> lk(g->mu);
    g->devices = devices;
    g->device_tokens.clear();
    for (size_t i = 0; i < devices.size(); ++i) g->device_tokens.emplace_back(new char(0));
    // Keep earlier contexts (an endpoint may outlive a test) but make them unreachable.
    for (auto& c : g->ctxs) c->open = false;
    g->log.clear();
    g->fail_next.clear();
    g->paused = false;
    g->cq_overflows = 0;
    g->reorder_ns = 0;
    g->deferred.clear();
  }
}

void uninstall() {
  if (g) {
    std::lock_guard<std::mutex> lk(g->mu);
    g->deferred.clear();  // never land bytes into memory a finished test has freed
    g->reorder_ns = 0;
  }
}

std::vector<Record> take_log(bool clear) {
  std::lock_guard<std::mutex> lk(g->mu);
  std::vector<Record> out = g->log;
  if (clear) g->log.clear();
  return out;
}

bool inject(uint32_t qpn, int status, uint32_t vendor_err, uint64_t after) {
  std::lock_guard<std::mutex> lk(g->mu);
  FakeQp* q = qp_by_num(qpn);
  if (!q) return false;
  q->injects.push_back(FakeQp::Inject{after, status, vendor_err});
  return true;
}

bool async(uint32_t qpn, int ctx_id, int type, int port) {
  std::lock_guard<std::mutex> lk(g->mu);
  async_event ev{};
  ev.event_type = type;
  FakeCtx* target = nullptr;
  if (qpn) {
    FakeQp* q = qp_by_num(qpn);
    if (!q) return false;
    ev.element.q = &q->q;
    target = q->owner;
  } else {
    for (auto& c : g->ctxs)
      if (c->id == ctx_id) target = c.get();
    if (!target) return false;
    if (type == EVENT_CQ_ERR && !target->cqs.empty()) ev.element.c = &target->cqs.front()->c;
    else ev.element.port_num = port;
  }
  target->events.push_back(ev);
  return true;
}

void pause(bool on) {
  std::lock_guard<std::mutex> lk(g->mu);
  g->paused = on;
}

void reorder(double delay_s) {
  std::lock_guard<std::mutex> lk(g->mu);
  g->reorder_ns = delay_s > 0 ? uint64_t(delay_s * 1e9) : 0;
  if (!g->reorder_ns) {  // land everything still in flight
    for (auto& d : g->deferred)
      std::memcpy(reinterpret_cast<void*>(static_cast<uintptr_t>(d.dst)), d.data.data(),
                  d.data.size());
    g->deferred.clear();
  }
}

void fail_next(const std::string& call, int err) {
  std::lock_guard<std::mutex> lk(g->mu);
  g->fail_next[call].push_back(err);
}

std::vector<QpState> qp_states() {
  std::lock_guard<std::mutex> lk(g->mu);
  std::vector<QpState> out;
  for (auto& c : g->ctxs)
    for (auto& q : c->qps) {
      QpState s;
      s.qpn = q->q.qp_num;
      s.ctx = c->id;
      s.device = c->spec.name;
      s.state = q->state;
      s.pending = q->sq.size();
      s.unretired = q->unretired.size();
      s.recvs = q->rq.size();
      s.dest_qpn = q->attr.dest_qp_num;
      s.path_mtu = q->attr.path_mtu;
      s.open = c->open;
      out.push_back(s);
    }
  return out;
}

uint64_t cq_overflows() {
  std::lock_guard<std::mutex> lk(g->mu);
  return g->cq_overflows;
}

std::string context_gid(int ctx_id, int index) {
  std::lock_guard<std::mutex> lk(g->mu);
  for (auto& c : g->ctxs)
    if (c->id == ctx_id && index >= 0 && size_t(index) < c->spec.gids.size()) return c->gid(index);
  return std::string();
}

}  // namespace fakeverbs
}  // namespace sparkccl

// ---- libibverbs' exported names (what the verbs transport resolves with dlsym) ----------

extern "C" {
using namespace sparkccl::ibv;
namespace fv = sparkccl::fakeverbs;
device** ibv_get_device_list(int* n) { return fv::f_get_device_list(n); }
void ibv_free_device_list(device** l) { fv::f_free_device_list(l); }
const char* ibv_get_device_name(device* d) { return fv::f_get_device_name(d); }
context* ibv_open_device(device* d) { return fv::f_open_device(d); }
int ibv_close_device(context* c) { return fv::f_close_device(c); }
int ibv_query_port(context* c, uint8_t port, port_attr* a) { return fv::f_query_port(c, port, a); }
int ibv_query_gid(context* c, uint8_t port, int i, gid* g) { return fv::f_query_gid(c, port, i, g); }
pd* ibv_alloc_pd(context* c) { return fv::f_alloc_pd(c); }
int ibv_dealloc_pd(pd* p) { return fv::f_dealloc_pd(p); }
mr* ibv_reg_mr(pd* p, void* a, size_t n, int acc) { return fv::f_reg_mr(p, a, n, acc); }
int ibv_dereg_mr(mr* m) { return fv::f_dereg_mr(m); }
cq* ibv_create_cq(context* c, int cqe, void* cc, comp_channel* ch, int v) {
  return fv::f_create_cq(c, cqe, cc, ch, v);
}
int ibv_destroy_cq(cq* c) { return fv::f_destroy_cq(c); }
qp* ibv_create_qp(pd* p, qp_init_attr* a) { return fv::f_create_qp(p, a); }
int ibv_modify_qp(qp* q, qp_attr* a, int mask) { return fv::f_modify_qp(q, a, mask); }
int ibv_destroy_qp(qp* q) { return fv::f_destroy_qp(q); }
int ibv_get_async_event(context* c, async_event* e) { return fv::f_get_async_event(c, e); }
void ibv_ack_async_event(async_event* e) { fv::f_ack_async_event(e); }
const char* ibv_wc_status_str(int s) { return fv::f_wc_status_str(s); }
const char* ibv_event_type_str(int t) { return fv::f_event_type_str(t); }

// ---- the harness (tests/verbsfake.py) --------------------------------------------------

static std::vector<fv::DeviceSpec> g_pending;
static std::string g_text;  // the last JSON answer (valid until the next call)

void fakeverbs_add_device(const char* name, int port, int state, int active_mtu,
                          int link_layer, int lid, int max_inline, const char* gids,
                          const int* gid_lens, int ngids) {
  fv::DeviceSpec s;
  s.name = name;
  s.port = port;
  s.state = state;
  s.active_mtu = active_mtu;
  s.link_layer = link_layer;
  s.lid = lid;
  s.max_inline = max_inline;
  for (int i = 0; i < ngids; ++i) s.gids.emplace_back(gids + 16 * i, size_t(gid_lens[i]));
  g_pending.push_back(s);
}
void fakeverbs_install() {
  fv::install(g_pending);
  g_pending.clear();
}
void fakeverbs_uninstall() { fv::uninstall(); }
int fakeverbs_inject(uint32_t qpn, int status, uint32_t vendor_err, uint64_t after) {
  return fv::inject(qpn, status, vendor_err, after);
}
int fakeverbs_async(uint32_t qpn, int ctx, int type, int port) {
  return fv::async(qpn, ctx, type, port);
}
void fakeverbs_pause(int on) { fv::pause(on != 0); }
void fakeverbs_reorder(double delay_s) { fv::reorder(delay_s); }
void fakeverbs_fail_next(const char* call, int err) { fv::fail_next(call, err); }
uint64_t fakeverbs_cq_overflows() { return fv::cq_overflows(); }
int fakeverbs_gid(int ctx, int index, char* out16) {
  std::string g = fv::context_gid(ctx, index);
  std::memcpy(out16, g.data(), g.size());
  return int(g.size());
}

static void field(std::string& o, const char* k, uint64_t v) {
  o += "\"" + std::string(k) + "\":" + std::to_string(v) + ",";
}
static void text_field(std::string& o, const char* k, const std::string& v) {
  o += "\"" + std::string(k) + "\":\"" + v + "\",";  // names and hex: nothing to escape
}
static void close_obj(std::string& o) {
  if (o.back() == ',') o.pop_back();
  o += "},";
}
static std::string hex16(const uint8_t* b) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (int i = 0; i < 16; ++i) (s += d[b[i] >> 4]) += d[b[i] & 15];
  return s;
}

// Every recorded call, as a JSON list of objects (dgid as hex); the fields per kind are the
// ones tests/test_verbs_fake.py reads.
const char* fakeverbs_log(int clear) {
  std::string& o = g_text;
  o = "[";
  for (auto& r : fv::take_log(clear != 0)) {
    o += "{";
    text_field(o, "kind", r.kind);
    if (!r.device.empty()) text_field(o, "device", r.device);
    field(o, "ctx", uint64_t(r.ctx));
    o += "\"result\":" + std::to_string(r.result) + ",";
    if (r.kind == "post_send") {
      field(o, "qpn", r.qpn);
      field(o, "wr_id", r.wr_id);
      field(o, "opcode", uint64_t(r.opcode));
      field(o, "signaled", r.signaled);
      field(o, "inline", r.inline_);
      field(o, "num_sge", uint64_t(r.num_sge));
      field(o, "local_addr", r.local_addr);
      field(o, "lkey", r.lkey);
      field(o, "length", r.length);
      field(o, "remote_addr", r.remote_addr);
      field(o, "rkey", r.rkey);
      field(o, "imm", r.imm);
      field(o, "inline_value", r.inline_value);
    } else if (r.kind == "post_recv") {
      field(o, "qpn", r.qpn);
      field(o, "wr_id", r.wr_id);
      field(o, "num_sge", uint64_t(r.num_sge));
    } else if (r.kind == "modify_qp") {
      const qp_attr& a = r.attr;
      field(o, "qpn", r.qpn);
      field(o, "mask", uint64_t(r.mask));
      field(o, "from", uint64_t(r.from_state));
      field(o, "to", uint64_t(r.to_state));
      field(o, "port_num", a.port_num);
      field(o, "pkey_index", a.pkey_index);
      field(o, "access", a.qp_access_flags);
      field(o, "path_mtu", uint64_t(a.path_mtu));
      field(o, "dest_qp_num", a.dest_qp_num);
      field(o, "rq_psn", a.rq_psn);
      field(o, "sq_psn", a.sq_psn);
      field(o, "max_dest_rd_atomic", a.max_dest_rd_atomic);
      field(o, "max_rd_atomic", a.max_rd_atomic);
      field(o, "min_rnr_timer", a.min_rnr_timer);
      field(o, "timeout", a.timeout);
      field(o, "retry_cnt", a.retry_cnt);
      field(o, "rnr_retry", a.rnr_retry);
      field(o, "is_global", a.ah.is_global);
      field(o, "dlid", a.ah.dlid);
      field(o, "sl", a.ah.sl);
      field(o, "ah_port_num", a.ah.port_num);
      text_field(o, "dgid", hex16(a.ah.grh.dgid.raw));
      field(o, "sgid_index", a.ah.grh.sgid_index);
      field(o, "hop_limit", a.ah.grh.hop_limit);
      field(o, "traffic_class", a.ah.grh.traffic_class);
    } else if (r.kind == "create_qp") {
      field(o, "qpn", r.qpn);
      field(o, "max_send_wr", r.max_send_wr);
      field(o, "max_recv_wr", r.max_recv_wr);
      field(o, "max_inline", r.max_inline);
      field(o, "sq_sig_all", uint64_t(r.sq_sig_all));
      field(o, "cqe_send", uint64_t(r.cqe_send));
      field(o, "cqe_recv", uint64_t(r.cqe_recv));
    } else if (r.kind == "reg_mr" || r.kind == "dereg_mr") {
      field(o, "addr", r.local_addr);
      field(o, "length", r.length);
      field(o, "access", uint64_t(r.access));
      field(o, "lkey", r.lkey);
      field(o, "rkey", r.rkey);
    } else if (r.kind == "create_cq") {
      field(o, "cqe", r.length);
    } else if (r.kind == "destroy_qp") {
      field(o, "qpn", r.qpn);
    }
    close_obj(o);
  }
  if (o.back() == ',') o.pop_back();
  o += "]";
  return o.c_str();
}

const char* fakeverbs_qps() {
  std::string& o = g_text;
  o = "[";
  for (auto& s : fv::qp_states()) {
    o += "{";
    field(o, "qpn", s.qpn);
    field(o, "ctx", uint64_t(s.ctx));
    text_field(o, "device", s.device);
    field(o, "state", uint64_t(s.state));
    field(o, "pending", s.pending);
    field(o, "unretired", s.unretired);
    field(o, "recvs", s.recvs);
    field(o, "dest_qpn", s.dest_qpn);
    field(o, "path_mtu", uint64_t(s.path_mtu));
    field(o, "open", s.open);
    close_obj(o);
  }
  if (o.back() == ',') o.pop_back();
  o += "]";
  return o.c_str();
}
}  // extern "C"
