// Stream operations of the CUDA data plane (sparkccl/dataplane/cuda.py), issued without the
// GIL, one driver call each (from Python each costs 5-20 us):
// - OpProgram: one collective shape's copy-engine operations ("ce" mode: copies, 64-bit
//   value writes and waits, kernel launches, event records and waits; 90-120 of them per
//   collective at world 2), issued per call with the call's terms in one native call, a
//   stream's consecutive copies and value operations batched into one driver call each;
// - LaunchPlan: the kernels of one collective shape with their parameters, replayed per call
//   with the call's pointers patched in (sparkccl/dataplane/launch_plan.py), then an event
//   record: the eager fast path.
//
// libcuda is loaded with dlopen on first use (the module is never linked to CUDA: CPU users
// need no driver). The caller's thread must have the device's context current (the Python
// side makes torch's primary context current before it calls).
#include <dlfcn.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using CUresult = int;
using CUstream = void*;
using CUfunction = void*;
using CUevent = void*;
using CUcontext = void*;
constexpr CUresult CUDA_ERROR_NOT_READY = 600;

struct CudaApi {
  CUresult (*memcpy_async)(uint64_t dst, uint64_t src, size_t n, CUstream s) = nullptr;
  CUresult (*write_value64)(CUstream s, uint64_t addr, uint64_t value, unsigned flags) = nullptr;
  CUresult (*wait_value64)(CUstream s, uint64_t addr, uint64_t value, unsigned flags) = nullptr;
  CUresult (*launch)(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                     unsigned by, unsigned bz, unsigned shmem, CUstream s, void** params,
                     void** extra) = nullptr;
  CUresult (*event_record)(CUevent e, CUstream s) = nullptr;
  CUresult (*wait_event)(CUstream s, CUevent e, unsigned flags) = nullptr;
  CUresult (*error_string)(CUresult e, const char** s) = nullptr;
  CUresult (*is_capturing)(CUstream s, int* status) = nullptr;
  CUresult (*ctx_get)(CUcontext* c) = nullptr;
  CUresult (*ctx_push)(CUcontext c) = nullptr;
  CUresult (*ctx_pop)(CUcontext* c) = nullptr;
  CUresult (*event_query)(CUevent e) = nullptr;
  // Optional (null where the driver lacks them: one call per operation then).
  // cuMemcpyBatchAsync as CUDA 13 declares it (_v2), or CUDA 12.8's with failIdx.
  CUresult (*memcpy_batch)(uint64_t* dsts, uint64_t* srcs, size_t* sizes, size_t count,
                           void* attrs, size_t* attr_idx, size_t nattrs, CUstream s) = nullptr;
  CUresult (*memcpy_batch_128)(uint64_t* dsts, uint64_t* srcs, size_t* sizes, size_t count,
                               void* attrs, size_t* attr_idx, size_t nattrs, size_t* fail_idx,
                               CUstream s) = nullptr;
  CUresult (*batch_memop)(CUstream s, unsigned count, void* params, unsigned flags) = nullptr;
  std::string error;
};

template <class F>
bool find(void* lib, F* out, const char* name, const char* fallback = nullptr) {
  void* p = dlsym(lib, name);
  if (!p && fallback) p = dlsym(lib, fallback);
  *out = reinterpret_cast<F>(p);
  return p != nullptr;
}

