// The varlen backend's cuDNN graphs (see mla_cudnn_varlen.h): graph construction through the cuDNN
// frontend, the plan cache, execution. Host code only; the one translation unit that includes the
// frontend's headers (their compile is slow, so nothing else does).
//
// Libraries: the frontend runs in its dynamic-loading mode, so this module has no link-time
// dependency on cuDNN (or on NVRTC, which parts of the frontend use): libcudnn.so.<major> is
// dlopen'ed on the first varlen call (torch has loaded it already: its CUDA wheels depend on
// nvidia-cudnn-cu*), and a build of verl_ops without a loadable cuDNN still imports.
// Handles: the stable ABI does not reach torch's cuDNN handle, so the module keeps its own, one per
// thread and device at a time: a thread takes one from a per-device pool on its first call there
// and gives it back when it exits, so a program that keeps starting threads reuses a few handles
// (and the plans built with them) instead of creating one per thread. Handles are never
// destroyed (cudnnDestroy synchronises the device). Their stream is set to the caller's on every
// call.
// Plans: one per (handle, bucket), built on the first call of a bucket, kept in a cache of at most
// `capacity` plans (least recently used first out; VERL_OPS_MLA_PLAN_CACHE_SIZE, default 256,
// 0 = no limit; plans used inside a CUDA-graph capture are never evicted, the graph may replay
// them). Building is slow (heuristics, plan compilation) and cannot be captured in a CUDA graph;
// executing is one cuDNN launch sequence and can. A bucket whose build failed is remembered: later
// calls of it raise the same error at once instead of building again.
#include "mla_cudnn_varlen.h"

#define NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING 1
#include <cudnn.h>
#include <cudnn_frontend.h>
#include <dlfcn.h>

#include <cstdlib>

#include <atomic>
#include <cstring>
#include <exception>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#if CUDNN_FRONTEND_VERSION < 13200
#error "the varlen backend of mla_forward_padded needs cuDNN frontend >= 1.32 (pip install nvidia-cudnn-frontend)"
#endif

namespace fe = cudnn_frontend;

// The dynamic-loading mode's library handle (declared by the frontend, defined by its user).
namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;
}  // namespace cudnn_frontend

namespace verl_ops {
namespace cuda {

struct VarlenPlan {
  std::shared_ptr<fe::graph::Graph> graph;
  cudnnHandle_t handle = nullptr;
  int64_t workspace = 0;
  bool backward = false;
  bool pinned = false;  // used inside a CUDA-graph capture: never evicted (guarded by the cache mutex)
};

namespace {

// Tensor ids of the graphs (the variant pack's keys).
enum Uid : int64_t {
  kQ = 1,
  kK,
  kV,
  kO,
  kStats,
  kSeqLenQ,
  kSeqLenKv,
  kOffsetQ,
  kOffsetK,
  kOffsetV,
  kOffsetO,
  kOffsetStats,
  kGradO,
  kGradQ,
  kGradK,
  kGradV,
};

template <typename... Args>
[[noreturn]] void fail(const char* op, const Args&... args) {
  std::ostringstream os;
  os << op << ": ";
  ((os << args), ...);
  throw std::runtime_error(os.str());
}

struct Key {
  VarlenProblem p;
  cudnnHandle_t handle;
  float scale;  // the graph's attention scale (a float constant of the graph)

