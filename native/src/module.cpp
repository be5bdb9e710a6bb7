// Python binding: sparkccl._native. Addresses are plain ints (the Python side maps POSIX
// shm with mmap and passes the address). Every call that can wait releases the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>

#include "control.h"
#include "dict_of.h"
#include "geometry.h"
#include "layout.h"
#include "proxy.h"

namespace nb = nanobind;
using namespace nb::literals;
using namespace sparkccl;

namespace {

nb::dict layout_dict() {
  using namespace sparkccl::layout;
  nb::dict d;
#define SPARKCCL_PUT(name) d[#name] = nb::int_(name)
  SPARKCCL_PUT(PAGE);
  SPARKCCL_PUT(CTL_MAGIC);
  SPARKCCL_PUT(CTL_ABORT);
  SPARKCCL_PUT(CTL_RING_HEAD);
  SPARKCCL_PUT(CTL_RING_TAIL);
  SPARKCCL_PUT(CTL_PID);
  SPARKCCL_PUT(CTL_GPU_STATUS);
  SPARKCCL_PUT(CTL_GPU_DETAIL);
  SPARKCCL_PUT(CTL_GPU_SEQ);
  SPARKCCL_PUT(CTL_GPU_ACK);
  SPARKCCL_PUT(CTL_GPU_MODE);
  SPARKCCL_PUT(CTL_LEFT);
  SPARKCCL_PUT(CTL_ERROR);
  SPARKCCL_PUT(ERROR_BYTES);
  SPARKCCL_PUT(CTL_BYTES);
  SPARKCCL_PUT(CTL_MAGIC_VALUE);
  SPARKCCL_PUT(ABORT_NONE);
  SPARKCCL_PUT(ABORT_TIMEOUT);
  SPARKCCL_PUT(ABORT_TRANSPORT);
  SPARKCCL_PUT(ABORT_PEER);
  SPARKCCL_PUT(ABORT_USER);
  SPARKCCL_PUT(RING_OFFSET);
  SPARKCCL_PUT(RING_ENTRIES);
  SPARKCCL_PUT(RING_ENTRY_BYTES);
  SPARKCCL_PUT(ENT_TAG);
  SPARKCCL_PUT(ENT_SEQ);
  SPARKCCL_PUT(ENT_SLICE);
  SPARKCCL_PUT(ENT_LO);
  SPARKCCL_PUT(ENT_HI);
  SPARKCCL_PUT(ENT_OP);
  SPARKCCL_PUT(ENT_DTYPE);
  SPARKCCL_PUT(ENT_KIND);
  SPARKCCL_PUT(ENT_PIECE);
  SPARKCCL_PUT(ENT_PAD);
  SPARKCCL_PUT(CALL_DTYPE_SHIFT);
  SPARKCCL_PUT(CALL_KIND_SHIFT);
  SPARKCCL_PUT(CALL_PIECE_SHIFT);
  SPARKCCL_PUT(CALL_PAD_SHIFT);
  SPARKCCL_PUT(ENT_CHUNK);
  SPARKCCL_PUT(ENT_GRANULE);
  SPARKCCL_PUT(ENT_PUBLISH_NS);
  SPARKCCL_PUT(CHUNK_ALL);
  SPARKCCL_PUT(CHUNK_DIRECT);
  SPARKCCL_PUT(CHUNK_LL);
  SPARKCCL_PUT(CHUNK_WHOLE);
  SPARKCCL_PUT(FLAGS_OFFSET);
  SPARKCCL_PUT(FLAG_BYTES);
  SPARKCCL_PUT(FLAG_WORDS_PER_RANK);
  SPARKCCL_PUT(CALL_SLOTS);
  SPARKCCL_PUT(CALL_ENTRY_WORDS);
  SPARKCCL_PUT(CALL_TAGGED);
  SPARKCCL_PUT(CALL_SLICE);
  SPARKCCL_PUT(CALL_SIZED);
  SPARKCCL_PUT(CALL_SIZED_CHUNKS);
  SPARKCCL_PUT(CALL_LEN_BITS);
  SPARKCCL_PUT(CALL_LEN_UNKNOWN);
  SPARKCCL_PUT(CALL_TAG_MASK);
  SPARKCCL_PUT(CALL_SLICE_TAG_SHIFT);
  SPARKCCL_PUT(LL_SLOTS);
  SPARKCCL_PUT(LL_SOURCE_BYTES);
  SPARKCCL_PUT(LL_MAX_BYTES);
  return d;
}

// Every constant of sparkccl/include/sparkccl/protocol.h as compiled here; a test checks
// it equals what sparkccl/layout.py reads from the header's text.
nb::dict protocol_dict() {
  using namespace sparkccl::geom;
  using namespace sparkccl::gpu;
  nb::dict d = layout_dict();
  {
    using namespace sparkccl::layout;
    for (auto [name, v] : {std::pair<const char*, int>{"DTYPE_UNSAID", DTYPE_UNSAID},
                           {"DTYPE_F32", DTYPE_F32}, {"DTYPE_F16", DTYPE_F16},
                           {"DTYPE_BF16", DTYPE_BF16}, {"DTYPE_F64", DTYPE_F64},
                           {"DTYPE_U8", DTYPE_U8}, {"DTYPE_I8", DTYPE_I8},
                           {"DTYPE_I16", DTYPE_I16}, {"DTYPE_I32", DTYPE_I32},
                           {"DTYPE_I64", DTYPE_I64}, {"DTYPE_BOOL", DTYPE_BOOL},
                           {"DTYPE_F8E4M3", DTYPE_F8E4M3}, {"DTYPE_F8E5M2", DTYPE_F8E5M2},
                           {"DTYPE_C64", DTYPE_C64}, {"DTYPE_C128", DTYPE_C128},
                           {"DTYPE_U16", DTYPE_U16}, {"DTYPE_U32", DTYPE_U32},
                           {"DTYPE_U64", DTYPE_U64}, {"DTYPE_OTHER", DTYPE_OTHER},
                           {"KIND_UNSAID", KIND_UNSAID}, {"KIND_ALL_GATHER", KIND_ALL_GATHER},
                           {"KIND_REDUCE_SCATTER_SUM", KIND_REDUCE_SCATTER_SUM},
                           {"KIND_ALL_REDUCE_SUM", KIND_ALL_REDUCE_SUM},
                           {"KIND_ALL_REDUCE_AVG", KIND_ALL_REDUCE_AVG},
                           {"KIND_MOE_FINALIZE", KIND_MOE_FINALIZE},
                           {"KIND_ALL_TO_ALL", KIND_ALL_TO_ALL},
                           {"KIND_ALL_TO_ALL_SIZED", KIND_ALL_TO_ALL_SIZED}})
      d[name] = nb::int_(v);
  }
  SPARKCCL_PUT(PIECES);
  SPARKCCL_PUT(ALIGN);
  SPARKCCL_PUT(ROOT_SPLIT_MIN);
  SPARKCCL_PUT(FLAG_STRIDE);
  SPARKCCL_PUT(PROG_STRIDE);
  SPARKCCL_PUT(FAILED);
  SPARKCCL_PUT(NO_WORD);
  SPARKCCL_PUT(NO_SOURCE);
  SPARKCCL_PUT(COUNTER_SETS);
  SPARKCCL_PUT(MAX_DIRECT);
  SPARKCCL_PUT(DT_STREAM);
  SPARKCCL_PUT(DT_ITEM);
  SPARKCCL_PUT(DT_FLAG);
  SPARKCCL_PUT(DT_FIRST);
  SPARKCCL_PUT(DT_ITEMS);
  SPARKCCL_PUT(DT_CHUNK);
  SPARKCCL_PUT(DT_BASE);
  SPARKCCL_PUT(DT_STRIDE);
  SPARKCCL_PUT(DT_SLOTS);
  SPARKCCL_PUT(DT_BLOCK);
  SPARKCCL_PUT(DT_PART);
  SPARKCCL_PUT(FIN_CLAIM);
  SPARKCCL_PUT(FIN_SET);
  SPARKCCL_PUT(ONE_HANDOFF_SLICE);
  SPARKCCL_PUT(GPU_FAIL_STOP);
  SPARKCCL_PUT(GPU_FAIL_POISON);
  SPARKCCL_PUT(POISON_BYTE);
  SPARKCCL_PUT(ACK_WAIT_NS);
  SPARKCCL_PUT(ACK_GO);
  SPARKCCL_PUT(ACK_HOLD);
  SPARKCCL_PUT(HOLD_WAIT_NS);
  SPARKCCL_PUT(STATE_PROGRESS);
  SPARKCCL_PUT(STATE_DEAD);
  SPARKCCL_PUT(STATE_SEQ);
  SPARKCCL_PUT(STATE_RING);
  SPARKCCL_PUT(STATE_GATE);
  SPARKCCL_PUT(STATE_TIMEOUT);
  SPARKCCL_PUT(STATE_EXITS);
  SPARKCCL_PUT(STATE_CLOCK);
  SPARKCCL_PUT(STATE_TAIL);
  SPARKCCL_PUT(STATE_TIMELINE);
  SPARKCCL_PUT(STATE_WORDS);
  SPARKCCL_PUT(TL_CALLS);
  SPARKCCL_PUT(TL_POINTS);
  SPARKCCL_PUT(TL_ENTER);
  SPARKCCL_PUT(TL_WRITTEN);
  SPARKCCL_PUT(TL_HANDED);
  SPARKCCL_PUT(TL_SEEN);
  SPARKCCL_PUT(TL_RELEASED);
  SPARKCCL_PUT(TL_SUMMED);
  SPARKCCL_PUT(TL_EXIT);
  SPARKCCL_PUT(TL_STORED);
  SPARKCCL_PUT(SLOT_SHIFT);
  {
    using namespace sparkccl::kargs;
    SPARKCCL_PUT(WP_FLAGS);
    SPARKCCL_PUT(WP_ABORT_W);
    SPARKCCL_PUT(WP_STATUS);
    SPARKCCL_PUT(WP_WAITS);
    SPARKCCL_PUT(WP_PARTS);
    SPARKCCL_PUT(WP_MAXW);
    SPARKCCL_PUT(WP_STATE);
    SPARKCCL_PUT(WP_RANK);
    SPARKCCL_PUT(WP_WORLD);
    SPARKCCL_PUT(WP_TIMEOUT_NS);
    SPARKCCL_PUT(WP_BYTES);
    SPARKCCL_PUT(AR_SRC);
    SPARKCCL_PUT(AR_DST);
    SPARKCCL_PUT(AR_L);
    SPARKCCL_PUT(AR_S);
    SPARKCCL_PUT(AR_AVG);
    SPARKCCL_PUT(AR_SLOT);
    SPARKCCL_PUT(AR_SLOT_CODE);
    SPARKCCL_PUT(AR_DTAB);
    SPARKCCL_PUT(AR_RING);
    SPARKCCL_PUT(AR_CALL);
    SPARKCCL_PUT(AR_COUNTERS);
    SPARKCCL_PUT(AR_NPUB);
    SPARKCCL_PUT(AR_GATE);
    SPARKCCL_PUT(AR_WP);
    SPARKCCL_PUT(AR_LL);
    SPARKCCL_PUT(AR_LL_PROXY);
    SPARKCCL_PUT(AR_BYTES);
    SPARKCCL_PUT(FAR_SRC);
    SPARKCCL_PUT(FAR_SRC_STRIDE);
    SPARKCCL_PUT(FAR_DST);
    SPARKCCL_PUT(FAR_DST_STRIDE);
    SPARKCCL_PUT(FAR_L);
    SPARKCCL_PUT(FAR_S);
    SPARKCCL_PUT(FAR_AVG);
    SPARKCCL_PUT(FAR_SEND);
    SPARKCCL_PUT(FAR_SEND_CODE);
    SPARKCCL_PUT(FAR_RECV);
    SPARKCCL_PUT(FAR_RECV_CODE);
    SPARKCCL_PUT(FAR_AG);
    SPARKCCL_PUT(FAR_AG_CODE);
    SPARKCCL_PUT(FAR_RING);
    SPARKCCL_PUT(FAR_RS_CALL);
    SPARKCCL_PUT(FAR_AG_CALL);
    SPARKCCL_PUT(FAR_COUNTERS);
    SPARKCCL_PUT(FAR_AG_COUNTERS);
    SPARKCCL_PUT(FAR_NPUB);
    SPARKCCL_PUT(FAR_RS_DTAB);
    SPARKCCL_PUT(FAR_AG_DTAB);
    SPARKCCL_PUT(FAR_WP_RS);
    SPARKCCL_PUT(FAR_WP_AG);
    SPARKCCL_PUT(FAR_BYTES);
    SPARKCCL_PUT(PUB_SRC);
    SPARKCCL_PUT(PUB_SRC_STRIDE);
    SPARKCCL_PUT(PUB_DST);
    SPARKCCL_PUT(PUB_DST_CODE);
    SPARKCCL_PUT(PUB_DST_STRIDE);
    SPARKCCL_PUT(PUB_DST2);
    SPARKCCL_PUT(PUB_NCHUNKS);
    SPARKCCL_PUT(PUB_L);
    SPARKCCL_PUT(PUB_S);
    SPARKCCL_PUT(PUB_RING);
    SPARKCCL_PUT(PUB_STATE);
    SPARKCCL_PUT(PUB_CALL);
    SPARKCCL_PUT(PUB_COUNTERS);
    SPARKCCL_PUT(PUB_BPP);
    SPARKCCL_PUT(PUB_BYTES);
    SPARKCCL_PUT(PX_PUB);
    SPARKCCL_PUT(PX_IN);
    SPARKCCL_PUT(PX_IN_CODE);
    SPARKCCL_PUT(PX_OWN);
    SPARKCCL_PUT(PX_OWN_CODE);
    SPARKCCL_PUT(PX_OWN_SYS);
    SPARKCCL_PUT(PX_OUT);
    SPARKCCL_PUT(PX_OUT_STRIDE);
    SPARKCCL_PUT(PX_WP);
    SPARKCCL_PUT(PX_ADV_ENTRIES);
    SPARKCCL_PUT(PX_ADV_GATE);
    SPARKCCL_PUT(PX_BYTES);
    SPARKCCL_PUT(FR_Y);
    SPARKCCL_PUT(FR_SCALES);
    SPARKCCL_PUT(FR_POS);
    SPARKCCL_PUT(FR_WTS);
    SPARKCCL_PUT(FR_SHARED);
    SPARKCCL_PUT(FR_BAD);
    SPARKCCL_PUT(FR_T);
    SPARKCCL_PUT(FR_TOPK);
    SPARKCCL_PUT(FR_H);
    SPARKCCL_PUT(FR_R);
    SPARKCCL_PUT(FR_FP8);
    SPARKCCL_PUT(FR_RR);
    SPARKCCL_PUT(FR_ROW_LO);
    SPARKCCL_PUT(FR_ROWS);
    SPARKCCL_PUT(FR_ROWS_PAD);
    SPARKCCL_PUT(FR_BYTES);
    SPARKCCL_PUT(FN_ROWS);
    SPARKCCL_PUT(FN_WORLD);
    SPARKCCL_PUT(FN_RANK);
    SPARKCCL_PUT(FN_SEND);
    SPARKCCL_PUT(FN_SEND_CODE);
    SPARKCCL_PUT(FN_OWN);
    SPARKCCL_PUT(FN_RING);
    SPARKCCL_PUT(FN_STATE);
    SPARKCCL_PUT(FN_CALL);
    SPARKCCL_PUT(FN_COUNTERS);
    SPARKCCL_PUT(FN_BYTES);
    SPARKCCL_PUT(FD_ROWS);
    SPARKCCL_PUT(FD_DTAB);
    SPARKCCL_PUT(FD_RING);
    SPARKCCL_PUT(FD_CALL);
    SPARKCCL_PUT(FD_COUNTERS);
    SPARKCCL_PUT(FD_NPUB);
    SPARKCCL_PUT(FD_GATE);
    SPARKCCL_PUT(FD_RECV);
    SPARKCCL_PUT(FD_RECV_CODE);
    SPARKCCL_PUT(FD_OWN);
    SPARKCCL_PUT(FD_DST);
    SPARKCCL_PUT(FD_WP);
    SPARKCCL_PUT(FD_ADV_ENTRIES);
    SPARKCCL_PUT(FD_ADV_GATE);
    SPARKCCL_PUT(FD_BYTES);
    SPARKCCL_PUT(WR_IN);
    SPARKCCL_PUT(WR_IN_CODE);
    SPARKCCL_PUT(WR_OWN);
    SPARKCCL_PUT(WR_OWN_CODE);
    SPARKCCL_PUT(WR_OWN_SYS);
    SPARKCCL_PUT(WR_OUT);
    SPARKCCL_PUT(WR_OUT_STRIDE);
    SPARKCCL_PUT(WR_L);
    SPARKCCL_PUT(WR_S);
    SPARKCCL_PUT(WR_WP);
    SPARKCCL_PUT(WR_ADV_ENTRIES);
    SPARKCCL_PUT(WR_ADV_GATE);
    SPARKCCL_PUT(WR_BYTES);
    SPARKCCL_PUT(DX_SRC);
    SPARKCCL_PUT(DX_SRC_CODE);
    SPARKCCL_PUT(DX_SRC_STRIDE);
    SPARKCCL_PUT(DX_SRC_SYS);
    SPARKCCL_PUT(DX_DTAB);
    SPARKCCL_PUT(DX_OWN_DST);
    SPARKCCL_PUT(DX_OWN_DST_CODE);
    SPARKCCL_PUT(DX_DST2);
    SPARKCCL_PUT(DX_RING);
    SPARKCCL_PUT(DX_CALL);
    SPARKCCL_PUT(DX_COUNTERS);
    SPARKCCL_PUT(DX_NPUB);
    SPARKCCL_PUT(DX_WAIT);
    SPARKCCL_PUT(DX_BYTES);
    SPARKCCL_PUT(SU_UNIT);
    SPARKCCL_PUT(SU_STAGE);
    SPARKCCL_PUT(SU_OWN);
    SPARKCCL_PUT(SU_OWN_SYS);
    SPARKCCL_PUT(SU_DST);
    SPARKCCL_PUT(SU_L);
    SPARKCCL_PUT(SU_S);
    SPARKCCL_PUT(SU_RANK);
    SPARKCCL_PUT(SU_WORLD);
    SPARKCCL_PUT(SU_PARTS);
    SPARKCCL_PUT(SU_MAXW);
    SPARKCCL_PUT(SU_BYTES);
  }
#undef SPARKCCL_PUT
  return d;
}

void check_addr(uint64_t addr, const char* what) {
  if (!addr) throw std::invalid_argument(std::string(what) + ": null address");
}

}  // namespace