const CudaApi& api() {
  static CudaApi a;
  static std::once_flag once;
  std::call_once(once, [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      a.error = std::string("cannot load libcuda.so.1: ") + dlerror();
      return;
    }
    // The _v2 / per-version names are what cuda.h maps the plain names to since CUDA 12.
    bool ok = find(lib, &a.memcpy_async, "cuMemcpyAsync") &&
              find(lib, &a.write_value64, "cuStreamWriteValue64_v2", "cuStreamWriteValue64") &&
              find(lib, &a.wait_value64, "cuStreamWaitValue64_v2", "cuStreamWaitValue64") &&
              find(lib, &a.launch, "cuLaunchKernel") &&
              find(lib, &a.event_record, "cuEventRecord") &&
              find(lib, &a.wait_event, "cuStreamWaitEvent") &&
              find(lib, &a.error_string, "cuGetErrorString") &&
              find(lib, &a.is_capturing, "cuStreamIsCapturing") &&
              find(lib, &a.ctx_get, "cuCtxGetCurrent") &&
              find(lib, &a.ctx_push, "cuCtxPushCurrent_v2", "cuCtxPushCurrent") &&
              find(lib, &a.ctx_pop, "cuCtxPopCurrent_v2", "cuCtxPopCurrent") &&
              find(lib, &a.event_query, "cuEventQuery");
    if (!find(lib, &a.memcpy_batch, "cuMemcpyBatchAsync_v2"))
      find(lib, &a.memcpy_batch_128, "cuMemcpyBatchAsync");
    find(lib, &a.batch_memop, "cuStreamBatchMemOp_v2", "cuStreamBatchMemOp");
    if (!ok)
      a.error = "libcuda.so.1 lacks one of cuMemcpyAsync, cuStreamWriteValue64, "
                "cuStreamWaitValue64, cuLaunchKernel, cuEventRecord, cuStreamWaitEvent, "
                "cuStreamIsCapturing, cuCtxGetCurrent, cuCtxPushCurrent, cuCtxPopCurrent, "
                "cuEventQuery";
  });
  if (!a.error.empty()) throw std::runtime_error("sparkccl: " + a.error);
  return a;
}

[[noreturn]] void fail(const CudaApi& cu, const std::string& what, CUresult r) {
  const char* text = nullptr;
  cu.error_string(r, &text);
  throw std::runtime_error("sparkccl: " + what + " failed: " +
                           (text ? text : ("CUresult " + std::to_string(r))));
}

// Is stream s being captured into a CUDA graph? (The caller holds the context current: the
// legacy stream is that context's.) Raises the CUDA error otherwise.
bool capturing(const CudaApi& cu, CUstream s) {
  int capture = 0;
  CUresult r = cu.is_capturing(s, &capture);
  if (r != 0) fail(cu, "cuStreamIsCapturing", r);
  return capture != 0;
}

// Operation kinds of the flat op list: 5 words per op (kind, stream, a, b, c).
enum : uint64_t {
  OP_COPY = 0, OP_WRITE64 = 1, OP_LAUNCH = 2, OP_RECORD = 3, OP_WAIT_EVENT = 4, OP_WAIT_VALUE = 5
};
constexpr unsigned WAIT_VALUE_GEQ = 0;  // CU_STREAM_WAIT_VALUE_GEQ: (int64_t)(*addr - value) >= 0
constexpr size_t OP_WORDS = 5;

// cuda.h's types of the batched calls, as far as they are used here.
struct MemLocation { int type, id; };
struct MemcpyAttributes {  // CUmemcpyAttributes
  int src_access_order;     // CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: the source read in stream order
  MemLocation src_hint, dst_hint;
  unsigned flags;
};
constexpr int SRC_ACCESS_ORDER_STREAM = 1;
union MemOp {  // CUstreamBatchMemOpParams: wait and write share the layout
  struct {
    unsigned operation;  // CU_STREAM_MEM_OP_WAIT_VALUE_64 4, CU_STREAM_MEM_OP_WRITE_VALUE_64 5
    uint64_t address;
    uint64_t value;
    unsigned flags;      // as cuStreamWaitValue64's / cuStreamWriteValue64's
    uint64_t alias;
  } value;
  uint64_t pad[6];
};
static_assert(sizeof(MemOp) == 48 && sizeof(MemcpyAttributes) == 24, "cuda.h layout");
constexpr unsigned MEMOP_WAIT_VALUE_64 = 4, MEMOP_WRITE_VALUE_64 = 5;
constexpr size_t MAX_MEMOPS = 255;  // cuStreamBatchMemOp: "count must be less than 256"

// How issue() groups operations into driver calls: a run of consecutive operations of one
// stream that one call can take. Copies go to cuMemcpyBatchAsync, except on the legacy NULL
// stream (0 or CU_STREAM_LEGACY 1), which it refuses; value writes and waits, mixed, to
// cuStreamBatchMemOp, which enqueues them in their order. Copies in one batch may run in
// any order among themselves, which the program allows: no copy of a run reads what another
// writes (a run is the copies between two value operations or launches of a stream).
enum : uint64_t { CALL_ONE = 0, CALL_COPIES = 1, CALL_MEMOPS = 2 };
struct Call { size_t first, count; uint64_t how; };

