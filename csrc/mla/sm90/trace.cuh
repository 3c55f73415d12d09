// Diagnostics build only (-DVERL_OPS_SM90_TRACE, benchmarks/mla/harness/prof_mla_sm90.cu with
// TRACE=1): clock64 stamps of the forward per CTA, role (0 producer, 1 / 2 consumer warpgroups),
// tile taken and event (see mla_sm90_fwd.h); SM90_TRACE compiles to nothing otherwise.
#pragma once

#include "mla_sm90_fwd.h"

namespace verl_ops {
namespace cuda {
namespace {

#if defined(VERL_OPS_SM90_TRACE)
__device__ long long g_sm90_trace[kSm90TraceCtas * 3 * kSm90TraceTiles * kSm90TraceEvents];
#define SM90_TRACE(role, k, e, v)                                                          \
  do {                                                                                     \
    if (blockIdx.x < kSm90TraceCtas && (k) < kSm90TraceTiles)                              \
      g_sm90_trace[((blockIdx.x * 3 + (role)) * kSm90TraceTiles + (k)) * kSm90TraceEvents + \
                   (e)] = (v);                                                            \
  } while (0)
#else
#define SM90_TRACE(role, k, e, v) \
  do {                            \
  } while (0)
#endif

}  // namespace
}  // namespace cuda
}  // namespace verl_ops