  bool operator==(const Key& o) const {
    return handle == o.handle && p.device == o.p.device && p.dtype == o.p.dtype &&
           p.backward == o.p.backward && p.causal == o.p.causal &&
           p.bottom_right == o.p.bottom_right && p.batch == o.p.batch && p.hq == o.p.hq &&
           p.hk == o.p.hk && p.dqk == o.p.dqk && p.dv == o.p.dv &&
           p.max_seqlen_q == o.p.max_seqlen_q && p.max_seqlen_kv == o.p.max_seqlen_kv &&
           p.total_q == o.p.total_q && p.total_kv == o.p.total_kv &&
           std::memcmp(&scale, &o.scale, sizeof(float)) == 0;
  }
};

struct KeyHash {
  size_t operator()(const Key& k) const {
    uint32_t scale_bits = 0;
    std::memcpy(&scale_bits, &k.scale, sizeof(scale_bits));
    size_t h = std::hash<const void*>()(static_cast<const void*>(k.handle));
    auto mix = [&h](int64_t v) {
      h ^= std::hash<int64_t>()(v) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
    };
    const VarlenProblem& p = k.p;
    mix(p.device);
    mix(static_cast<int64_t>(p.dtype));
    mix((p.backward ? 1 : 0) | (p.causal ? 2 : 0) | (p.bottom_right ? 4 : 0));
    for (int64_t v : {p.batch, p.hq, p.hk, p.dqk, p.dv, p.max_seqlen_q, p.max_seqlen_kv,
                      p.total_q, p.total_kv}) {
      mix(v);
    }
    mix(scale_bits);
    return h;
  }
};

int64_t default_capacity() {
  const char* env = std::getenv("VERL_OPS_MLA_PLAN_CACHE_SIZE");
  if (env == nullptr || *env == '\0') return 256;
  char* end = nullptr;
  const long long v = std::strtoll(env, &end, 10);
  return (end != nullptr && *end == '\0' && v >= 0) ? static_cast<int64_t>(v) : 256;
}

// Process-lifetime state (never destroyed: plans must not be torn down after cuDNN or the CUDA
// runtime at exit). `plans` maps a key to its plan and its place in `order` (most recently used
// first); `failed` remembers the error of every bucket whose build failed (keyed without handle).
struct Cache {
  using Order = std::list<Key>;
  struct Entry {
    std::shared_ptr<VarlenPlan> plan;
    Order::iterator where;
  };
  std::mutex mutex;
  std::unordered_map<Key, Entry, KeyHash> plans;
  Order order;
  std::unordered_map<Key, std::string, KeyHash> failed;
  int64_t capacity = default_capacity();
  std::atomic<int64_t> hits{0}, misses{0}, builds{0}, failures{0}, evictions{0};

  // Drops least recently used plans (not pinned ones) until at most `capacity` remain; called with
  // the mutex held. A caller still running an evicted plan holds its own reference.
  void trim() {
    if (capacity <= 0 || order.empty()) return;
    auto it = order.end();
    const auto newest = order.begin();  // the plan just used is never the one to go
    while (static_cast<int64_t>(plans.size()) > capacity && it != std::next(newest)) {
      --it;
      const auto found = plans.find(*it);
      if (found->second.plan->pinned) continue;
      plans.erase(found);
      it = order.erase(it);
      evictions.fetch_add(1, std::memory_order_relaxed);
    }
  }
};

Cache& cache() {
  static Cache* c = new Cache();
  return *c;
}

// Free handles per device (process lifetime, never destroyed).
struct HandlePool {
  std::mutex mutex;
  std::unordered_map<int, std::vector<cudnnHandle_t>> free;
};

HandlePool& handle_pool() {
  static HandlePool* p = new HandlePool();
  return *p;
}

// The handles a thread holds, one per device, given back to the pool when the thread exits.
struct ThreadHandles {
  std::unordered_map<int, cudnnHandle_t> held;
  ~ThreadHandles() {
    if (held.empty()) return;
    HandlePool& pool = handle_pool();
    std::lock_guard<std::mutex> lock(pool.mutex);
    for (const auto& [device, h] : held) pool.free[device].push_back(h);
  }
};

// The frontend dlopens the CUDA runtime, choosing among the versions it finds by name; it is
// pointed at the runtime this module is linked against (the one torch uses), unless
// CUDNN_FRONTEND_CUDART_LIB_NAME is set already. Set when the module loads (import), not on a
// first call that may run beside other threads reading the environment.
[[maybe_unused]] const bool kCudartNamed = [] {
  Dl_info info{};
  if (std::getenv("CUDNN_FRONTEND_CUDART_LIB_NAME") == nullptr &&
      dladdr(reinterpret_cast<void*>(&cudaGetDevice), &info) != 0 && info.dli_fname != nullptr) {
    return setenv("CUDNN_FRONTEND_CUDART_LIB_NAME", info.dli_fname, 0) == 0;
  }
  return false;
}();

// Opens cuDNN once per process (before any frontend call: the frontend resolves each cuDNN symbol
// once, on its first use). Returns the error text, empty when cuDNN is loaded.
const std::string& cudnn_load_error() {
  static std::once_flag once;
  static std::string* error = new std::string();
  std::call_once(once, [] {
    const std::string name = "libcudnn.so." + std::to_string(CUDNN_MAJOR);
    void* h = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) {
      const char* why = dlerror();
      *error = name + ": " + (why != nullptr ? why : "not found");
      return;
    }
    fe::cudnn_dlhandle = h;
  });
  return *error;
}

void load_cudnn(const char* op) {
  const std::string& error = cudnn_load_error();
  if (fe::cudnn_dlhandle == nullptr) {
    fail(op, "backend='varlen' could not load cuDNN (", error,
         "); torch's CUDA wheels install it (the nvidia-cudnn package of their CUDA major), or "
         "put its lib directory on LD_LIBRARY_PATH");
  }
}

bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    cudaGetLastError();  // a query error is not ours to keep
    return false;
  }
  return status != cudaStreamCaptureStatusNone;
}

