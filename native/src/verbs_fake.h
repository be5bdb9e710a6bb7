// Test-only fake libibverbs (verbs_fake.cpp): the harness the bindings expose as
// _native._verbs_fake_*.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "verbs_api.h"

namespace sparkccl {
namespace fakeverbs {

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

void install(const std::vector<DeviceSpec>& devices);  // also resets log and injections
void uninstall();
std::vector<Record> take_log(bool clear);
// The (after + 1)-th WR executed from now on QP qpn completes with `status` (QP -> ERR).
bool inject(uint32_t qpn, int status, uint32_t vendor_err, uint64_t after);
// Queue an async event: on QP qpn, or (qpn 0) on context ctx_id (port events use `port`).
bool async(uint32_t qpn, int ctx_id, int type, int port);
void pause(bool on);  // stop executing posted WRs
// > 0: non-inline write data becomes visible delay_s after execution (PCIe reordering);
// 0: off (everything in flight lands now).
void reorder(double delay_s);
void fail_next(const std::string& call, int err);  // get_device_list, open_device, reg_mr, create_qp, modify_qp
std::vector<QpState> qp_states();
uint64_t cq_overflows();
std::string context_gid(int ctx_id, int index);

}  // namespace fakeverbs
}  // namespace sparkccl