std::vector<Call> group(const std::vector<uint64_t>& ops, bool copies, bool memops) {
  std::vector<Call> calls;
  const size_t n = ops.size() / OP_WORDS;
  for (size_t i = 0; i < n;) {
    const uint64_t kind = ops[i * OP_WORDS], st = ops[i * OP_WORDS + 1];
    const bool memop = kind == OP_WRITE64 || kind == OP_WAIT_VALUE;
    uint64_t how = CALL_ONE;
    if (kind == OP_COPY && copies && st > 1) how = CALL_COPIES;
    if (memop && memops) how = CALL_MEMOPS;
    size_t j = i + 1;
    if (how != CALL_ONE)
      while (j < n && ops[j * OP_WORDS + 1] == st && (how == CALL_COPIES
                 ? ops[j * OP_WORDS] == OP_COPY
                 : (ops[j * OP_WORDS] == OP_WRITE64 || ops[j * OP_WORDS] == OP_WAIT_VALUE) &&
                       j - i < MAX_MEMOPS))
        ++j;
    if (j - i == 1) how = CALL_ONE;
    calls.push_back({i, j - i, how});
    i = j;
  }
  return calls;
}

std::string describe(uint64_t kind) {
  switch (kind) {
    case OP_COPY: return "cuMemcpyAsync";
    case OP_WRITE64: return "cuStreamWriteValue64";
    case OP_LAUNCH: return "cuLaunchKernel";
    case OP_RECORD: return "cuEventRecord";
    case OP_WAIT_EVENT: return "cuStreamWaitEvent";
    case OP_WAIT_VALUE: return "cuStreamWaitValue64";
    default: return "operation " + std::to_string(kind);
  }
}

// Pushes a context for the scope where another one is current (torch's notion of the
// current device stays as it was).
class ContextScope {
 public:
  ContextScope(const CudaApi& cu, CUcontext ctx) : cu_(cu) {
    CUcontext cur = nullptr;
    CUresult r = cu.ctx_get(&cur);
    if (r != 0) fail(cu, "cuCtxGetCurrent", r);
    if (cur != ctx) {
      if ((r = cu.ctx_push(ctx)) != 0) fail(cu, "cuCtxPushCurrent", r);
      pushed_ = true;
    }
  }
  ~ContextScope() {
    CUcontext c;
    if (pushed_) cu_.ctx_pop(&c);
  }
  ContextScope(const ContextScope&) = delete;
  ContextScope& operator=(const ContextScope&) = delete;

 private:
  const CudaApi& cu_;
  bool pushed_ = false;
};

// One collective's copy-engine operations as a program ("ce" mode; 90-120 operations at
// world 2), built once per collective shape and issued per call with that call's terms:
// seq's flag and progress values, ring entries, slots, pointers, streams. Each row is
// (kind, stream term, a: add + mult * terms[t], b: likewise, c); kernel parameters are
// constants or patched alike. The operations: OP_COPY (dst a, src b, bytes c), OP_WRITE64
// (address a, value b), OP_LAUNCH (kernel a of the table, first parameter b, c blocks),
// OP_RECORD (event a recorded on the stream), OP_WAIT_EVENT (the stream waits for event
// a), OP_WAIT_VALUE (the stream waits until the 64-bit word at address a reaches value b).
class OpProgram {
 public:
  static constexpr size_t ROW_WORDS = 9;
  using KernelRow = std::tuple<uint64_t, unsigned, std::vector<uint64_t>>;
  using Patch = std::tuple<size_t, size_t, size_t, uint64_t, uint64_t>;