// The calling thread's handle on `device` (the current device): the one it holds, else one from
// the pool or a new one when `create` is set (else null).
cudnnHandle_t thread_handle(const char* op, int device, bool create) {
  thread_local ThreadHandles handles;
  const auto it = handles.held.find(device);
  if (it != handles.held.end()) return it->second;
  if (!create) return nullptr;
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess || current != device) {
    cudaGetLastError();
    fail(op, "internal: the current CUDA device (", current, ") is not the tensors' device (",
         device, ")");
  }
  cudnnHandle_t h = nullptr;
  {
    HandlePool& pool = handle_pool();
    std::lock_guard<std::mutex> lock(pool.mutex);
    auto& free = pool.free[device];
    if (!free.empty()) {
      h = free.back();
      free.pop_back();
    }
  }
  if (h == nullptr) {
    const cudnnStatus_t st = fe::detail::create_handle(&h);
    if (st != CUDNN_STATUS_SUCCESS) {
      fail(op, "cudnnCreate failed for the varlen backend: ", fe::detail::get_error_string(st));
    }
  }
  handles.held.emplace(device, h);
  return h;
}

void check(const char* op, const char* what, fe::error_t err) {
  if (err.is_bad()) {
    fail(op, "cuDNN ", what, " failed for the varlen backend: ", err.get_message());
  }
}

fe::DataType_t io_type(VarlenDtype d) {
  return d == VarlenDtype::kHalf ? fe::DataType_t::HALF : fe::DataType_t::BFLOAT16;
}

using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

// [b, h, s, d] logical tensor over THD rows: token-major strides (s: h * d, h: d), the batch
// start given by a ragged element offset (its batch stride is then not used).
fe::graph::Tensor_attributes& thd_layout(fe::graph::Tensor_attributes& t, int64_t b, int64_t h,
                                         int64_t s, int64_t d, const TensorPtr& offset) {
  return t.set_dim({b, h, s, d}).set_stride({s * h * d, d, h * d, 1}).set_ragged_offset(offset);
}

TensorPtr thd_input(fe::graph::Graph& g, const char* name, Uid uid, fe::DataType_t type, int64_t b,
                    int64_t h, int64_t s, int64_t d, const TensorPtr& offset) {
  fe::graph::Tensor_attributes t;
  t.set_name(name).set_uid(uid).set_data_type(type);
  thd_layout(t, b, h, s, d, offset);
  return g.tensor(t);
}

