// libibverbs loaded at run time (dlopen), so the package works without rdma-core.
#include "verbs_api.h"

#include <dlfcn.h>

#include <atomic>
#include <cstdlib>
#include <mutex>

namespace sparkccl {
namespace ibv {
namespace {

std::mutex g_mu;
Api g_real;
bool g_tried = false;
std::string g_lib;  // the library name of the last attempt
std::string g_error;
std::atomic<const Api*> g_fake{nullptr};

template <typename F>
bool resolve(void* h, const char* name, F* out, std::string* missing) {
  void* p = dlsym(h, name);
  if (!p) {
    if (!missing->empty()) *missing += ", ";
    *missing += name;
    return false;
  }
  *out = reinterpret_cast<F>(p);
  return true;
}

std::string wanted_lib() {
  const char* env = std::getenv("SPARKCCL_IBVERBS_LIB");
  return (env && *env) ? env : "libibverbs.so.1";
}

void load_locked() {
  g_tried = true;
  g_error.clear();
  const char* env = std::getenv("SPARKCCL_IBVERBS_LIB");
  std::string lib = wanted_lib();
  g_lib = lib;
  void* h = dlopen(lib.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* e = dlerror();
    g_error = "cannot load " + lib + " (" + (e ? e : "unknown error") +
              "): install rdma-core (e.g. apt install libibverbs1 ibverbs-providers)" +
              (env && *env ? " or fix SPARKCCL_IBVERBS_LIB" : "");
    return;
  }
  Api a;
  a.source = lib;
  std::string missing;
  resolve(h, "ibv_get_device_list", &a.get_device_list, &missing);
  resolve(h, "ibv_free_device_list", &a.free_device_list, &missing);
  resolve(h, "ibv_get_device_name", &a.get_device_name, &missing);
  resolve(h, "ibv_open_device", &a.open_device, &missing);
  resolve(h, "ibv_close_device", &a.close_device, &missing);
  resolve(h, "ibv_query_port", &a.query_port, &missing);
  resolve(h, "ibv_query_gid", &a.query_gid, &missing);
  resolve(h, "ibv_alloc_pd", &a.alloc_pd, &missing);
  resolve(h, "ibv_dealloc_pd", &a.dealloc_pd, &missing);
  resolve(h, "ibv_reg_mr", &a.reg_mr, &missing);
  resolve(h, "ibv_dereg_mr", &a.dereg_mr, &missing);
  resolve(h, "ibv_create_cq", &a.create_cq, &missing);
  resolve(h, "ibv_destroy_cq", &a.destroy_cq, &missing);
  resolve(h, "ibv_create_qp", &a.create_qp, &missing);
  resolve(h, "ibv_modify_qp", &a.modify_qp, &missing);
  resolve(h, "ibv_destroy_qp", &a.destroy_qp, &missing);
  resolve(h, "ibv_get_async_event", &a.get_async_event, &missing);
  resolve(h, "ibv_ack_async_event", &a.ack_async_event, &missing);
  resolve(h, "ibv_wc_status_str", &a.wc_status_str, &missing);
  resolve(h, "ibv_event_type_str", &a.event_type_str, &missing);
  if (!missing.empty()) {
    g_error = lib + " lacks " + missing + " (rdma-core too old?)";
    dlclose(h);
    return;
  }
  // The handle stays open for the life of the process (providers are loaded by it).
  g_real = a;
}

}  // namespace

const Api* api(std::string* error) {
  if (const Api* f = g_fake.load(std::memory_order_acquire)) return f;
  std::lock_guard<std::mutex> lk(g_mu);
  // A failed attempt is retried when SPARKCCL_IBVERBS_LIB names another library since.
  if (!g_tried || (!g_error.empty() && wanted_lib() != g_lib)) load_locked();
  if (!g_error.empty()) {
    if (error) *error = g_error;
    return nullptr;
  }
  return &g_real;
}

void install_fake(const Api* fake) { g_fake.store(fake, std::memory_order_release); }

}  // namespace ibv
}  // namespace sparkccl