  OpProgram(uint64_t context, size_t terms, const std::vector<KernelRow>& kernels,
            const std::vector<Patch>& patches, const std::vector<uint64_t>& rows)
      : ctx_(reinterpret_cast<CUcontext>(static_cast<uintptr_t>(context))), terms_(terms),
        rows_(rows) {
    if (!ctx_ || !terms_) throw std::invalid_argument("OpProgram: needs a context and terms");
    for (const auto& [fn, block, params] : kernels) {
      if (!fn || !block || block > 1024 || params.empty())
        throw std::invalid_argument("OpProgram: a kernel needs a function, 1..1024 threads per "
                                    "block and at least one parameter");
      kernels_.push_back({fn, block, params, {}});
    }
    for (const auto& [k, p, t, mult, add] : patches) {
      if (k >= kernels_.size() || p == 0 || p >= kernels_[k].params.size() || t >= terms_)
        throw std::invalid_argument("OpProgram: patch (" + std::to_string(k) + ", " +
                                    std::to_string(p) + ", " + std::to_string(t) +
                                    ") names no parameter after the first, or no term");
      patches_.push_back({k, p, t, mult, add});
    }
    // Refuse a bad program before anything is issued (a half-issued collective would hang
    // peers): what does not depend on the terms here, the rest in evaluate().
    if (rows_.empty() || rows_.size() % ROW_WORDS)
      throw std::invalid_argument("OpProgram: rows is not a list of 9-word operations");
    for (size_t k = 0; k < rows_.size(); k += ROW_WORDS) {
      const uint64_t* r = &rows_[k];
      const std::string at = "OpProgram: operation " + std::to_string(k / ROW_WORDS);
      if (r[0] > OP_WAIT_VALUE)
        throw std::invalid_argument(at + ": unknown kind " + std::to_string(r[0]));
      if (r[1] >= terms_ || r[3] >= terms_ || r[6] >= terms_)
        throw std::invalid_argument(at + " names no term");
      if (r[0] == OP_LAUNCH &&
          (r[3] != 0 || r[2] >= kernels_.size() || r[8] == 0 || r[8] > 0x7FFFFFFFu))
        throw std::invalid_argument(at + " launches no kernel of the program or no blocks");
      if ((r[0] == OP_RECORD || r[0] == OP_WAIT_EVENT) && (r[3] != 0 || r[2] == 0))
        throw std::invalid_argument(at + " names no event");
    }
    for (auto& kern : kernels_)  // (the pointer arrays last: params no longer moves)
      for (auto& v : kern.params) kern.ptrs.push_back(&v);
  }

  // The operations with these terms, 5 words each (kind, stream, a, b, c): what issue()
  // issues (the CPU emulation in tests/ runs them).
  std::vector<uint64_t> evaluate(const std::vector<uint64_t>& terms) const {
    if (terms.size() != terms_)
      throw std::invalid_argument("OpProgram: " + std::to_string(terms.size()) + " terms, not " +
                                  std::to_string(terms_));
    std::vector<uint64_t> ops;
    ops.reserve(rows_.size() / ROW_WORDS * OP_WORDS);
    for (size_t k = 0; k < rows_.size(); k += ROW_WORDS) {
      const uint64_t* r = &rows_[k];
      const uint64_t a = r[2] + r[4] * terms[r[3]], b = r[5] + r[7] * terms[r[6]];
      if (r[0] == OP_WAIT_VALUE && (!a || a % 8))
        throw std::invalid_argument("OpProgram: value wait " + std::to_string(k / ROW_WORDS) +
                                    " names no aligned 64-bit word");
      const uint64_t op[OP_WORDS] = {r[0], terms[r[1]], a, b, r[8]};
      ops.insert(ops.end(), op, op + OP_WORDS);
    }
    return ops;
  }

  // Every kernel's parameters with these terms (the first, the unit, as built).
  std::vector<std::vector<uint64_t>> parameters(const std::vector<uint64_t>& terms) {
    std::lock_guard<std::mutex> hold(mu_);
    patch(terms);
    std::vector<std::vector<uint64_t>> out;
    for (const auto& kern : kernels_) out.push_back(kern.params);
    return out;
  }

  // The driver calls issue() makes with these terms: (first operation, operations, how:
  // CALL_ONE, CALL_COPIES, CALL_MEMOPS), where the driver has the batched calls.
  std::vector<std::tuple<size_t, size_t, uint64_t>> calls(const std::vector<uint64_t>& terms) {
    std::vector<std::tuple<size_t, size_t, uint64_t>> out;
    for (const Call& c : group(evaluate(terms), true, true))
      out.emplace_back(c.first, c.count, c.how);
    return out;
  }