// The [T, H] float32 log-sum-exp as [b, h, s, 1] (s: h, h: 1).
fe::graph::Tensor_attributes& stats_layout(fe::graph::Tensor_attributes& t, int64_t b, int64_t h,
                                           int64_t s, const TensorPtr& offset) {
  return t.set_dim({b, h, s, 1})
      .set_stride({s * h, 1, h, 1})
      .set_data_type(fe::DataType_t::FLOAT)
      .set_ragged_offset(offset);
}

TensorPtr index_tensor(fe::graph::Graph& g, const char* name, Uid uid, int64_t n,
                       fe::DataType_t type) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim({n, 1, 1, 1})
                      .set_stride({1, 1, 1, 1})
                      .set_data_type(type));
}

// Inputs shared by the forward and backward graphs.
struct Common {
  TensorPtr seq_len_q, seq_len_kv, offset_q, offset_k, offset_v, offset_o, offset_stats;
  TensorPtr q, k, v;
};

Common common_inputs(fe::graph::Graph& g, const VarlenProblem& p) {
  const fe::DataType_t io = io_type(p.dtype);
  Common c;
  c.seq_len_q = index_tensor(g, "seq_len_q", kSeqLenQ, p.batch, fe::DataType_t::INT32);
  c.seq_len_kv = index_tensor(g, "seq_len_kv", kSeqLenKv, p.batch, fe::DataType_t::INT32);
  c.offset_q = index_tensor(g, "offset_q", kOffsetQ, p.batch + 1, fe::DataType_t::INT64);
  c.offset_k = index_tensor(g, "offset_k", kOffsetK, p.batch + 1, fe::DataType_t::INT64);
  c.offset_v = index_tensor(g, "offset_v", kOffsetV, p.batch + 1, fe::DataType_t::INT64);
  c.offset_o = index_tensor(g, "offset_o", kOffsetO, p.batch + 1, fe::DataType_t::INT64);
  c.offset_stats = index_tensor(g, "offset_stats", kOffsetStats, p.batch + 1, fe::DataType_t::INT64);
  c.q = thd_input(g, "q", kQ, io, p.batch, p.hq, p.max_seqlen_q, p.dqk, c.offset_q);
  c.k = thd_input(g, "k", kK, io, p.batch, p.hk, p.max_seqlen_kv, p.dqk, c.offset_k);
  c.v = thd_input(g, "v", kV, io, p.batch, p.hk, p.max_seqlen_kv, p.dv, c.offset_v);
  return c;
}

// Masks: the padding mask from the per-sequence lengths, and for causal attention the diagonal
// band's right bound 0 at the top-left (q and kv share their offsets, so every sequence has
// lq == lk) or bottom-right corner (query i of lq sees keys j <= i + lk - lq).
template <typename Attributes>
void set_masks(Attributes& a, const VarlenProblem& p, const Common& c) {
  a.set_padding_mask(true).set_seq_len_q(c.seq_len_q).set_seq_len_kv(c.seq_len_kv);
  if (p.causal) {
    a.set_diagonal_alignment(p.bottom_right ? fe::DiagonalAlignment_t::BOTTOM_RIGHT
                                            : fe::DiagonalAlignment_t::TOP_LEFT)
        .set_diagonal_band_right_bound(0);
  }
}

std::shared_ptr<fe::graph::Graph> new_graph(const VarlenProblem& p) {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(io_type(p.dtype))
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return g;
}

std::shared_ptr<fe::graph::Graph> forward_graph(const VarlenProblem& p, float scale,
                                                fe::AttentionImplementation_t impl) {
  auto g = new_graph(p);
  const Common c = common_inputs(*g, p);
  auto attrs = fe::graph::SDPA_attributes()
                   .set_name("mla_varlen_forward")
                   .set_generate_stats(true)
                   .set_attn_scale(scale)
                   .set_implementation(impl);
  set_masks(attrs, p, c);
  auto outs = g->sdpa(c.q, c.k, c.v, attrs);
  TensorPtr o = outs[0], stats = outs[1];
  o->set_output(true).set_uid(kO).set_data_type(io_type(p.dtype));
  thd_layout(*o, p.batch, p.hq, p.max_seqlen_q, p.dv, c.offset_o);
  stats->set_output(true).set_uid(kStats);
  stats_layout(*stats, p.batch, p.hq, p.max_seqlen_q, c.offset_stats);
  return g;
}

