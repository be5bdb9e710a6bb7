// The texts libibverbs gives completion statuses and async events (ibv_wc_status_str,
// ibv_event_type_str), for the test libibverbs stand-ins (verbsfake/, emunic/).
#pragma once
#include "verbs_api.h"

namespace sparkccl {
namespace ibv {

inline const char* wc_status_text(int s) {
  switch (s) {
    case WC_SUCCESS: return "success";
    case WC_LOC_LEN_ERR: return "local length error";
    case WC_LOC_QP_OP_ERR: return "local QP operation error";
    case WC_LOC_PROT_ERR: return "local protection error";
    case WC_WR_FLUSH_ERR: return "Work Request Flushed Error";
    case WC_REM_INV_REQ_ERR: return "remote invalid request error";
    case WC_REM_ACCESS_ERR: return "remote access error";
    case WC_REM_OP_ERR: return "remote operation error";
    case WC_RETRY_EXC_ERR: return "transport retry counter exceeded";
    case WC_RNR_RETRY_EXC_ERR: return "RNR retry counter exceeded";
    case WC_FATAL_ERR: return "fatal error";
    case WC_GENERAL_ERR: return "general error";
    default: return "unknown";
  }
}

inline const char* event_type_text(int t) {
  switch (t) {
    case EVENT_CQ_ERR: return "CQ error";
    case EVENT_QP_FATAL: return "local work queue catastrophic error";
    case EVENT_QP_REQ_ERR: return "invalid request local work queue error";
    case EVENT_QP_ACCESS_ERR: return "local access violation work queue error";
    case EVENT_DEVICE_FATAL: return "local catastrophic error";
    case EVENT_PORT_ACTIVE: return "port active";
    case EVENT_PORT_ERR: return "port error";
    default: return "unknown";
  }
}

}  // namespace ibv
}  // namespace sparkccl