  void issue(const std::vector<uint64_t>& terms) {
    const std::vector<uint64_t> ops = evaluate(terms);
    const CudaApi& cu = api();
    nb::gil_scoped_release nogil;
    std::lock_guard<std::mutex> hold(mu_);  // params are patched in place
    ContextScope in(cu, ctx_);
    patch(terms);
    const bool copies = cu.memcpy_batch || cu.memcpy_batch_128;
    for (const Call& call : group(ops, copies, cu.batch_memop != nullptr)) {
      if (call.how == CALL_ONE) {
        one(cu, ops, call.first);
        continue;
      }
      const uint64_t stream = ops[call.first * OP_WORDS + 1];
      CUstream s = reinterpret_cast<CUstream>(static_cast<uintptr_t>(stream));
      CUresult r;
      const char* what;
      if (call.how == CALL_COPIES) {
        dsts_.resize(call.count);
        srcs_.resize(call.count);
        sizes_.resize(call.count);
        for (size_t i = 0; i < call.count; ++i) {
          const uint64_t* op = &ops[(call.first + i) * OP_WORDS];
          dsts_[i] = op[2];
          srcs_[i] = op[3];
          sizes_[i] = static_cast<size_t>(op[4]);
        }
        MemcpyAttributes attr = {SRC_ACCESS_ORDER_STREAM, {0, 0}, {0, 0}, 0};
        size_t attr_idx = 0, fail_idx = 0;
        r = cu.memcpy_batch ? cu.memcpy_batch(dsts_.data(), srcs_.data(), sizes_.data(),
                                              call.count, &attr, &attr_idx, 1, s)
                            : cu.memcpy_batch_128(dsts_.data(), srcs_.data(), sizes_.data(),
                                                  call.count, &attr, &attr_idx, 1, &fail_idx, s);
        what = "cuMemcpyBatchAsync";
      } else {
        memops_.assign(call.count, MemOp{});
        for (size_t i = 0; i < call.count; ++i) {
          const uint64_t* op = &ops[(call.first + i) * OP_WORDS];
          auto& v = memops_[i].value;
          v.operation = op[0] == OP_WRITE64 ? MEMOP_WRITE_VALUE_64 : MEMOP_WAIT_VALUE_64;
          v.address = op[2];
          v.value = op[3];
          v.flags = op[0] == OP_WRITE64 ? 0 : WAIT_VALUE_GEQ;  // writes: with the fence
        }
        r = cu.batch_memop(s, static_cast<unsigned>(call.count), memops_.data(), 0);
        what = "cuStreamBatchMemOp";
      }
      if (r != 0)
        fail(cu, std::string(what) + " (operations " + std::to_string(call.first) + ".." +
                     std::to_string(call.first + call.count - 1) + ")", r);
    }
  }

  size_t operations() const { return rows_.size() / ROW_WORDS; }

 private:
  struct Kernel {
    uint64_t fn;
    unsigned block;
    std::vector<uint64_t> params;
    std::vector<void*> ptrs;
  };
  // Operation `index` of ops, in a driver call of its own.
  void one(const CudaApi& cu, const std::vector<uint64_t>& ops, size_t index) {
    const uint64_t* op = &ops[index * OP_WORDS];
    const uint64_t kind = op[0], a = op[2], b = op[3], c = op[4];
    CUstream s = reinterpret_cast<CUstream>(static_cast<uintptr_t>(op[1]));
    CUresult r = 1;
    if (kind == OP_COPY) {
      r = cu.memcpy_async(a, b, static_cast<size_t>(c), s);
    } else if (kind == OP_WRITE64) {
      r = cu.write_value64(s, a, b, 0);  // 0: with the fence before the write
    } else if (kind == OP_RECORD) {
      r = cu.event_record(reinterpret_cast<CUevent>(static_cast<uintptr_t>(a)), s);
    } else if (kind == OP_WAIT_EVENT) {
      r = cu.wait_event(s, reinterpret_cast<CUevent>(static_cast<uintptr_t>(a)), 0);
    } else if (kind == OP_WAIT_VALUE) {
      r = cu.wait_value64(s, a, b, WAIT_VALUE_GEQ);
    } else {  // OP_LAUNCH (checked when built); the driver copies the parameters at launch
      Kernel& kern = kernels_[a];
      kern.params[0] = b;
      r = cu.launch(reinterpret_cast<CUfunction>(static_cast<uintptr_t>(kern.fn)),
                    static_cast<unsigned>(c), 1, 1, kern.block, 1, 1, 0, s, kern.ptrs.data(),
                    nullptr);
    }
    if (r != 0) fail(cu, describe(kind) + " (operation " + std::to_string(index) + ")", r);
  }
  void patch(const std::vector<uint64_t>& terms) {
    for (const auto& [k, p, t, mult, add] : patches_) kernels_[k].params[p] = add + mult * terms[t];
  }
  CUcontext ctx_;
  size_t terms_;
  std::vector<uint64_t> rows_;
  std::vector<Kernel> kernels_;
  std::vector<Patch> patches_;
  std::vector<uint64_t> dsts_, srcs_;  // a batch's arrays (issue() holds mu_)
  std::vector<size_t> sizes_;
  std::vector<MemOp> memops_;
  std::mutex mu_;
};