std::shared_ptr<fe::graph::Graph> backward_graph(const VarlenProblem& p, float scale) {
  auto g = new_graph(p);
  const fe::DataType_t io = io_type(p.dtype);
  const Common c = common_inputs(*g, p);
  TensorPtr o = thd_input(*g, "o", kO, io, p.batch, p.hq, p.max_seqlen_q, p.dv, c.offset_o);
  TensorPtr grad_o =
      thd_input(*g, "grad_o", kGradO, io, p.batch, p.hq, p.max_seqlen_q, p.dv, c.offset_o);
  fe::graph::Tensor_attributes stats_attrs;
  stats_attrs.set_name("stats").set_uid(kStats);
  stats_layout(stats_attrs, p.batch, p.hq, p.max_seqlen_q, c.offset_stats);
  TensorPtr stats = g->tensor(stats_attrs);
  auto attrs = fe::graph::SDPA_backward_attributes()
                   .set_name("mla_varlen_backward")
                   .set_attn_scale(scale)
                   .set_max_total_seq_len_q(p.total_q)
                   .set_max_total_seq_len_kv(p.total_kv);
  set_masks(attrs, p, c);
  auto grads = g->sdpa_backward(c.q, c.k, c.v, o, grad_o, stats, attrs);
  grads[0]->set_output(true).set_uid(kGradQ).set_data_type(io);
  thd_layout(*grads[0], p.batch, p.hq, p.max_seqlen_q, p.dqk, c.offset_q);
  grads[1]->set_output(true).set_uid(kGradK).set_data_type(io);
  thd_layout(*grads[1], p.batch, p.hk, p.max_seqlen_kv, p.dqk, c.offset_k);
  grads[2]->set_output(true).set_uid(kGradV).set_data_type(io);
  thd_layout(*grads[2], p.batch, p.hk, p.max_seqlen_kv, p.dv, c.offset_v);
  return g;
}

// The forward's SDPA implementation: the frontend's choice (its unified engine where the cuDNN
// version covers the graph's features, else the composite graph), or one forced through
// VERL_OPS_CUDNN_SDPA_IMPL=composite|unified (read once; for comparisons and workarounds).
fe::AttentionImplementation_t forward_implementation() {
  static const fe::AttentionImplementation_t impl = [] {
    const char* env = std::getenv("VERL_OPS_CUDNN_SDPA_IMPL");
    if (env != nullptr && std::strcmp(env, "composite") == 0) {
      return fe::AttentionImplementation_t::COMPOSITE;
    }
    if (env != nullptr && std::strcmp(env, "unified") == 0) {
      return fe::AttentionImplementation_t::UNIFIED;
    }
    return fe::AttentionImplementation_t::AUTO;
  }();
  return impl;
}

// Builds the graph of `p` with `impl` (forward only; the backward has one implementation).
std::shared_ptr<fe::graph::Graph> build_graph(const char* op, const VarlenProblem& p, float scale,
                                              cudnnHandle_t handle,
                                              fe::AttentionImplementation_t impl) {
  std::shared_ptr<fe::graph::Graph> g =
      p.backward ? backward_graph(p, scale) : forward_graph(p, scale, impl);
  check(op, "graph validation", g->validate());
  check(op, "operation graph build", g->build_operation_graph(handle));
  check(op, "execution plan creation",
        g->create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}));
  check(op, "support check", g->check_support(handle));
  check(op, "plan build", g->build_plans(handle, fe::BuildPlanPolicy_t::HEURISTICS_CHOICE));
  return g;
}

