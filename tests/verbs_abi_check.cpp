// Compile-only check: native/src/verbs_api.h (our declarations of the libibverbs ABI) against
// the real <infiniband/verbs.h>. Built by tests/test_verbs_fake.py::test_abi_matches_verbs_h
// when the header is installed (Debian/Ubuntu: libibverbs-dev). Any drift fails to compile.
#include <infiniband/verbs.h>

#include <cstddef>

#include "verbs_api.h"

namespace v = sparkccl::ibv;

#define SAME_SIZE(ours, theirs) \
  static_assert(sizeof(v::ours) == sizeof(theirs), "size of " #ours " differs from " #theirs)
#define SAME_OFFSET(ours, of, theirs, tf)                              \
  static_assert(offsetof(v::ours, of) == offsetof(theirs, tf),         \
                "offset of " #ours "." #of " differs from " #theirs "." #tf)
#define SAME_VALUE(ours, theirs) static_assert(int(v::ours) == int(theirs), #ours " != " #theirs)

SAME_SIZE(context_ops, struct ibv_context_ops);
SAME_OFFSET(context_ops, poll_cq, struct ibv_context_ops, poll_cq);
SAME_OFFSET(context_ops, post_send, struct ibv_context_ops, post_send);
SAME_OFFSET(context_ops, post_recv, struct ibv_context_ops, post_recv);

SAME_SIZE(context, struct ibv_context);
SAME_OFFSET(context, dev, struct ibv_context, device);
SAME_OFFSET(context, ops, struct ibv_context, ops);
SAME_OFFSET(context, async_fd, struct ibv_context, async_fd);

SAME_SIZE(pd, struct ibv_pd);
SAME_OFFSET(pd, ctx, struct ibv_pd, context);

SAME_SIZE(mr, struct ibv_mr);
SAME_OFFSET(mr, addr, struct ibv_mr, addr);
SAME_OFFSET(mr, length, struct ibv_mr, length);
SAME_OFFSET(mr, lkey, struct ibv_mr, lkey);
SAME_OFFSET(mr, rkey, struct ibv_mr, rkey);

SAME_SIZE(cq, struct ibv_cq);
SAME_OFFSET(cq, ctx, struct ibv_cq, context);
SAME_OFFSET(cq, cqe, struct ibv_cq, cqe);

SAME_SIZE(qp, struct ibv_qp);
SAME_OFFSET(qp, ctx, struct ibv_qp, context);
SAME_OFFSET(qp, owner, struct ibv_qp, pd);
SAME_OFFSET(qp, send_cq, struct ibv_qp, send_cq);
SAME_OFFSET(qp, recv_cq, struct ibv_qp, recv_cq);
SAME_OFFSET(qp, qp_num, struct ibv_qp, qp_num);
SAME_OFFSET(qp, state, struct ibv_qp, state);
SAME_OFFSET(qp, qp_type, struct ibv_qp, qp_type);

SAME_SIZE(gid, union ibv_gid);
static_assert(alignof(v::gid) == alignof(union ibv_gid), "gid alignment");
SAME_SIZE(global_route, struct ibv_global_route);
SAME_OFFSET(global_route, flow_label, struct ibv_global_route, flow_label);
SAME_OFFSET(global_route, sgid_index, struct ibv_global_route, sgid_index);
SAME_OFFSET(global_route, hop_limit, struct ibv_global_route, hop_limit);
SAME_OFFSET(global_route, traffic_class, struct ibv_global_route, traffic_class);

SAME_SIZE(ah_attr, struct ibv_ah_attr);
SAME_OFFSET(ah_attr, dlid, struct ibv_ah_attr, dlid);
SAME_OFFSET(ah_attr, sl, struct ibv_ah_attr, sl);
SAME_OFFSET(ah_attr, is_global, struct ibv_ah_attr, is_global);
SAME_OFFSET(ah_attr, port_num, struct ibv_ah_attr, port_num);

SAME_SIZE(qp_cap, struct ibv_qp_cap);
SAME_SIZE(qp_attr, struct ibv_qp_attr);
SAME_OFFSET(qp_attr, qp_state, struct ibv_qp_attr, qp_state);
SAME_OFFSET(qp_attr, path_mtu, struct ibv_qp_attr, path_mtu);
SAME_OFFSET(qp_attr, rq_psn, struct ibv_qp_attr, rq_psn);
SAME_OFFSET(qp_attr, sq_psn, struct ibv_qp_attr, sq_psn);
SAME_OFFSET(qp_attr, dest_qp_num, struct ibv_qp_attr, dest_qp_num);
SAME_OFFSET(qp_attr, qp_access_flags, struct ibv_qp_attr, qp_access_flags);
SAME_OFFSET(qp_attr, cap, struct ibv_qp_attr, cap);
SAME_OFFSET(qp_attr, ah, struct ibv_qp_attr, ah_attr);
SAME_OFFSET(qp_attr, alt_ah, struct ibv_qp_attr, alt_ah_attr);
SAME_OFFSET(qp_attr, pkey_index, struct ibv_qp_attr, pkey_index);
SAME_OFFSET(qp_attr, max_rd_atomic, struct ibv_qp_attr, max_rd_atomic);
SAME_OFFSET(qp_attr, max_dest_rd_atomic, struct ibv_qp_attr, max_dest_rd_atomic);
SAME_OFFSET(qp_attr, min_rnr_timer, struct ibv_qp_attr, min_rnr_timer);
SAME_OFFSET(qp_attr, port_num, struct ibv_qp_attr, port_num);
SAME_OFFSET(qp_attr, timeout, struct ibv_qp_attr, timeout);
SAME_OFFSET(qp_attr, retry_cnt, struct ibv_qp_attr, retry_cnt);
SAME_OFFSET(qp_attr, rnr_retry, struct ibv_qp_attr, rnr_retry);
SAME_OFFSET(qp_attr, rate_limit, struct ibv_qp_attr, rate_limit);

SAME_SIZE(qp_init_attr, struct ibv_qp_init_attr);
SAME_OFFSET(qp_init_attr, send_cq, struct ibv_qp_init_attr, send_cq);
SAME_OFFSET(qp_init_attr, recv_cq, struct ibv_qp_init_attr, recv_cq);
SAME_OFFSET(qp_init_attr, cap, struct ibv_qp_init_attr, cap);
SAME_OFFSET(qp_init_attr, qp_type, struct ibv_qp_init_attr, qp_type);
SAME_OFFSET(qp_init_attr, sq_sig_all, struct ibv_qp_init_attr, sq_sig_all);

SAME_SIZE(sge, struct ibv_sge);
SAME_OFFSET(sge, length, struct ibv_sge, length);
SAME_OFFSET(sge, lkey, struct ibv_sge, lkey);

SAME_SIZE(send_wr, struct ibv_send_wr);
SAME_OFFSET(send_wr, wr_id, struct ibv_send_wr, wr_id);
SAME_OFFSET(send_wr, next, struct ibv_send_wr, next);
SAME_OFFSET(send_wr, sg_list, struct ibv_send_wr, sg_list);
SAME_OFFSET(send_wr, num_sge, struct ibv_send_wr, num_sge);
SAME_OFFSET(send_wr, opcode, struct ibv_send_wr, opcode);
SAME_OFFSET(send_wr, send_flags, struct ibv_send_wr, send_flags);
SAME_OFFSET(send_wr, imm_data, struct ibv_send_wr, imm_data);
SAME_OFFSET(send_wr, rdma, struct ibv_send_wr, wr.rdma);
static_assert(offsetof(v::send_wr, rdma) + offsetof(decltype(v::send_wr::rdma), remote_addr) ==
                  offsetof(struct ibv_send_wr, wr.rdma.remote_addr), "remote_addr");
static_assert(offsetof(v::send_wr, rdma) + offsetof(decltype(v::send_wr::rdma), rkey) ==
                  offsetof(struct ibv_send_wr, wr.rdma.rkey), "rkey");
static_assert(sizeof(decltype(v::send_wr::rdma)) == sizeof(((struct ibv_send_wr*)nullptr)->wr),
              "the wr union");
SAME_OFFSET(send_wr, qp_type_union, struct ibv_send_wr, qp_type);

SAME_SIZE(recv_wr, struct ibv_recv_wr);
SAME_OFFSET(recv_wr, num_sge, struct ibv_recv_wr, num_sge);

SAME_SIZE(wc, struct ibv_wc);
SAME_OFFSET(wc, status, struct ibv_wc, status);
SAME_OFFSET(wc, opcode, struct ibv_wc, opcode);
SAME_OFFSET(wc, vendor_err, struct ibv_wc, vendor_err);
SAME_OFFSET(wc, byte_len, struct ibv_wc, byte_len);
SAME_OFFSET(wc, imm_data, struct ibv_wc, imm_data);
SAME_OFFSET(wc, qp_num, struct ibv_wc, qp_num);
SAME_OFFSET(wc, wc_flags, struct ibv_wc, wc_flags);

// ibv_port_attr grows across rdma-core versions (we query into a 256-byte buffer).
static_assert(sizeof(v::port_attr) <= sizeof(struct ibv_port_attr), "port_attr prefix");
SAME_OFFSET(port_attr, port_cap_flags2, struct ibv_port_attr, port_cap_flags2);
SAME_OFFSET(port_attr, state, struct ibv_port_attr, state);
SAME_OFFSET(port_attr, active_mtu, struct ibv_port_attr, active_mtu);
SAME_OFFSET(port_attr, lid, struct ibv_port_attr, lid);
SAME_OFFSET(port_attr, phys_state, struct ibv_port_attr, phys_state);
SAME_OFFSET(port_attr, link_layer, struct ibv_port_attr, link_layer);

SAME_SIZE(async_event, struct ibv_async_event);
SAME_OFFSET(async_event, event_type, struct ibv_async_event, event_type);

SAME_VALUE(QPS_RESET, IBV_QPS_RESET);
SAME_VALUE(QPS_INIT, IBV_QPS_INIT);
SAME_VALUE(QPS_RTR, IBV_QPS_RTR);
SAME_VALUE(QPS_RTS, IBV_QPS_RTS);
SAME_VALUE(QPS_ERR, IBV_QPS_ERR);
SAME_VALUE(QPT_RC, IBV_QPT_RC);
SAME_VALUE(MTU_256, IBV_MTU_256);
SAME_VALUE(MTU_1024, IBV_MTU_1024);
SAME_VALUE(MTU_4096, IBV_MTU_4096);
SAME_VALUE(PORT_ACTIVE, IBV_PORT_ACTIVE);
SAME_VALUE(LINK_LAYER_INFINIBAND, IBV_LINK_LAYER_INFINIBAND);
SAME_VALUE(LINK_LAYER_ETHERNET, IBV_LINK_LAYER_ETHERNET);
SAME_VALUE(ACCESS_LOCAL_WRITE, IBV_ACCESS_LOCAL_WRITE);
SAME_VALUE(ACCESS_REMOTE_WRITE, IBV_ACCESS_REMOTE_WRITE);
SAME_VALUE(ATTR_STATE, IBV_QP_STATE);
SAME_VALUE(ATTR_ACCESS_FLAGS, IBV_QP_ACCESS_FLAGS);
SAME_VALUE(ATTR_PKEY_INDEX, IBV_QP_PKEY_INDEX);
SAME_VALUE(ATTR_PORT, IBV_QP_PORT);
SAME_VALUE(ATTR_AV, IBV_QP_AV);
SAME_VALUE(ATTR_PATH_MTU, IBV_QP_PATH_MTU);
SAME_VALUE(ATTR_TIMEOUT, IBV_QP_TIMEOUT);
SAME_VALUE(ATTR_RETRY_CNT, IBV_QP_RETRY_CNT);
SAME_VALUE(ATTR_RNR_RETRY, IBV_QP_RNR_RETRY);
SAME_VALUE(ATTR_RQ_PSN, IBV_QP_RQ_PSN);
SAME_VALUE(ATTR_MAX_QP_RD_ATOMIC, IBV_QP_MAX_QP_RD_ATOMIC);
SAME_VALUE(ATTR_MIN_RNR_TIMER, IBV_QP_MIN_RNR_TIMER);
SAME_VALUE(ATTR_SQ_PSN, IBV_QP_SQ_PSN);
SAME_VALUE(ATTR_MAX_DEST_RD_ATOMIC, IBV_QP_MAX_DEST_RD_ATOMIC);
SAME_VALUE(ATTR_DEST_QPN, IBV_QP_DEST_QPN);
SAME_VALUE(WR_RDMA_WRITE, IBV_WR_RDMA_WRITE);
SAME_VALUE(WR_RDMA_WRITE_WITH_IMM, IBV_WR_RDMA_WRITE_WITH_IMM);
SAME_VALUE(SEND_SIGNALED, IBV_SEND_SIGNALED);
SAME_VALUE(SEND_INLINE, IBV_SEND_INLINE);
SAME_VALUE(WC_SUCCESS, IBV_WC_SUCCESS);
SAME_VALUE(WC_LOC_PROT_ERR, IBV_WC_LOC_PROT_ERR);
SAME_VALUE(WC_WR_FLUSH_ERR, IBV_WC_WR_FLUSH_ERR);
SAME_VALUE(WC_REM_ACCESS_ERR, IBV_WC_REM_ACCESS_ERR);
SAME_VALUE(WC_RETRY_EXC_ERR, IBV_WC_RETRY_EXC_ERR);
SAME_VALUE(WC_RNR_RETRY_EXC_ERR, IBV_WC_RNR_RETRY_EXC_ERR);
SAME_VALUE(WC_FATAL_ERR, IBV_WC_FATAL_ERR);
SAME_VALUE(WC_GENERAL_ERR, IBV_WC_GENERAL_ERR);
SAME_VALUE(WC_RDMA_WRITE, IBV_WC_RDMA_WRITE);
SAME_VALUE(WC_RECV, IBV_WC_RECV);
SAME_VALUE(WC_RECV_RDMA_WITH_IMM, IBV_WC_RECV_RDMA_WITH_IMM);
SAME_VALUE(WC_WITH_IMM, IBV_WC_WITH_IMM);
SAME_VALUE(EVENT_CQ_ERR, IBV_EVENT_CQ_ERR);
SAME_VALUE(EVENT_QP_FATAL, IBV_EVENT_QP_FATAL);
SAME_VALUE(EVENT_QP_ACCESS_ERR, IBV_EVENT_QP_ACCESS_ERR);
SAME_VALUE(EVENT_DEVICE_FATAL, IBV_EVENT_DEVICE_FATAL);
SAME_VALUE(EVENT_PORT_ERR, IBV_EVENT_PORT_ERR);
SAME_VALUE(EVENT_GID_CHANGE, IBV_EVENT_GID_CHANGE);
SAME_VALUE(EVENT_WQ_FATAL, IBV_EVENT_WQ_FATAL);

// The exported functions have the types our table gives them (the macros over
// ibv_query_port / ibv_reg_mr are bypassed: the table calls the exported symbols).
#undef ibv_query_port
#undef ibv_reg_mr
#define SAME_ARITY(fn, field) \
  static_assert(arity(&fn) == arity(decltype(v::Api::field){}), #fn " takes another number of arguments")
template <typename R, typename... A>
constexpr int arity(R (*)(A...)) { return int(sizeof...(A)); }
SAME_ARITY(ibv_get_device_list, get_device_list);
SAME_ARITY(ibv_free_device_list, free_device_list);
SAME_ARITY(ibv_get_device_name, get_device_name);
SAME_ARITY(ibv_open_device, open_device);
SAME_ARITY(ibv_close_device, close_device);
SAME_ARITY(ibv_query_port, query_port);
SAME_ARITY(ibv_query_gid, query_gid);
SAME_ARITY(ibv_alloc_pd, alloc_pd);
SAME_ARITY(ibv_dealloc_pd, dealloc_pd);
SAME_ARITY(ibv_reg_mr, reg_mr);
SAME_ARITY(ibv_dereg_mr, dereg_mr);
SAME_ARITY(ibv_create_cq, create_cq);
SAME_ARITY(ibv_destroy_cq, destroy_cq);
SAME_ARITY(ibv_create_qp, create_qp);
SAME_ARITY(ibv_modify_qp, modify_qp);
SAME_ARITY(ibv_destroy_qp, destroy_qp);
SAME_ARITY(ibv_get_async_event, get_async_event);
SAME_ARITY(ibv_ack_async_event, ack_async_event);
SAME_ARITY(ibv_wc_status_str, wc_status_str);
SAME_ARITY(ibv_event_type_str, event_type_str);

int main() { return 0; }