// The kernels of one collective shape (sparkccl/dataplane/launch_plan.py): per launch a
// function, grid and block and its parameter buffer as 64-bit words, either one word per
// parameter or (by_value) the bytes of the kernel's one parameter, a protocol.h kargs struct
// of u64 fields; `patches` (launch, byte offset in the buffer, call argument, addend) set a
// word to one of the call's pointers (at most ARGS) plus a constant: a struct's field at its
// offset (protocol.h *_ constants), or a positional parameter (offset 8 * its index).
// The driver copies the parameters when a launch is enqueued, so the buffers are patched in
// place per call (under mu_) and a captured graph keeps what it captured.
// issue() launches them in order on the stream and records `event` after them, in the
// context the plan was made for (pushed only when another one is current: torch's notion of
// the current device stays as it was).
class LaunchPlan {
 public:
  static constexpr size_t ARGS = 6;
  using KernelRow = std::tuple<uint64_t, unsigned, unsigned, std::vector<uint64_t>, bool>;
  using Patch = std::tuple<size_t, size_t, size_t, uint64_t>;

  LaunchPlan(uint64_t context, uint64_t event, const std::vector<KernelRow>& kernels,
             const std::vector<Patch>& patches)
      : ctx_(reinterpret_cast<CUcontext>(static_cast<uintptr_t>(context))),
        event_(reinterpret_cast<CUevent>(static_cast<uintptr_t>(event))) {
    if (!ctx_ || !event_) throw std::invalid_argument("LaunchPlan: needs a context and an event");
    if (kernels.empty()) throw std::invalid_argument("LaunchPlan: no kernels");
    for (const auto& [fn, grid, block, params, by_value] : kernels) {
      if (!fn || !grid || !block || grid > 0x7FFFFFFFu || block > 1024)
        throw std::invalid_argument("LaunchPlan: a launch needs a function, 1..2^31-1 blocks "
                                    "and 1..1024 threads per block");
      if (by_value && params.empty())
        throw std::invalid_argument("LaunchPlan: a struct parameter of no bytes");
      launches_.push_back({reinterpret_cast<CUfunction>(static_cast<uintptr_t>(fn)), grid, block,
                           params, {}, by_value});
    }
    for (const auto& [l, at, arg, add] : patches) {
      if (l >= launches_.size() || at % 8 || at / 8 >= launches_[l].params.size() || arg >= ARGS)
        throw std::invalid_argument("LaunchPlan: patch (" + std::to_string(l) + ", " +
                                    std::to_string(at) + ", " + std::to_string(arg) +
                                    ") names no 64-bit word of a launch's parameters or no "
                                    "call argument");
      patches_.push_back({l, at / 8, arg, add});
    }
    // The pointer arrays last: params no longer moves. (cuLaunchKernel reads one pointer per
    // kernel parameter: a struct's bytes are all behind its one.)
    for (auto& ln : launches_)
      for (auto& v : ln.params) {
        ln.ptrs.push_back(&v);
        if (ln.by_value) break;
      }
  }

