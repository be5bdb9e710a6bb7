// Bindings of the verbs transport and the generic lane check (called from NB_MODULE in
// module.cpp).
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>

#include "control.h"
#include "dict_of.h"
#include "proxy.h"
#include "verbs_transport.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace sparkccl {
namespace {

template <typename T>
T get(const nb::dict& d, const char* key, T fallback) {
  return d.contains(key) ? nb::cast<T>(d[key]) : fallback;
}

VerbsSettings settings_from(const nb::dict& d) {
  VerbsSettings s;
  s.timeout = get<int>(d, "timeout", s.timeout);
  s.retry_cnt = get<int>(d, "retry_cnt", s.retry_cnt);
  s.rnr_retry = get<int>(d, "rnr_retry", s.rnr_retry);
  s.min_rnr_timer = get<int>(d, "min_rnr_timer", s.min_rnr_timer);
  s.traffic_class = get<int>(d, "traffic_class", s.traffic_class);
  s.service_level = get<int>(d, "service_level", s.service_level);
  s.strict = get<bool>(d, "strict", s.strict);
  s.send_depth = get<int>(d, "send_depth", s.send_depth);
  s.recv_depth = get<int>(d, "recv_depth", s.recv_depth);
  s.stall_s = get<double>(d, "stall_s", s.stall_s);
  for (auto item : d) {
    std::string k = nb::cast<std::string>(item.first);
    static const char* known[] = {"timeout", "retry_cnt", "rnr_retry", "min_rnr_timer",
                                  "traffic_class", "service_level", "strict", "send_depth",
                                  "recv_depth", "stall_s"};
    bool ok = false;
    for (const char* n : known) ok |= k == n;
    if (!ok) throw std::invalid_argument("VerbsEndpoint: unknown setting '" + k + "'");
  }
  if (s.timeout < 0 || s.timeout > 31) throw std::invalid_argument("verbs timeout must be 0..31");
  if (s.retry_cnt < 0 || s.retry_cnt > 7) throw std::invalid_argument("verbs retry_cnt must be 0..7");
  if (s.rnr_retry < 0 || s.rnr_retry > 7) throw std::invalid_argument("verbs rnr_retry must be 0..7");
  if (s.min_rnr_timer < 0 || s.min_rnr_timer > 31)
    throw std::invalid_argument("verbs min_rnr_timer must be 0..31");
  if (s.traffic_class < 0 || s.traffic_class > 255)
    throw std::invalid_argument("verbs traffic_class must be 0..255");
  if (s.service_level < 0 || s.service_level > 15)
    throw std::invalid_argument("verbs service_level must be 0..15");
  return s;
}

nb::bytes as_bytes(const std::string& s) { return nb::bytes(s.data(), s.size()); }

// Lane check (generic over transports): before the proxy starts, post each row's write and
// flag, then poll the transport until every post completed and every expected local flag
// word reached `value`.
nb::dict check_lanes(Proxy& p, const std::vector<std::vector<int64_t>>& rows,
                     const std::vector<int64_t>& expect, uint64_t value, uint64_t flags_addr,
                     double timeout_s) {
  if (p.started()) throw std::runtime_error("check_lanes: the proxy has started already");
  Transport* t = p.transport();
  if (!t) throw std::runtime_error("check_lanes: the proxy's transport is not set up");
  if (!flags_addr) throw std::invalid_argument("check_lanes: null flags address");
  nb::dict out;
  out["error"] = "";
  out["conn"] = -1;
  out["missing"] = std::vector<int64_t>();
  out["unsent"] = 0;
  std::string cause;
  int bad_conn = -1;
  std::vector<int64_t> missing;
  uint64_t unsent = 0;
  {
    nb::gil_scoped_release nogil;
    t->start();
    for (auto& r : rows) {
      if (r.size() != 7) throw std::invalid_argument("check_lanes rows: [conn, src_region, src_off, dst_region, dst_off, len, word]");
      int conn = int(r[0]);
      if (r[5] > 0 && !t->write(conn, int(r[1]), uint64_t(r[2]), int(r[3]), uint64_t(r[4]),
                                uint64_t(r[5]), &cause)) {
        bad_conn = conn;
        break;
      }
      if (!t->flag(conn, uint64_t(r[6]), value, &cause)) {
        bad_conn = conn;
        break;
      }
    }
    const uint64_t deadline = now_ns() + uint64_t(timeout_s * 1e9);
    while (bad_conn < 0) {
      int c = -1;
      std::string why;
      if (!t->poll(&c, &why)) {
        bad_conn = c;
        cause = why;
        break;
      }
      unsent = t->outstanding();
      missing.clear();
      for (int64_t w : expect)
        if (load_acquire(word_at(flags_addr, uint64_t(w) * layout::FLAG_BYTES)) < value)
          missing.push_back(w);
      if (!unsent && missing.empty()) break;
      if (now_ns() > deadline) {
        cause = "timed out";
        break;
      }
      sleep_ns(20000);
    }
  }
  if (!cause.empty()) {
    out["error"] = cause;
    out["conn"] = bad_conn;
    out["missing"] = missing;
    out["unsent"] = unsent;
  }
  return out;
}

}  // namespace

