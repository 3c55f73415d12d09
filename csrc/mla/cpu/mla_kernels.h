// CPU reference kernels of variable-length attention with Dv <= Dqk (docs/mla.md#semantics): raw
// pointers, exact softmax in the accumulation type T (float, or double for float64 inputs).
#pragma once

#include <cstdint>

namespace verl_ops {
namespace cpu {

struct MlaProblem {
  const int32_t* cu_seqlens_q;   // [num_seqs + 1]
  const int32_t* cu_seqlens_kv;  // [num_seqs + 1]
  int64_t num_seqs;
  int64_t hq, hk, dqk, dv;
  bool causal;
  double scale;
};

// Work items seq * hq + h in [item_begin, item_end): out [Tq, hq, dv] and lse [hq, Tq] rows of
// that (sequence, query head). q, k [T, H, dqk], v [Tk, hk, dv], all contiguous.
template <typename T>
void mla_forward_items(const MlaProblem& p, const T* q, const T* k, const T* v, T* out, T* lse,
                       int64_t item_begin, int64_t item_end);

// Work items seq * hk + g: gradients of that (sequence, kv head) and of every query head that
// reads it, so items never write the same row. dq, dk, dv must be zeroed beforehand.
template <typename T>
void mla_backward_items(const MlaProblem& p, const T* q, const T* k, const T* v, const T* out,
                        const T* dout, const T* lse, T* dq, T* dk, T* dv, int64_t item_begin,
                        int64_t item_end);

}  // namespace cpu
}  // namespace verl_ops
