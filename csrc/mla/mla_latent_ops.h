// mla_latent_forward / mla_latent_backward (docs/mla.md#latent-parts): MLA attention on its
// operands in parts, as Megatron-Core's MultiLatentAttention makes them, without concatenating
// them: q = [q | q_pe], k = [k | k_pe] with k_pe of one head shared by every kv head, v.
#pragma once

#include <cstdint>
#include <optional>
#include <tuple>

#include "../ops/stable.h"

namespace verl_ops {
namespace ops {

using st::Tensor;

// out [Tq, Hq, 128], softmax_lse float32 [Hq, Tq].
std::tuple<Tensor, Tensor> mla_latent_forward_cuda(const Tensor& q, const Tensor& q_pe, const Tensor& k,
                                                   const Tensor& k_pe, const Tensor& v, const Tensor& cu_seqlens_q,
                                                   const Tensor& cu_seqlens_kv, int64_t max_seqlen_q,
                                                   int64_t max_seqlen_kv, bool causal,
                                                   std::optional<double> softmax_scale);

// grad_q [Tq, Hq, 192] = [d q | d q_pe], grad_kv [Tk, Hk, 256] = [d k | d v], grad_k_pe
// [Tk, Hk, 64] per kv head (the caller sums them where k_pe is shared).
std::tuple<Tensor, Tensor, Tensor> mla_latent_backward_cuda(
    const Tensor& grad_out, const Tensor& q, const Tensor& q_pe, const Tensor& k, const Tensor& k_pe,
    const Tensor& v, const Tensor& out, const Tensor& softmax_lse, const Tensor& cu_seqlens_q,
    const Tensor& cu_seqlens_kv, int64_t max_seqlen_q, int64_t max_seqlen_kv, bool causal,
    std::optional<double> softmax_scale);

}  // namespace ops
}  // namespace verl_ops