std::shared_ptr<VarlenPlan> build_plan(const char* op, const VarlenProblem& p, float scale,
                                       cudnnHandle_t handle) {
  auto plan = std::make_shared<VarlenPlan>();
  plan->handle = handle;
  plan->backward = p.backward;
  const fe::AttentionImplementation_t impl = forward_implementation();
  try {
    try {
      plan->graph = build_graph(op, p, scale, handle, impl);
    } catch (const std::exception&) {
      // The frontend's automatic choice can pick an engine that then fails to build for this
      // graph; the composite graph is the long-standing path.
      if (p.backward || impl != fe::AttentionImplementation_t::AUTO) throw;
      plan->graph = build_graph(op, p, scale, handle, fe::AttentionImplementation_t::COMPOSITE);
    }
    int64_t workspace = 0;
    check(op, "workspace query", plan->graph->get_workspace_size(workspace));
    plan->workspace = workspace;
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    if (what.rfind(op, 0) == 0) throw;  // ours
    fail(op, "cuDNN could not build the varlen ", p.backward ? "backward" : "forward",
         " graph: ", what);
  }
  return plan;
}

void describe(std::ostream& os, const VarlenProblem& p) {
  os << "(batch " << p.batch << ", heads " << p.hq << "/" << p.hk << ", head dims " << p.dqk << "/"
     << p.dv << ", max_seqlen " << p.max_seqlen_q << "/" << p.max_seqlen_kv
     << (p.causal ? (p.bottom_right ? ", causal bottom-right" : ", causal") : ", non-causal")
     << (p.dtype == VarlenDtype::kHalf ? ", float16" : ", bfloat16") << ")";
}

void set_stream(const char* op, cudnnHandle_t handle, cudaStream_t stream) {
  const cudnnStatus_t st = fe::detail::set_stream(handle, stream);
  if (st != CUDNN_STATUS_SUCCESS) {
    fail(op, "cudnnSetStream failed: ", fe::detail::get_error_string(st));
  }
}

void execute(const char* op, const VarlenPlan* plan, std::unordered_map<int64_t, void*>& pack,
             void* workspace, cudaStream_t stream) {
  set_stream(op, plan->handle, stream);
  try {
    check(op, "execution", plan->graph->execute(plan->handle, pack, workspace));
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    if (what.rfind(op, 0) == 0) throw;
    fail(op, "cuDNN execution of the varlen graph failed: ", what);
  }
}

void add_metadata(std::unordered_map<int64_t, void*>& pack, const VarlenMetadata& m) {
  pack[kSeqLenQ] = m.seq_len_q;
  pack[kSeqLenKv] = m.seq_len_kv;
  pack[kOffsetQ] = m.offset_q;
  pack[kOffsetK] = m.offset_k;
  pack[kOffsetV] = m.offset_v;
  pack[kOffsetO] = m.offset_o;
  pack[kOffsetStats] = m.offset_stats;
}

}  // namespace

VarlenOrder varlen_order() {
  static const VarlenOrder order = [] {
    const char* env = std::getenv("VERL_OPS_VARLEN_ORDER");
    if (env != nullptr && std::strcmp(env, "input") == 0) return VarlenOrder::kInput;
    return VarlenOrder::kLargestFirst;
  }();
  return order;
}