namespace sparkccl {
void bind_verbs(nb::module_& m);  // verbs_module.cpp: verbs transport, lane check
}

namespace sparkccl {
void bind_finalize(nb::module_& m);  // finalize_cpu.cpp: the CPU twin of the finalize rows
void bind_ep_cpu(nb::module_& m);  // ep_cpu.cpp: the CPU twin of EP dispatch's pack / unpack
void bind_cuda_ops(nb::module_& m);  // cuda_ops.cpp: the copy-engine data plane's stream ops
}

NB_MODULE(_native, m) {
  m.doc() = "sparkccl native layer: control block, publish/wait helpers, the proxy, and its shm, tcp and verbs transports";
  m.attr("ABI_VERSION") = 3;

  m.def("layout", &layout_dict, "The control-segment layout constants (names as in sparkccl/layout.py).");
  m.def("protocol", &protocol_dict, "Every constant of sparkccl/include/sparkccl/protocol.h.");

  m.def(
      "piece_bounds",
      [](uint64_t slice, int piece, uint64_t granule) {
        if (piece < 0 || piece >= geom::PIECES) throw std::invalid_argument("piece out of range 0..7");
        if (granule == 0) throw std::invalid_argument("granule must be > 0");
        return geom::piece_bounds(slice, piece, granule);
      },
      "slice"_a, "piece"_a, "granule"_a = 16);

  m.def(
      "root1_idle",
      [](uint64_t slice, uint64_t granule) {
        if (granule == 0) throw std::invalid_argument("granule must be > 0");
        return geom::root1_idle(slice, granule);
      },
      "slice"_a, "granule"_a = 16,
      "Whether a collective of this slice leaves root 1 idle (protocol.h).");

  m.def("sized_bytes", [](uint64_t h, uint64_t L) { return geom::sized_bytes(h, L); },
        "h"_a, "L"_a, "The bytes of a sized all-to-all's chunk of L bytes that travel (protocol.h).");

  m.def(
      "sub_range",
      [](uint64_t lo, uint64_t hi, int root, int roots, int half, int halves) {
        if (hi < lo) throw std::invalid_argument("hi < lo");
        return geom::sub_range(lo, hi, root, roots, half, halves);
      },
      "lo"_a, "hi"_a, "root"_a, "roots"_a, "half"_a, "halves"_a);

  m.def(
      "init_control",
      [](uint64_t ctl, uint64_t pid) {
        check_addr(ctl, "init_control");
        init_control(ctl, pid);
      },
      "ctl_addr"_a, "pid"_a);

  m.def(
      "publish",
      [](uint64_t ctl, int op, uint64_t seq, int piece, int chunk, uint64_t slice,
         uint64_t granule, double timeout_s, uint64_t call) {
        check_addr(ctl, "publish");
        nb::gil_scoped_release nogil;
        return publish(ctl, op, seq, piece, chunk, slice, granule, timeout_s, call);
      },
      "ctl_addr"_a, "op"_a, "seq"_a, "piece"_a, "chunk"_a, "slice"_a, "granule"_a,
      "timeout_s"_a, "call"_a = 0,
      "Publish piece `piece` of collective `seq`. call: the entry's call word (protocol.h "
      "call_word: dtype, kind, padding) without op and piece, which this call adds.");
  m.def(
      "publish_range",
      [](uint64_t ctl, int op, uint64_t seq, int first, int last, int chunk, uint64_t slice,
         uint64_t granule, double timeout_s, uint64_t call) -> int64_t {
        // Pieces first..last in one call (a small slice publishes all 8 at once): one
        // Python -> native crossing instead of eight; the entries are the same.
        check_addr(ctl, "publish_range");
        if (first < 0 || last < first || last >= geom::PIECES)
          throw std::invalid_argument("publish_range: pieces must satisfy 0 <= first <= last < 8");
        // (CHUNK_WHOLE: one entry for pieces 0..last)
        if (chunk == layout::CHUNK_WHOLE && first != 0)
          throw std::invalid_argument("publish_range: CHUNK_WHOLE stands for pieces 0..last");
        nb::gil_scoped_release nogil;
        for (int piece = chunk == layout::CHUNK_WHOLE ? last : first; piece <= last; ++piece) {
          int64_t code = publish(ctl, op, seq, piece, chunk, slice, granule, timeout_s, call);
          if (code) return code;
        }
        return 0;
      },
      "ctl_addr"_a, "op"_a, "seq"_a, "first"_a, "last"_a, "chunk"_a, "slice"_a, "granule"_a,
      "timeout_s"_a, "call"_a = 0);

  m.def(
      "wait_flags",
      [](uint64_t ctl, uint64_t flags, std::vector<int64_t> words, uint64_t value,
         double timeout_s) {
        check_addr(ctl, "wait_flags");
        check_addr(flags, "wait_flags");
        nb::gil_scoped_release nogil;
        return wait_flags(ctl, flags, words, value, timeout_s);
      },
      "ctl_addr"_a, "flags_addr"_a, "words"_a, "value"_a, "timeout_s"_a);

  m.def(
      "set_abort",
      [](uint64_t ctl, uint64_t code, const std::string& message) {
        check_addr(ctl, "set_abort");
        return set_abort(ctl, code, message);
      },
      "ctl_addr"_a, "code"_a, "message"_a);

  m.def(
      "abort_code",
      [](uint64_t ctl) {
        check_addr(ctl, "abort_code");
        return abort_code(ctl);
      },
      "ctl_addr"_a);

  m.def(
      "error_text",
      [](uint64_t ctl) {
        check_addr(ctl, "error_text");
        nb::gil_scoped_release nogil;
        return error_text(ctl);
      },
      "ctl_addr"_a);

  // Every transport reaches the proxy the same way: one of these, given to Proxy.attach.
  nb::class_<TransportFactory>(m, "TransportFactory")
      .def_prop_ro("kind", [](const TransportFactory& f) { return std::string(f.kind()); });
  nb::class_<ShmFactory, TransportFactory>(m, "ShmTransport")
      .def(nb::init<uint64_t>(), "spin_us"_a = 0,
           "Copies into the peers' regions mapped here (Proxy.set_peer_region); each copy "
           "worker spins spin_us after its last operation before it sleeps.");
  nb::class_<TcpFactory, TransportFactory>(m, "TcpTransport")
      .def(nb::init<std::vector<int>, const std::vector<std::vector<int64_t>>&>(), "send_fds"_a,
           "recv"_a,
           "Connected sockets: send_fds[i] for connection i, recv rows [fd, peer, channel, "
           "root]. Owns (and closes) them from here on; Proxy.attach hands them over.");

  nb::class_<Proxy>(m, "Proxy")
      .def(nb::init<int, int, uint64_t, uint64_t, const std::vector<std::vector<int64_t>>&,
                    const std::vector<std::vector<int64_t>>&,
                    const std::vector<std::vector<int64_t>>&, const std::vector<int>&, uint64_t,
                    uint64_t>(),
           "rank"_a, "world"_a, "ctl_addr"_a, "flags_addr"_a, "connections"_a, "streams"_a,
           "items"_a, "slots"_a = std::vector<int>{3, 2, 2}, "spin_us"_a = 200000,
           "nap_us"_a = 200)
      // keep_alive: the transport made may borrow its factory (VerbsEndpoint's queue pairs).
      .def("attach", &Proxy::attach, "transport"_a, nb::keep_alive<1, 2>(),
           "The proxy's transport, from a TransportFactory (ShmTransport, TcpTransport, "
           "VerbsEndpoint); once, before start().")
      .def("set_region", &Proxy::set_region, "region"_a, "base"_a, "stride"_a, "size"_a = 0,
           "Local region base address and slot stride; size 0 means slots * stride.")
      .def("set_peer", &Proxy::set_peer, "peer"_a, "ctl_addr"_a, "flags_addr"_a, "pid"_a)
      .def("set_peer_region", &Proxy::set_peer_region, "peer"_a, "region"_a, "base"_a,
           "size"_a = 0, "Peer's region base mapped here; size 0 means slots * our stride.")
      .def("set_gpu_streams", &Proxy::set_gpu_streams, "streams"_a,
           "Publish-triggered streams (indices into the stream table) the data plane may "
           "execute itself (GPU-direct); skipped for collectives published with chunk -2. "
           "Before start().")
      .def("set_relay_lead", &Proxy::set_relay_lead, "pieces"_a,
           "Own pieces a connection may carry ahead of the pieces relayed on it (-1: no "
           "limit). Before start().")
      .def("start", &Proxy::start, nb::call_guard<nb::gil_scoped_release>())
      .def("stop", &Proxy::stop, "graceful"_a = false, nb::call_guard<nb::gil_scoped_release>())
      .def("outstanding", &Proxy::outstanding)
      .def("delivered", &Proxy::delivered,
           "N: every collective before seq N that this rank published is fully posted (its "
           "own pieces and its relays); with outstanding() == 0 also completed")
      .def_prop_ro("running", &Proxy::running)
      .def("stats", [](Proxy& p) {
        ProxyStats s = p.stats();
        return dict_of(s,
                       SPARKCCL_FIELD(entries),
                       SPARKCCL_FIELD(stale_entries),
                       SPARKCCL_FIELD(writes),
                       SPARKCCL_FIELD(bytes),
                       SPARKCCL_FIELD(flags),
                       SPARKCCL_FIELD(turns),
                       SPARKCCL_FIELD(naps),
                       SPARKCCL_FIELD(delay_samples),
                       SPARKCCL_FIELD(delay_p50_ns),
                       SPARKCCL_FIELD(delay_p99_ns),
                       SPARKCCL_FIELD(gpu_pieces),
                       SPARKCCL_FIELD(publish_samples),
                       SPARKCCL_FIELD(publish_p50_ns),
                       SPARKCCL_FIELD(publish_p99_ns),
                       SPARKCCL_FIELD(first_samples),
                       SPARKCCL_FIELD(first_p50_ns),
                       SPARKCCL_FIELD(first_p99_ns),
                       SPARKCCL_FIELD(first_delay_p50_ns),
                       SPARKCCL_FIELD(first_delay_p99_ns),
                       SPARKCCL_FIELD(post_ns),
                       SPARKCCL_FIELD(call_entries),
                       SPARKCCL_FIELD(write_flag_samples),
                       SPARKCCL_FIELD(write_flag_p50_ns),
                       SPARKCCL_FIELD(write_flag_p99_ns),
                       SPARKCCL_FIELD(shm_flag_samples),
                       SPARKCCL_FIELD(shm_flag_take_p50_ns),
                       SPARKCCL_FIELD(shm_flag_take_p99_ns),
                       SPARKCCL_FIELD(shm_flag_store_p50_ns),
                       SPARKCCL_FIELD(shm_flag_store_p99_ns),
                       SPARKCCL_FIELD(shm_flag_total_p50_ns),
                       SPARKCCL_FIELD(shm_flag_total_p99_ns),
                       SPARKCCL_FIELD(shm_worker_sleeps));
      });

  sparkccl::bind_verbs(m);
  sparkccl::bind_finalize(m);
  sparkccl::bind_ep_cpu(m);
  sparkccl::bind_cuda_ops(m);
}
