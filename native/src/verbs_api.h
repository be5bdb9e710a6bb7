// The subset of the libibverbs ABI the verbs transport uses, declared here so that the
// package builds and imports without rdma-core (no <infiniband/verbs.h> at build time) and
// loads libibverbs.so.1 with dlopen at run time (docs/PROTOCOL.md "The transport contract").
//
// These are the stable, versioned ABI of libibverbs (IBVERBS_1.1 symbols and the structs
// they take): struct layouts, enum values and the per-context ops vector through which
// verbs.h's inline ibv_post_send / ibv_post_recv / ibv_poll_cq dispatch. Only the fields we
// touch are named; the rest is padding of the right size. tests/verbs_abi_check.cpp
// static_asserts every size and offset below against the real header when one is installed
// (Debian/Ubuntu package: libibverbs-dev); tests/test_verbs_fake.py compiles and runs it.
//
// Names live in namespace sparkccl::ibv and deliberately differ from verbs.h's (which
// defines some constants as macros), so both headers can be included together.
#pragma once
#include <pthread.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace sparkccl {
namespace ibv {

// ---- enums (values fixed by the ABI) ----------------------------------------------------

// enum ibv_qp_state
constexpr int QPS_RESET = 0, QPS_INIT = 1, QPS_RTR = 2, QPS_RTS = 3, QPS_SQD = 4, QPS_SQE = 5,
              QPS_ERR = 6;
// enum ibv_qp_type
constexpr int QPT_RC = 2;
// enum ibv_mtu: 1..5 = 256..4096 bytes
constexpr int MTU_256 = 1, MTU_512 = 2, MTU_1024 = 3, MTU_2048 = 4, MTU_4096 = 5;
inline int mtu_bytes(int e) { return (e >= MTU_256 && e <= MTU_4096) ? (128 << e) : 0; }
// enum ibv_port_state
constexpr int PORT_DOWN = 1, PORT_INIT = 2, PORT_ARMED = 3, PORT_ACTIVE = 4,
              PORT_ACTIVE_DEFER = 5;
// IBV_LINK_LAYER_*
constexpr int LINK_LAYER_UNSPECIFIED = 0, LINK_LAYER_INFINIBAND = 1, LINK_LAYER_ETHERNET = 2;
// enum ibv_access_flags
constexpr int ACCESS_LOCAL_WRITE = 1, ACCESS_REMOTE_WRITE = 2, ACCESS_REMOTE_READ = 4;
// enum ibv_qp_attr_mask
constexpr int ATTR_STATE = 1 << 0, ATTR_ACCESS_FLAGS = 1 << 3, ATTR_PKEY_INDEX = 1 << 4,
              ATTR_PORT = 1 << 5, ATTR_AV = 1 << 7, ATTR_PATH_MTU = 1 << 8,
              ATTR_TIMEOUT = 1 << 9, ATTR_RETRY_CNT = 1 << 10, ATTR_RNR_RETRY = 1 << 11,
              ATTR_RQ_PSN = 1 << 12, ATTR_MAX_QP_RD_ATOMIC = 1 << 13,
              ATTR_MIN_RNR_TIMER = 1 << 15, ATTR_SQ_PSN = 1 << 16,
              ATTR_MAX_DEST_RD_ATOMIC = 1 << 17, ATTR_DEST_QPN = 1 << 20;
// enum ibv_wr_opcode
constexpr int WR_RDMA_WRITE = 0, WR_RDMA_WRITE_WITH_IMM = 1;
// enum ibv_send_flags
constexpr unsigned SEND_FENCE = 1, SEND_SIGNALED = 2, SEND_SOLICITED = 4, SEND_INLINE = 8;
// enum ibv_wc_status
constexpr int WC_SUCCESS = 0, WC_LOC_LEN_ERR = 1, WC_LOC_QP_OP_ERR = 2, WC_LOC_PROT_ERR = 4,
              WC_WR_FLUSH_ERR = 5, WC_REM_INV_REQ_ERR = 9, WC_REM_ACCESS_ERR = 10,
              WC_REM_OP_ERR = 11, WC_RETRY_EXC_ERR = 12, WC_RNR_RETRY_EXC_ERR = 13,
              WC_FATAL_ERR = 19, WC_GENERAL_ERR = 21;
// enum ibv_wc_opcode
constexpr int WC_RDMA_WRITE = 1, WC_RECV = 1 << 7, WC_RECV_RDMA_WITH_IMM = (1 << 7) + 1;
// enum ibv_wc_flags
constexpr unsigned WC_GRH = 1, WC_WITH_IMM = 2;
// enum ibv_event_type
constexpr int EVENT_CQ_ERR = 0, EVENT_QP_FATAL = 1, EVENT_QP_REQ_ERR = 2,
              EVENT_QP_ACCESS_ERR = 3, EVENT_COMM_EST = 4, EVENT_SQ_DRAINED = 5,
              EVENT_PATH_MIG = 6, EVENT_PATH_MIG_ERR = 7, EVENT_DEVICE_FATAL = 8,
              EVENT_PORT_ACTIVE = 9, EVENT_PORT_ERR = 10, EVENT_LID_CHANGE = 11,
              EVENT_PKEY_CHANGE = 12, EVENT_SM_CHANGE = 13, EVENT_SRQ_ERR = 14,
              EVENT_SRQ_LIMIT_REACHED = 15, EVENT_QP_LAST_WQE_REACHED = 16,
              EVENT_CLIENT_REREGISTER = 17, EVENT_GID_CHANGE = 18, EVENT_WQ_FATAL = 19;

// ---- structs ----------------------------------------------------------------------------

struct device;        // opaque: only through ibv_get_device_name
struct comp_channel;  // unused (we poll)
struct srq;           // unused
struct qp;
struct cq;
struct wc;
struct send_wr;
struct recv_wr;

// struct ibv_context_ops: 32 function pointers; the inline data-path verbs go through
// poll_cq (slot 11), post_send (slot 25) and post_recv (slot 26).
struct context_ops {
  void* before_poll_cq[11];
  int (*poll_cq)(cq* c, int num_entries, wc* w);
  void* between[13];
  int (*post_send)(qp* q, send_wr* wr, send_wr** bad_wr);
  int (*post_recv)(qp* q, recv_wr* wr, recv_wr** bad_wr);
  void* after[5];
};

// struct ibv_context
struct context {
  device* dev;
  context_ops ops;
  int cmd_fd;
  int async_fd;
  int num_comp_vectors;
  pthread_mutex_t mutex;
  void* abi_compat;
};

// struct ibv_pd
struct pd {
  context* ctx;
  uint32_t handle;
};

// struct ibv_mr
struct mr {
  context* ctx;
  pd* owner;
  void* addr;
  size_t length;
  uint32_t handle;
  uint32_t lkey;
  uint32_t rkey;
};

// struct ibv_cq
struct cq {
  context* ctx;
  comp_channel* channel;
  void* cq_context;
  uint32_t handle;
  int cqe;
  pthread_mutex_t mutex;
  pthread_cond_t cond;
  uint32_t comp_events_completed;
  uint32_t async_events_completed;
};

// struct ibv_qp
struct qp {
  context* ctx;
  void* qp_context;
  pd* owner;
  cq* send_cq;
  cq* recv_cq;
  srq* shared_rq;
  uint32_t handle;
  uint32_t qp_num;
  int state;
  int qp_type;
  pthread_mutex_t mutex;
  pthread_cond_t cond;
  uint32_t events_completed;
};

// union ibv_gid (8-byte aligned through its {subnet_prefix, interface_id} view)
union gid {
  uint8_t raw[16];
  struct {
    uint64_t subnet_prefix;
    uint64_t interface_id;
  } global;
};

// struct ibv_global_route
struct global_route {
  gid dgid;
  uint32_t flow_label;
  uint8_t sgid_index;
  uint8_t hop_limit;
  uint8_t traffic_class;
};

// struct ibv_ah_attr
struct ah_attr {
  global_route grh;
  uint16_t dlid;
  uint8_t sl;
  uint8_t src_path_bits;
  uint8_t static_rate;
  uint8_t is_global;
  uint8_t port_num;
};

// struct ibv_qp_cap
struct qp_cap {
  uint32_t max_send_wr;
  uint32_t max_recv_wr;
  uint32_t max_send_sge;
  uint32_t max_recv_sge;
  uint32_t max_inline_data;
};

// struct ibv_qp_attr
struct qp_attr {
  int qp_state;
  int cur_qp_state;
  int path_mtu;
  int path_mig_state;
  uint32_t qkey;
  uint32_t rq_psn;
  uint32_t sq_psn;
  uint32_t dest_qp_num;
  unsigned qp_access_flags;
  qp_cap cap;
  ah_attr ah;
  ah_attr alt_ah;
  uint16_t pkey_index;
  uint16_t alt_pkey_index;
  uint8_t en_sqd_async_notify;
  uint8_t sq_draining;
  uint8_t max_rd_atomic;
  uint8_t max_dest_rd_atomic;
  uint8_t min_rnr_timer;
  uint8_t port_num;
  uint8_t timeout;
  uint8_t retry_cnt;
  uint8_t rnr_retry;
  uint8_t alt_port_num;
  uint8_t alt_timeout;
  uint32_t rate_limit;
};

// struct ibv_qp_init_attr
struct qp_init_attr {
  void* qp_context;
  cq* send_cq;
  cq* recv_cq;
  srq* shared_rq;
  qp_cap cap;
  int qp_type;
  int sq_sig_all;
};

// struct ibv_sge
struct sge {
  uint64_t addr;
  uint32_t length;
  uint32_t lkey;
};

// struct ibv_send_wr (RDMA view of its unions; the others are padding)
struct send_wr {
  uint64_t wr_id;
  send_wr* next;
  sge* sg_list;
  int num_sge;
  int opcode;
  unsigned send_flags;
  uint32_t imm_data;  // network byte order
  struct {
    uint64_t remote_addr;
    uint32_t rkey;
    uint8_t other_views[20];  // atomic / ud views of the union are 32 bytes
  } rdma;
  uint64_t qp_type_union;  // union { struct { uint32_t remote_srqn; } xrc; }, padded
  uint8_t bind_mw_or_tso[48];
};

// struct ibv_recv_wr
struct recv_wr {
  uint64_t wr_id;
  recv_wr* next;
  sge* sg_list;
  int num_sge;
};

// struct ibv_wc
struct wc {
  uint64_t wr_id;
  int status;
  int opcode;
  uint32_t vendor_err;
  uint32_t byte_len;
  uint32_t imm_data;  // network byte order (when wc_flags & WC_WITH_IMM)
  uint32_t qp_num;
  uint32_t src_qp;
  unsigned wc_flags;
  uint16_t pkey_index;
  uint16_t slid;
  uint8_t sl;
  uint8_t dlid_path_bits;
};

// struct ibv_port_attr up to port_cap_flags2. Later rdma-core versions append fields
// (active_speed_ex), so it is only ever filled inside a larger zeroed buffer; the exported
// ibv_query_port may also fill only an older, shorter prefix, which still holds every field
// we read (state, active_mtu, lid, link_layer).
struct port_attr {
  int state;
  int max_mtu;
  int active_mtu;
  int gid_tbl_len;
  uint32_t port_cap_flags;
  uint32_t max_msg_sz;
  uint32_t bad_pkey_cntr;
  uint32_t qkey_viol_cntr;
  uint16_t pkey_tbl_len;
  uint16_t lid;
  uint16_t sm_lid;
  uint8_t lmc;
  uint8_t max_vl_num;
  uint8_t sm_sl;
  uint8_t subnet_timeout;
  uint8_t init_type_reply;
  uint8_t active_width;
  uint8_t active_speed;
  uint8_t phys_state;
  uint8_t link_layer;
  uint8_t flags;
  uint16_t port_cap_flags2;
};

// struct ibv_async_event
struct async_event {
  union {
    cq* c;
    qp* q;
    srq* s;
    void* wq;
    int port_num;
  } element;
  int event_type;
};

// ---- the function table ----------------------------------------------------------------

// Exported libibverbs functions, resolved with dlsym (default symbol versions). The
// data path (post_send / post_recv / poll_cq) is not exported: verbs.h inlines it as a
// call through the context's ops, and so do the helpers below.
struct Api {
  std::string source;  // the library path
  device** (*get_device_list)(int* num) = nullptr;
  void (*free_device_list)(device** list) = nullptr;
  const char* (*get_device_name)(device* d) = nullptr;
  context* (*open_device)(device* d) = nullptr;
  int (*close_device)(context* c) = nullptr;
  int (*query_port)(context* c, uint8_t port, port_attr* attr) = nullptr;
  int (*query_gid)(context* c, uint8_t port, int index, gid* g) = nullptr;
  pd* (*alloc_pd)(context* c) = nullptr;
  int (*dealloc_pd)(pd* p) = nullptr;
  mr* (*reg_mr)(pd* p, void* addr, size_t length, int access) = nullptr;
  int (*dereg_mr)(mr* m) = nullptr;
  cq* (*create_cq)(context* c, int cqe, void* cq_context, comp_channel* ch,
                   int comp_vector) = nullptr;
  int (*destroy_cq)(cq* c) = nullptr;
  qp* (*create_qp)(pd* p, qp_init_attr* attr) = nullptr;
  int (*modify_qp)(qp* q, qp_attr* attr, int mask) = nullptr;
  int (*destroy_qp)(qp* q) = nullptr;
  int (*get_async_event)(context* c, async_event* e) = nullptr;
  void (*ack_async_event)(async_event* e) = nullptr;
  const char* (*wc_status_str)(int status) = nullptr;
  const char* (*event_type_str)(int event) = nullptr;
};

// verbs.h's inline data path.
inline int post_send(qp* q, send_wr* wr, send_wr** bad) {
  return q->ctx->ops.post_send(q, wr, bad);
}
inline int post_recv(qp* q, recv_wr* wr, recv_wr** bad) {
  return q->ctx->ops.post_recv(q, wr, bad);
}
inline int poll_cq(cq* c, int n, wc* out) { return c->ctx->ops.poll_cq(c, n, out); }

// The table in use: libibverbs loaded on first use (SPARKCCL_IBVERBS_LIB overrides the
// library name; tests point it at their fakes). nullptr with *error set when the library
// cannot be loaded or lacks a symbol.
const Api* api(std::string* error);

}  // namespace ibv
}  // namespace sparkccl
