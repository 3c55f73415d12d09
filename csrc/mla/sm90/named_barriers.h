// The named barriers (bar.sync / bar.arrive ids) of the SM90 attention kernels. Id 0 is
// __syncthreads(); the producer warpgroup takes part in none of these.
#pragma once

namespace verl_ops {
namespace cuda {
namespace {

// Forward: the two consumer warpgroups take turns at the tensor cores. Warpgroup w waits for its
// turn at kTurn0 + w before issuing its GEMMs and then hands the turn to the other by arriving at
// the other's barrier (256 threads: both warpgroups), so one warpgroup's softmax runs while the
// other's GEMMs hold the tensor cores.
enum class FwdBarrier : int {
  kTurn0 = 1,
  kTurn1 = 2,
  // One consumer warpgroup's epilogue (128 threads), kEpilogue0 + w: its O staging in shared
  // memory written before it is read back, and read before the next tile writes it again.
  kEpilogue0 = 3,
  kEpilogue1 = 4,
};

// Backward.
enum class BwdBarrier : int {
  // Both consumer warpgroups (256 threads): past their last GEMM, before their dK / dV staging
  // overwrites the Q / dO stages.
  kConsumers = 1,
  // One consumer warpgroup's staged dK / dV rows written before it reads them back (128
  // threads), kEpilogue0 + w.
  kEpilogue0 = 2,
  kEpilogue1 = 3,
};

template <class Barrier>
__host__ __device__ constexpr int barrier_id(Barrier b) {
  return static_cast<int>(b);
}

}  // namespace
}  // namespace cuda
}  // namespace verl_ops