void bind_verbs(nb::module_& m) {
  m.attr("VERBS_KEY_FLAGS") = VERBS_KEY_FLAGS;
  m.attr("VERBS_KEY_INBOX") = VERBS_KEY_INBOX;

  m.def(
      "verbs_library",
      []() {
        std::string err;
        const ibv::Api* a = ibv::api(&err);
        return std::make_tuple(a != nullptr, a ? a->source : err);
      },
      "(loadable, library name or the reason it cannot be loaded)");

  nb::class_<VerbsEndpoint, TransportFactory>(m, "VerbsEndpoint")
      .def(
          "__init__",
          [](VerbsEndpoint* self, int rank, int world,
             const std::vector<std::tuple<std::string, int, int>>& lanes,
             const std::vector<std::vector<int64_t>>& connections,
             const std::vector<int>& conn_lane, const nb::dict& settings) {
            std::vector<VerbsLane> ls;
            for (auto& l : lanes) ls.push_back(VerbsLane{std::get<0>(l), std::get<1>(l), std::get<2>(l)});
            std::vector<ConnInfo> cs;
            for (auto& c : connections) cs.push_back(conn_from_row(c, rank, world, "VerbsEndpoint"));
            VerbsSettings s = settings_from(settings);
            nb::gil_scoped_release nogil;
            new (self) VerbsEndpoint(rank, world, ls, cs, conn_lane, s);
          },
          "rank"_a, "world"_a, "lanes"_a, "connections"_a, "conn_lane"_a,
          "settings"_a = nb::dict(),
          "Open the lanes [(device, port, gid_index)] and create one RC QP per connection "
          "[peer, channel, root] on lane conn_lane[i] (RESET -> INIT). RuntimeError with the "
          "reason if libibverbs, a device or a verb fails.")
      .def("lanes",
           [](const VerbsEndpoint& e) {
             nb::list out;
             for (auto& l : e.lanes())
               out.append(dict_of(l, SPARKCCL_FIELD(device), SPARKCCL_FIELD(port),
                                  SPARKCCL_FIELD(gid_index), SPARKCCL_FIELD(state),
                                  SPARKCCL_FIELD(active_mtu), SPARKCCL_FIELD(link_layer),
                                  SPARKCCL_FIELD(lid),
                                  dict_field("gid", [](const VerbsLaneInfo& i) {
                                    return as_bytes(i.gid);  // bytes, not str
                                  })));
             return out;
           })
      .def("connections",
           [](const VerbsEndpoint& e) {
             nb::list out;
             for (auto& c : e.connections())
               out.append(
                   dict_of(c, SPARKCCL_FIELD(qpn), SPARKCCL_FIELD(psn), SPARKCCL_FIELD(lane)));
             return out;
           })
      .def("register_memory", &VerbsEndpoint::register_memory, "key"_a, "addr"_a, "size"_a,
           nb::call_guard<nb::gil_scoped_release>(),
           "Register [addr, addr+size) (key: region 0..2 or VERBS_KEY_FLAGS) on every lane's "
           "device: [(lkey, rkey)] per lane.")
      .def("set_remote_key", &VerbsEndpoint::set_remote_key, "conn"_a, "key"_a, "rkey"_a)
      .def("set_abort_inbox", &VerbsEndpoint::set_abort_inbox, "conn"_a, "remote_addr"_a, "rkey"_a,
           "Where this rank's abort record goes at the peer of `conn` (its inbox slot for us).")
      .def(
          "connect",
          [](VerbsEndpoint& e, int conn, uint32_t qpn, uint32_t psn, uint32_t lid,
             nb::bytes gid, int path_mtu, bool global_route) {
            std::string g(gid.c_str(), gid.size());
            nb::gil_scoped_release nogil;
            e.connect(conn, qpn, psn, lid, g, path_mtu, global_route);
          },
          "conn"_a, "qpn"_a, "psn"_a, "lid"_a, "gid"_a, "path_mtu"_a, "global_route"_a,
          "INIT -> RTR -> RTS against the peer's QP (path_mtu: ibv_mtu enum).")
      .def("qp_states", &VerbsEndpoint::qp_states)
      .def("close", &VerbsEndpoint::close, nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("library", &VerbsEndpoint::library);

  m.def("check_lanes", &check_lanes, "proxy"_a, "rows"_a, "expect"_a, "value"_a,
        "flags_addr"_a, "timeout_s"_a,
        "Lane check before start(): post rows [conn, src_region, src_off, dst_region, "
        "dst_off, len, word] (write, then flag `value`), wait until all completed and every "
        "`expect` word >= value. -> {error, conn, missing, unsent} (error '' when fine).");
}

}  // namespace sparkccl
