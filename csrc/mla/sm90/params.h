// Tile shapes and kernel parameters of the SM90 attention kernels (MLA head dims: Dqk 192, Dv 128).
// The Params structs are what the host passes by value to the main kernels (with the tensor maps);
// the launchers in mla_sm90_fwd.cu / mla_sm90_bwd.cu fill them from Sm90FwdArgs / Sm90BwdArgs.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace verl_ops {
namespace cuda {
namespace {

constexpr int kDqk = 192;
constexpr int kDv = 128;

namespace fwd {

constexpr int kBM = 128;       // query rows per tile (two consumer warpgroups of 64)
constexpr int kBN = 128;       // keys per key tile
constexpr int kStages = 2;     // the K / V ring
constexpr int kThreads = 384;  // producer warpgroup + two consumer warpgroups

constexpr int kQBytes = kBM * kDqk * 2;  // 48 KiB: three 64-column chunks of 128 rows x 128 B
constexpr int kKBytes = kBN * kDqk * 2;  // 48 KiB
constexpr int kVBytes = kBN * kDv * 2;   // 32 KiB: two 64-column chunks
constexpr int kSlotInts = 8;             // a decoded tile (TileInfo as 8 ints) per slot of the tile ring
// The epilogue's staging of O: per consumer warpgroup 64 rows x 64 columns (half of O at a time),
// bf16 / fp16, 128-byte rows with their 16-byte chunks swizzled by the row.
constexpr int kOStageBytes = 64 * 64 * 2;

struct Params {
  const int32_t* order;        // [batch]: sequences, longest first
  const int32_t* tile_prefix;  // [batch + 1]: first tile of each sequence in that order
  int32_t* counter;            // tiles taken past the grid's first ones
  const int32_t* cu_q;
  const int32_t* cu_kv;
  void* out;
  float* lse;
  int64_t tq, tk;
  int hq, hk, batch;
  float scale, scale_log2;
  int causal, bottom_right;
  int k_pe_shared;  // k's last 64 columns come from one head for every kv head (MLA's k_pe)
};

}  // namespace fwd

namespace bwd {

constexpr int kBN = 128;  // keys per CTA: two consumer warpgroups of 64
constexpr int kBM = 64;   // query rows per block
constexpr int kStages = 2;  // the Q / dO / lse2-D ring
constexpr int kThreads = 384;

constexpr int kKBytes = kBN * kDqk * 2;  // 48 KiB: three 64-column chunks of 128 rows x 128 B
constexpr int kVBytes = kBN * kDv * 2;   // 32 KiB
constexpr int kQBytes = kBM * kDqk * 2;  // 24 KiB: three chunks of 64 rows x 128 B
constexpr int kOBytes = kBM * kDv * 2;   // 16 KiB (dO)
constexpr int kDSBytes = kBN * kBM * 2;  // 16 KiB: dS^T [128 keys][64 queries], both warpgroups

struct Params {
  const int32_t* order;        // [batch]: sequences, longest first (by keys)
  const int32_t* tile_prefix;  // [batch + 1]: first CTA of each sequence in that order
  const int32_t* cu_q;
  const int32_t* cu_kv;
  const float2* lse_d;         // [hq, tq]: {lse * log2(e), D}
  float* dq_accum;             // [tq, hq, 192]
  // dK's first 128 columns (dk), its last 64 (dk_pe: per kv head even where k_pe is shared) and
  // dV, each at row * <x>_rs + head * <x>_hs bytes.
  void* dk;
  void* dk_pe;
  void* dv;
  int64_t dk_rs, dk_hs, dkp_rs, dkp_hs, dv_rs, dv_hs;
  int64_t tq, tk;
  int hq, hk, batch;
  float scale, scale_log2;
  int causal, bottom_right;
  int k_pe_shared;
};

}  // namespace bwd

}  // namespace
}  // namespace cuda
}  // namespace verl_ops