  // False, issuing nothing: the stream is being captured (the caller takes its capture path).
  bool issue(uint64_t stream, uint64_t a0, uint64_t a1, uint64_t a2, uint64_t a3, uint64_t a4,
             uint64_t a5) {
    const CudaApi& cu = api();
    CUstream s = reinterpret_cast<CUstream>(static_cast<uintptr_t>(stream));
    const uint64_t args[ARGS] = {a0, a1, a2, a3, a4, a5};
    nb::gil_scoped_release nogil;
    std::lock_guard<std::mutex> hold(mu_);  // params are patched in place
    ContextScope in(cu, ctx_);
    if (capturing(cu, s)) return false;
    for (const auto& [l, word, arg, add] : patches_) launches_[l].params[word] = args[arg] + add;
    CUresult r;
    for (size_t i = 0; i < launches_.size(); ++i) {
      Launch& ln = launches_[i];
      r = cu.launch(ln.fn, ln.grid, 1, 1, ln.block, 1, 1, 0, s, ln.ptrs.data(), nullptr);
      if (r != 0) fail(cu, "cuLaunchKernel (launch " + std::to_string(i) + " of a launch plan)", r);
    }
    if ((r = cu.event_record(event_, s)) != 0) fail(cu, "cuEventRecord", r);
    return true;
  }

  size_t launches() const { return launches_.size(); }

 private:
  struct Launch {
    CUfunction fn;
    unsigned grid, block;
    std::vector<uint64_t> params;
    std::vector<void*> ptrs;
    bool by_value;
  };
  CUcontext ctx_;
  CUevent event_;
  std::vector<Launch> launches_;
  std::vector<Patch> patches_;
  std::mutex mu_;
};

// Has the GPU passed the event? Raises the CUDA error of a lost context.
bool event_query(uint64_t event) {
  const CudaApi& cu = api();
  CUresult r;
  {
    nb::gil_scoped_release nogil;
    r = cu.event_query(reinterpret_cast<CUevent>(static_cast<uintptr_t>(event)));
  }
  if (r == 0) return true;
  if (r == CUDA_ERROR_NOT_READY) return false;
  fail(cu, "cuEventQuery", r);
}

// capturing() for Python, in the context given (the legacy stream is that context's).
bool stream_capturing(uint64_t context, uint64_t stream) {
  const CudaApi& cu = api();
  nb::gil_scoped_release nogil;
  ContextScope in(cu, reinterpret_cast<CUcontext>(static_cast<uintptr_t>(context)));
  return capturing(cu, reinterpret_cast<CUstream>(static_cast<uintptr_t>(stream)));
}

}  // namespace

namespace sparkccl {
void bind_cuda_ops(nb::module_& m) {
  nb::class_<OpProgram>(m, "OpProgram")
      .def(nb::init<uint64_t, size_t, const std::vector<OpProgram::KernelRow>&,
                    const std::vector<OpProgram::Patch>&, const std::vector<uint64_t>&>(),
           "context"_a, "terms"_a, "kernels"_a, "patches"_a, "rows"_a)
      .def("issue", &OpProgram::issue, "terms"_a,
           "Issue the operations with these terms (see native/src/cuda_ops.cpp).")
      .def("evaluate", &OpProgram::evaluate, "terms"_a,
           "The operations with these terms, 5 words each (kind, stream, a, b, c).")
      .def("parameters", &OpProgram::parameters, "terms"_a,
           "Every kernel's parameters with these terms.")
      .def("calls", &OpProgram::calls, "terms"_a,
           "The driver calls issue() makes with these terms: (first operation, operations, "
           "how: 0 one call, 1 cuMemcpyBatchAsync, 2 cuStreamBatchMemOp).")
      .def_prop_ro("operations", &OpProgram::operations);
  nb::class_<LaunchPlan>(m, "LaunchPlan")
      .def(nb::init<uint64_t, uint64_t, const std::vector<LaunchPlan::KernelRow>&,
                    const std::vector<LaunchPlan::Patch>&>(),
           "context"_a, "event"_a, "kernels"_a, "patches"_a)
      .def("issue", &LaunchPlan::issue, "stream"_a, "a0"_a, "a1"_a = 0, "a2"_a = 0, "a3"_a = 0,
           "a4"_a = 0, "a5"_a = 0,
           "Launch the plan's kernels with the call's pointers and record its event; False "
           "(nothing issued) while the stream is being captured.")
      .def_prop_ro("launches", &LaunchPlan::launches);
  m.def("cuda_stream_capturing", &stream_capturing, "context"_a, "stream"_a,
        "cuStreamIsCapturing: is the stream being captured into a CUDA graph?");
  m.def("cuda_event_query", &event_query, "event"_a,
        "cuEventQuery: True once the GPU passed the event, False before; raises otherwise.");
}
}  // namespace sparkccl