std::shared_ptr<const VarlenPlan> varlen_plan(const char* op, const VarlenProblem& bucket,
                                              cudaStream_t stream) {
  load_cudnn(op);
  const bool in_capture = capturing(stream);
  const cudnnHandle_t handle = thread_handle(op, bucket.device, !in_capture);
  const Key key{bucket, handle, static_cast<float>(bucket.scale)};
  const Key bucket_key{bucket, nullptr, key.scale};
  Cache& c = cache();
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    if (handle != nullptr) {
      const auto it = c.plans.find(key);
      if (it != c.plans.end()) {
        c.hits.fetch_add(1, std::memory_order_relaxed);
        c.order.splice(c.order.begin(), c.order, it->second.where);
        if (in_capture) it->second.plan->pinned = true;
        return it->second.plan;
      }
    }
    const auto failed = c.failed.find(bucket_key);
    if (failed != c.failed.end()) {
      c.misses.fetch_add(1, std::memory_order_relaxed);
      throw std::runtime_error(failed->second + " (remembered from an earlier call of this shape bucket)");
    }
  }
  c.misses.fetch_add(1, std::memory_order_relaxed);
  if (in_capture) {
    std::ostringstream os;
    describe(os, bucket);
    fail(op, "backend='varlen' has no cuDNN plan yet for this shape bucket ", os.str(),
         " on this thread, and building one cannot be captured in a CUDA graph: run one call of "
         "this shape (forward and backward) before capturing");
  }
  std::shared_ptr<VarlenPlan> plan;
  try {
    plan = build_plan(op, bucket, key.scale, handle);
  } catch (const std::exception& e) {
    c.failures.fetch_add(1, std::memory_order_relaxed);
    std::lock_guard<std::mutex> lock(c.mutex);
    c.failed.emplace(bucket_key, e.what());
    throw;
  }
  c.builds.fetch_add(1, std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(c.mutex);
  // Keys carry this thread's handle, which no other thread holds: no one inserted this key meanwhile.
  const auto found = c.plans.find(key);
  if (found != c.plans.end()) return found->second.plan;
  c.order.push_front(key);
  c.plans.emplace(key, Cache::Entry{plan, c.order.begin()});
  c.trim();
  return plan;
}

int64_t varlen_cudnn_version() {
  static const int64_t version = [] {
    if (!cudnn_load_error().empty() || fe::cudnn_dlhandle == nullptr) return int64_t{0};
    try {
      return static_cast<int64_t>(fe::detail::get_backend_version());
    } catch (...) {
      return int64_t{0};
    }
  }();
  return version;
}

int64_t varlen_set_cache_capacity(int64_t capacity) {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  const int64_t previous = c.capacity;
  c.capacity = capacity;
  c.trim();
  return previous;
}

int64_t varlen_workspace_bytes(const VarlenPlan* plan) { return plan->workspace; }

void varlen_forward(const char* op, const VarlenPlan* plan, const VarlenForwardArgs& a,
                    void* workspace, cudaStream_t stream) {
  if (plan->backward) fail(op, "internal: a backward plan run as a forward");
  std::unordered_map<int64_t, void*> pack{
      {kQ, const_cast<void*>(a.q)}, {kK, const_cast<void*>(a.k)}, {kV, const_cast<void*>(a.v)},
      {kO, a.out},                  {kStats, a.stats}};
  add_metadata(pack, a.meta);
  execute(op, plan, pack, workspace, stream);
}

void varlen_backward(const char* op, const VarlenPlan* plan, const VarlenBackwardArgs& a,
                     void* workspace, cudaStream_t stream) {
  if (!plan->backward) fail(op, "internal: a forward plan run as a backward");
  std::unordered_map<int64_t, void*> pack{
      {kQ, const_cast<void*>(a.q)},
      {kK, const_cast<void*>(a.k)},
      {kV, const_cast<void*>(a.v)},
      {kO, const_cast<void*>(a.out)},
      {kGradO, const_cast<void*>(a.grad_out)},
      {kStats, const_cast<float*>(a.stats)},
      {kGradQ, a.grad_q},
      {kGradK, a.grad_k},
      {kGradV, a.grad_v}};
  add_metadata(pack, a.meta);
  execute(op, plan, pack, workspace, stream);
}

VarlenCacheStats varlen_cache_stats() {
  Cache& c = cache();
  VarlenCacheStats s;
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    s.size = static_cast<int64_t>(c.plans.size());
    s.capacity = c.capacity;
    s.failed_buckets = static_cast<int64_t>(c.failed.size());
  }
  s.hits = c.hits.load();
  s.misses = c.misses.load();
  s.builds = c.builds.load();
  s.failures = c.failures.load();
  s.evictions = c.evictions.load();
  return s;
}

}  // namespace cuda
}  // namespace verl_ops
