// Host-side pieces both SM90 launchers share: the tensor maps TMA reads through, the device test,
// the SM count, the schedule's launch and the shared-memory opt-in.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "mla_sm90_fwd.h"
#include "tile_scheduler.cuh"

namespace verl_ops {
namespace cuda {
namespace {

constexpr int kMaxDevices = 64;  // per-device caches below; a device past them is not used

// The driver's cuTensorMapEncodeTiled (through the runtime: no link dependency on libcuda), or
// nullptr where the driver has none.
PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult q{};
#if CUDART_VERSION >= 12050
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000,
                                                             cudaEnableDefault, &q);
#else
    const cudaError_t err = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &ptr,
                                                    cudaEnableDefault, &q);
#endif
    if (err == cudaSuccess && q == cudaDriverEntryPointSuccess && ptr != nullptr)
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
    else
      (void)cudaGetLastError();
  });
  return fn;
}

// Rows of one operand part (Sm90Rows: [rows, heads, d], strided) as a 3-D map (d, heads, rows), a
// box of 64 columns x 1 head x box_rows, 128-byte swizzle (the wgmma operand layout).
bool make_map(CUtensorMap* map, const Sm90Rows& r, int64_t rows, int64_t d, int box_rows, bool half) {
  auto fn = encode_fn();
  if (fn == nullptr) return false;
  // A single head's stride is never stepped over; any valid one does.
  const int64_t head_stride = r.heads == 1 ? d : r.head_stride;
  cuuint64_t dims[3] = {static_cast<cuuint64_t>(d), static_cast<cuuint64_t>(r.heads),
                        static_cast<cuuint64_t>(rows)};
  cuuint64_t strides[2] = {static_cast<cuuint64_t>(head_stride * 2), static_cast<cuuint64_t>(r.row_stride * 2)};
  cuuint32_t box[3] = {64, 1, static_cast<cuuint32_t>(box_rows)};
  cuuint32_t elem[3] = {1, 1, 1};
  return fn(map, half ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3,
            const_cast<void*>(r.ptr), dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The five parts' maps (q, q_pe with box_q rows; k, k_pe, v with box_k rows), in that order.
bool make_part_maps(CUtensorMap (&m)[5], const Sm90Parts& p, int64_t tq, int64_t tk, int box_q, int box_k,
                    bool half) {
  return make_map(&m[0], p.q, tq, 128, box_q, half) && make_map(&m[1], p.q_pe, tq, 64, box_q, half) &&
         make_map(&m[2], p.k, tk, 128, box_k, half) && make_map(&m[3], p.k_pe, tk, 64, box_k, half) &&
         make_map(&m[4], p.v, tk, 128, box_k, half);
}

// Whether the SM90 kernels can run on `device`: compute capability 9.0 and the driver's
// tensor-map encoder (cached per device; no sync).
bool sm90_device_supported(int device) {
  // 0: not queried yet, 1: no, 2: yes (static storage: zero-initialised).
  static std::atomic<int> known[kMaxDevices];
  if (device < 0 || device >= kMaxDevices) return false;
  int k = known[device].load(std::memory_order_relaxed);
  if (k == 0) {
    int major = 0, minor = 0;
    const bool ok =
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) == cudaSuccess;
    if (!ok) (void)cudaGetLastError();
    k = ok && major == 9 && minor == 0 && encode_fn() != nullptr ? 2 : 1;
    known[device].store(k, std::memory_order_relaxed);
  }
  return k == 2;
}

// Whether the environment variable `name` (VERL_OPS_VARLEN_FORWARD / _BACKWARD) asks for cuDNN's
// kernels instead of these.
bool env_selects_cudnn(const char* name) {
  const char* env = std::getenv(name);
  return env != nullptr && std::strcmp(env, "cudnn") == 0;
}

int sm_count() {
  int dev = 0, n = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0) {
    (void)cudaGetLastError();
    return 132;
  }
  return n;
}

// The Params fields both kernels share (fwd::Params, bwd::Params), from their launch arguments
// (Sm90FwdArgs, Sm90BwdArgs).
template <class Params, class Args>
void set_shared_params(Params& p, const Args& a) {
  p.cu_q = a.cu_q;
  p.cu_kv = a.cu_kv;
  p.tq = a.tq;
  p.tk = a.tk;
  p.hq = static_cast<int>(a.hq);
  p.hk = static_cast<int>(a.hk);
  p.batch = static_cast<int>(a.batch);
  p.scale = a.scale;
  p.scale_log2 = a.scale * 1.4426950408889634f;
  p.causal = a.causal ? 1 : 0;
  p.bottom_right = a.bottom_right ? 1 : 0;
}

// The schedule (tile_scheduler.cuh) into the workspace of 2 * batch + 2 ints: the order (p.order),
// the tile prefix (p.tile_prefix) and the counter. It ranks the sequences by their length in `cu`
// (`rows` rows: query rows for the forward, keys for the backward), in tiles of kRows rows per head.
template <int kRows, class Params>
void launch_schedule(Params& p, int32_t* workspace, const int32_t* cu, int64_t rows, int64_t batch,
                     int64_t heads, cudaStream_t stream) {
  p.order = workspace;
  p.tile_prefix = workspace + batch;
  schedule_kernel<kRows><<<1, kScheduleThreads, 0, stream>>>(
      cu, rows, static_cast<int>(batch), static_cast<int>(heads), workspace, workspace + batch,
      workspace + 2 * batch + 1);
}

// Lets kKernel use `bytes` of dynamic shared memory on the current device, once per device
// (function attributes are per device context).
template <auto kKernel>
cudaError_t opt_in_smem(int bytes) {
  static std::atomic<bool> opted_in[kMaxDevices];
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (dev < 0 || dev >= kMaxDevices || !opted_in[dev].load(std::memory_order_acquire)) {
    err = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (err != cudaSuccess) return err;
    if (dev >= 0 && dev < kMaxDevices) opted_in[dev].store(true, std::memory_order_release);
  }
  return cudaSuccess;
}

}  // namespace
}  // namespace cuda
}  // namespace verl_ops
