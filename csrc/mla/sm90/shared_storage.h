// The shared memory of the SM90 attention kernels, one struct per kernel, and the 32-bit shared
// addresses of its parts (what TMA, wgmma descriptors, mbarriers and st/ld.shared take).
//
// The kernels align the dynamic shared memory to 1 KiB themselves (launch size: kSmemBytes, the
// struct plus that slack) and address it as `base` + the member's offset, so every address stays an
// add of a constant to one register.
#pragma once

#include <cstddef>
#include <cstdint>

#include "params.h"

namespace verl_ops {
namespace cuda {
namespace {

// The byte offset of a member of a shared-storage struct, as a 32-bit shared-address offset.
#define VERL_OPS_SMEM_OFFSET(Storage, member) static_cast<uint32_t>(offsetof(Storage, member))

namespace fwd {

struct SharedStorage {
  // TMA boxes in the wgmma operand layout (128-byte swizzle: 1 KiB aligned, see below).
  uint8_t q[kQBytes];
  uint8_t k[kStages][kKBytes];
  uint8_t v[kStages][kVBytes];
  // mbarriers: Q loaded / free, each stage's K and V loaded / free, the tile ring's slots.
  uint64_t q_full, q_empty;
  uint64_t k_full[kStages], v_full[kStages], k_empty[kStages], v_empty[kStages];
  uint64_t tile_full[2], tile_empty[2];
  // The tile ring: a decoded tile per slot, handed from the producer to the consumers.
  int32_t tile_slots[2][kSlotInts];
  // A word written and never read (see the main loop's softmax fence).
  float scratch;
  alignas(128) uint8_t o_stage[2][kOStageBytes];  // the epilogue's staging, per consumer warpgroup
};
constexpr int kSmemBytes = sizeof(SharedStorage) + 1024;  // + slack to align the base to 1 KiB
static_assert(kSmemBytes <= 232448, "shared memory over the SM90 per-block limit");
static_assert(offsetof(SharedStorage, k) % 1024 == 0 && offsetof(SharedStorage, v) % 1024 == 0,
              "TMA boxes with 128-byte swizzle need 1 KiB alignment");

static_assert(offsetof(SharedStorage, tile_empty) - offsetof(SharedStorage, q_full) == 8 * (4 + 4 * kStages),
              "the mbarriers are consecutive, as Smem::bar indexes them");

// Shared addresses of the parts of the SharedStorage at `base`.
struct Smem {
  uint32_t base;
  __device__ __forceinline__ uint32_t q() const { return base + VERL_OPS_SMEM_OFFSET(SharedStorage, q); }
  __device__ __forceinline__ uint32_t k(int s) const {
    return base + VERL_OPS_SMEM_OFFSET(SharedStorage, k) + s * kKBytes;
  }
  __device__ __forceinline__ uint32_t v(int s) const {
    return base + VERL_OPS_SMEM_OFFSET(SharedStorage, v) + s * kVBytes;
  }
  // The mbarriers, by their index in SharedStorage (q_full is 0): bar(i) = the first + 8 i.
  __device__ __forceinline__ uint32_t bar(int i) const {
    return base + VERL_OPS_SMEM_OFFSET(SharedStorage, q_full) + 8 * i;
  }
  __device__ __forceinline__ uint32_t q_full() const { return bar(0); }
  __device__ __forceinline__ uint32_t q_empty() const { return bar(1); }
  __device__ __forceinline__ uint32_t k_full(int s) const { return bar(2 + s); }
  __device__ __forceinline__ uint32_t v_full(int s) const { return bar(2 + kStages + s); }
  __device__ __forceinline__ uint32_t k_empty(int s) const { return bar(2 + 2 * kStages + s); }
  __device__ __forceinline__ uint32_t v_empty(int s) const { return bar(2 + 3 * kStages + s); }
  __device__ __forceinline__ uint32_t tile_full(int s) const { return bar(2 + 4 * kStages + s); }
  __device__ __forceinline__ uint32_t tile_empty(int s) const { return bar(4 + 4 * kStages + s); }
  __device__ __forceinline__ uint32_t scratch() const { return base + VERL_OPS_SMEM_OFFSET(SharedStorage, scratch); }
  __device__ __forceinline__ uint32_t o_stage(int wg) const {
    return base + VERL_OPS_SMEM_OFFSET(SharedStorage, o_stage) + wg * kOStageBytes;
  }
};

}  // namespace fwd

namespace bwd {

struct SharedStorage {
  // TMA boxes (128-byte swizzle, 1 KiB aligned): the CTA's K / V block, the Q / dO ring.
  uint8_t k[kKBytes];
  uint8_t v[kVBytes];
  uint8_t q[kStages][kQBytes];
  uint8_t dout[kStages][kOBytes];
  uint8_t ds[2][kDSBytes];     // dS^T of two query blocks (the A operand of dQ = dS K)
  float2 lse_d[kStages][kBM];  // {lse2, D} of each stage's query rows
  // mbarriers: K / V loaded; each stage's Q / dO / lse2-D loaded and free; each dS buffer written
  // by both warpgroups and free again.
  uint64_t kv_full;
  uint64_t full[kStages], empty[kStages];
  uint64_t ds_full[2], ds_empty[2];
};
constexpr int kSmemBytes = sizeof(SharedStorage) + 1024;  // + slack to align the base to 1 KiB
static_assert(kSmemBytes <= 232448, "shared memory over the 227 KiB an SM90 CTA can opt in to");
static_assert(offsetof(SharedStorage, v) % 1024 == 0 && offsetof(SharedStorage, q) % 1024 == 0 &&
                  offsetof(SharedStorage, dout) % 1024 == 0 && offsetof(SharedStorage, ds) % 1024 == 0,
              "TMA boxes and wgmma operands with 128-byte swizzle need 1 KiB alignment");
static_assert(offsetof(SharedStorage, ds_empty) - offsetof(SharedStorage, kv_full) == 8 * (3 + 2 * kStages),
              "the mbarriers are consecutive, as Smem::bar indexes them");

// Shared addresses of the parts of the SharedStorage at `base`.
struct Smem {
  uint32_t base;
  __device__ __forceinline__ uint32_t k() const { return base + VERL_OPS_SMEM_OFFSET(SharedStorage, k); }
  __device__ __forceinline__ uint32_t v() const { return base + VERL_OPS_SMEM_OFFSET(SharedStorage, v); }
  __device__ __forceinline__ uint32_t q(int s) const {
    return base + VERL_OPS_SMEM_OFFSET(SharedStorage, q) + s * kQBytes;
  }
  __device__ __forceinline__ uint32_t dout(int s) const {
    return base + VERL_OPS_SMEM_OFFSET(SharedStorage, dout) + s * kOBytes;
  }
  __device__ __forceinline__ uint32_t ds(int b) const {
    return base + VERL_OPS_SMEM_OFFSET(SharedStorage, ds) + b * kDSBytes;
  }
  __device__ __forceinline__ uint32_t lse_d(int s) const {
    return base + VERL_OPS_SMEM_OFFSET(SharedStorage, lse_d) + s * kBM * 8;
  }
  // The mbarriers, by their index in SharedStorage (kv_full is 0): bar(i) = the first + 8 i.
  __device__ __forceinline__ uint32_t bar(int i) const {
    return base + VERL_OPS_SMEM_OFFSET(SharedStorage, kv_full) + 8 * i;
  }
  __device__ __forceinline__ uint32_t kv_full() const { return bar(0); }
  __device__ __forceinline__ uint32_t full(int s) const { return bar(1 + s); }
  __device__ __forceinline__ uint32_t empty(int s) const { return bar(1 + kStages + s); }
  __device__ __forceinline__ uint32_t ds_full(int b) const { return bar(1 + 2 * kStages + b); }
  __device__ __forceinline__ uint32_t ds_empty(int b) const { return bar(3 + 2 * kStages + b); }
};

}  // namespace bwd

// The kernel's shared memory, its start rounded up to 1 KiB (the 128-byte swizzle of TMA boxes and
// wgmma operands is laid out in 1 KiB atoms).
__device__ __forceinline__ uint8_t* aligned_smem(uint8_t* raw) {
  return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t{1023});
}

}  // namespace
}  // namespace cuda
}  // namespace verl_ops
