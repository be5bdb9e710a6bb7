// libibverbs loaded at run time (dlopen), so the package works without rdma-core.
#include "verbs_api.h"

#include <dlfcn.h>

#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>

namespace sparkccl {
namespace ibv {
namespace {

// One table per library name tried (SPARKCCL_IBVERBS_LIB may name another one later, e.g. in
// tests); a table, once handed out, is never changed or freed.
struct Loaded {
  Api api;
  std::string error;
};
std::mutex g_mu;
std::map<std::string, std::unique_ptr<Loaded>> g_libs;

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

std::unique_ptr<Loaded> load(const std::string& lib, bool from_env) {
  std::unique_ptr<Loaded> out(new Loaded);
  void* h = dlopen(lib.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* e = dlerror();
    out->error = "cannot load " + lib + " (" + (e ? e : "unknown error") +
                 "): install rdma-core (e.g. apt install libibverbs1 ibverbs-providers)" +
                 (from_env ? " or fix SPARKCCL_IBVERBS_LIB" : "");
    return out;
  }
  Api& a = out->api;
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
    out->error = lib + " lacks " + missing + " (rdma-core too old?)";
    dlclose(h);
  }
  // Otherwise the handle stays open for the life of the process (it loaded the providers).
  return out;
}

}  // namespace

const Api* api(std::string* error) {
  const char* env = std::getenv("SPARKCCL_IBVERBS_LIB");
  const bool from_env = env && *env;
  const std::string lib = from_env ? env : "libibverbs.so.1";
  std::lock_guard<std::mutex> lk(g_mu);
  auto it = g_libs.find(lib);
  if (it == g_libs.end()) it = g_libs.emplace(lib, load(lib, from_env)).first;
  if (!it->second->error.empty()) {
    if (error) *error = it->second->error;
    return nullptr;
  }
  return &it->second->api;
}

}  // namespace ibv
}  // namespace sparkccl
