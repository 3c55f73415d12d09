// The verl_ops API: every schema, and the kernels behind it for each dispatch key.
//
// Bound through the LibTorch stable ABI (TORCH_TARGET_VERSION 2.9): one binary works under every
// later torch of its CUDA major. That ABI has no str arguments at 2.9, so enumerations are ints
// (as aten's `int reduction`): cp_layout 0 = zigzag, 1 = contiguous; backend 0 = auto,
// 1 = padded, 2 = native, 3 = varlen. The Python API takes the names. Fake (Meta) kernels and autograd are
// registered from Python (verl_ops/_fake.py and the op modules).
#include "mla/mla_latent_ops.h"
#include "mla/mla_ops.h"
#include "ops/jagged_ops.h"
#include "ops/merge_ops.h"
#include "mla/rope_ops.h"
#include "ops/log_probs_ops.h"
#include "ops/router_ops.h"
#include "ops/stable.h"
#include "ops/thd_ops.h"

STABLE_TORCH_LIBRARY(verl_ops, m) {
  // Layout rules (docs/layout.md#rules) from per-sequence lengths (CPU). Returns int32 cu_seqlens
  // and cu_seqlens_padded, each [B + 1].
  VERL_DEF(m,
      "thd_layout(Tensor lengths, int tp_size=1, int cp_size=1, int cp_layout=0, "
      "bool fp8_padding=False, int? min_local_rows=None, int? pad_to_length_bucket=None) "
      "-> (Tensor cu_seqlens, Tensor cu_seqlens_padded)");
  // The same rules from lengths [B] or (x_is_offsets) a jagged batch's offsets [B + 1] (CPU), with
  // the layout's summary: offsets int32 [2, B + 1] and info int64 [7 + B] (see thd_ops.h).
  VERL_DEF(m,
      "thd_layout_info(Tensor x, bool x_is_offsets=False, int tp_size=1, int cp_size=1, "
      "int cp_layout=0, bool fp8_padding=False, int? min_local_rows=None, "
      "int? pad_to_length_bucket=None) -> (Tensor offsets, Tensor info)");
  // Pack jagged values [total, *F] (or padded [B, S, *F] with attention_mask [B, S]) into the
  // THD rows of cp_rank ([local_rows, *F]) or of every rank (cp_rank=-1: [cp, local_rows, *F]),
  // with the position of each row inside its padded sequence (0 in padding rows, as verl).
  VERL_DEF(m,
      "preprocess_thd(Tensor values, Tensor cu_seqlens, Tensor cu_seqlens_padded, "
      "SymInt local_rows, int cp_size=1, int cp_rank=0, int cp_layout=0, bool roll=False, "
      "Tensor? attention_mask=None) -> (Tensor packed, Tensor position_ids)");
  // Inverse of preprocess_thd over valid tokens: packed [local_rows, *F] of cp_rank (other
  // ranks' tokens come out zero) or all shards [cp, local_rows, *F] (cp_rank=-1) -> jagged
  // values [total_tokens, *F], or [B, S, *F] with zeros where attention_mask is false.
  VERL_DEF(m,
      "postprocess_thd(Tensor packed, Tensor cu_seqlens, Tensor cu_seqlens_padded, "
      "SymInt total_tokens, int cp_size=1, int cp_rank=-1, int cp_layout=0, "
      "bool roll=False, Tensor? attention_mask=None) -> Tensor");
  // Whole-sequence gather: output sequence j = rows [src_starts[j], src_starts[j] + len_j) of
  // values, len_j from cu_seqlens_out (int32 [n + 1]). Selects a subset of a batch (dynamic CP
  // split) or restores sample order (dynamic CP merge).
  VERL_DEF(m, "jagged_gather(Tensor values, Tensor src_starts, Tensor cu_seqlens_out, SymInt total_out) -> Tensor");
  // Adjoint of jagged_gather: rows go back where they were gathered from; zeros elsewhere.
  VERL_DEF(m, "jagged_scatter(Tensor grad, Tensor src_starts, Tensor cu_seqlens_out, SymInt total_in) -> Tensor");
  // dynamic_cp_merge's steps (layouts in core/merge_layout.h): this rank's header row [9 + 2B] for
  // the header all-gather, and the reorder index of the gathered header [G, 9 + 2B] (int64 words:
  // check flags, meta words, merged lengths, row starts; and the merged int32 offsets [B + 1]).
  VERL_DEF(m,
      "dynamic_cp_merge_header(Tensor lengths, Tensor sample_ids, int num_samples, int rows, int dtype_hash, "
      "int feature_hash, int row_bytes, int key_hash, int local_cp_size) -> Tensor");
  VERL_DEF(m, "dynamic_cp_merge_index(Tensor header, int num_samples, bool validate=True) -> (Tensor buf, Tensor cu_seqlens)");

  // --- router replay (docs/router_replay.md) ---
  // Record: L layers of top-k indices [L, T, K] (any integer dtype, any strides; a list of
  // per-layer tensors is passed as one strided view when they share a buffer) -> [T, L, K]
  // int16. With the layout's offsets (tp = cp = 1) the unpack is fused: [total_tokens, L, K], or
  // [B, S, L, K] with attention_mask. `overflow` (int32 [4096] flags) has a non-zero entry on
  // CUDA when an index does not fit int16; the CPU kernel raises instead.
  VERL_DEF(m,
      "router_topk_record(Tensor indices, Tensor? cu_seqlens=None, Tensor? cu_seqlens_padded=None, "
      "SymInt total_tokens=0, Tensor? attention_mask=None) -> (Tensor routes, Tensor overflow)");
  // Replay: routes [total_tokens, L, K] (or [B, S, L, K] + attention_mask) -> this TP/CP rank's
  // int64 targets [L, local_rows / tp_size, K] and, with replay_mask, its packed bool flags.
  VERL_DEF(m,
      "router_topk_scatter(Tensor routes, Tensor cu_seqlens, Tensor cu_seqlens_padded, SymInt local_rows, "
      "int tp_size=1, int tp_rank=0, int cp_size=1, int cp_rank=0, int cp_layout=0, "
      "Tensor? attention_mask=None, Tensor? replay_mask=None) -> (Tensor targets, Tensor replay_mask_packed)");
  // --- end router replay ---

  // --- mla_forward_padded (docs/mla.md#semantics) ---
  // THD attention for MLA head dims: q, k [T, H, Dqk], v [Tk, Hk, Dv] with Dv <= Dqk; equal to
  // attention with v zero-padded to Dqk and the output trimmed to Dv. Returns out [Tq, Hq, Dv]
  // and softmax_lse [Hq, Tq] (float32; float64 for float64 inputs). backend: 0 auto, 1 padded,
  // 2 native, 3 varlen (cuDNN on the packed rows; in builds with the cuDNN frontend).
  VERL_DEF(m,
      "mla_forward_padded(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_kv, "
      "SymInt max_seqlen_q, SymInt max_seqlen_kv, bool causal=True, float? softmax_scale=None, "
      "int backend=0) -> (Tensor out, Tensor softmax_lse)");
  VERL_DEF(m,
      "mla_backward_padded(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, "
      "Tensor softmax_lse, Tensor cu_seqlens_q, Tensor cu_seqlens_kv, SymInt max_seqlen_q, "
      "SymInt max_seqlen_kv, bool causal=True, float? softmax_scale=None, int backend=0) "
      "-> (Tensor grad_q, Tensor grad_k, Tensor grad_v)");
  // The varlen backend's plan cache: int64 [10] {compiled, size, hits, misses, builds, failures,
  // evictions, capacity, failed buckets, cuDNN version} (`like`: any CPU tensor; capacity >= 0
  // sets the cache's capacity first, 0: no limit).
  VERL_DEF(m, "mla_cache_info(Tensor like, int capacity=-1) -> Tensor");
  // --- end mla_forward_padded ---

  // --- mla_rope (docs/megatron.md#rope) ---
  // MLA's rotary embedding of THD rows in one pass, bit-identical to Megatron-Core's elementwise
  // chain: x [rows, heads, dim] (inner stride 1), cos / sin [table_rows, dim] in x's dtype (already
  // scaled), positions int64 [rows] (each row's table row). interleaved: MLA's de-interleave of the
  // rope dims first. backward: the adjoint (grad of the output -> grad of x). Returns [rows, heads, dim].
  VERL_DEF(m,
      "mla_rope(Tensor x, Tensor cos, Tensor sin, Tensor positions, bool interleaved=True, "
      "bool backward=False) -> Tensor");
  // The same, written into x (its dims rotated in place; a gradient buffer's rope columns).
  VERL_DEF(m,
      "mla_rope_(Tensor(a!) x, Tensor cos, Tensor sin, Tensor positions, bool interleaved=True, "
      "bool backward=False) -> ()");
  // --- end mla_rope ---

  // --- mla_latent_forward / mla_latent_backward (docs/mla.md#latent-parts) ---
  // MLA attention on its operands in parts: q = [q | q_pe] (q [Tq, Hq, 128], q_pe [Tq, Hq, 64]),
  // k = [k | k_pe] (k [Tk, Hk, 128], k_pe [Tk, 1, 64] shared by every kv head, or [Tk, Hk, 64]),
  // v [Tk, Hk, 128]; any strides with inner stride 1. The same attention as mla_forward_padded on
  // the concatenated operands (causal is bottom-right aligned where q and kv have their own
  // offsets). softmax_lse float32 [Hq, Tq]. The backward's gradients come in the layouts Megatron's
  // MultiLatentAttention makes q and kv in: grad_q [Tq, Hq, 192] = [d q | d q_pe], grad_kv
  // [Tk, Hk, 256] = [d k | d v], and grad_k_pe [Tk, Hk, 64] per kv head (summed by the caller where
  // k_pe is shared). CUDA: the SM90 kernels (Hopper); CPU: the concatenated reference (Python).
  VERL_DEF(m,
      "mla_latent_forward(Tensor q, Tensor q_pe, Tensor k, Tensor k_pe, Tensor v, Tensor cu_seqlens_q, "
      "Tensor cu_seqlens_kv, SymInt max_seqlen_q, SymInt max_seqlen_kv, bool causal=True, "
      "float? softmax_scale=None) -> (Tensor out, Tensor softmax_lse)");
  VERL_DEF(m,
      "mla_latent_backward(Tensor grad_out, Tensor q, Tensor q_pe, Tensor k, Tensor k_pe, Tensor v, "
      "Tensor out, Tensor softmax_lse, Tensor cu_seqlens_q, Tensor cu_seqlens_kv, SymInt max_seqlen_q, "
      "SymInt max_seqlen_kv, bool causal=True, float? softmax_scale=None) "
      "-> (Tensor grad_q, Tensor grad_kv, Tensor grad_k_pe)");
  // --- end mla_latent ---

  // --- vocab_log_probs (docs/ops.md#vocab_log_probs) ---
  // Log-probabilities of labels under a softmax over logits' last dim, this rank's vocabulary slice
  // [vocab_start, vocab_start + V): Megatron-Core's vocab_parallel_cross_entropy negated, float32
  // math, one pass forward. logits [*, V] float32 / float64 / float16 / bfloat16 (inner stride 1),
  // labels [*] int64 / int32. Returns float32 [*] each: log_probs (final for one slice), logits_max,
  // sum_exp (of exp(x - logits_max)), label_logit (x at the label where it lies in the slice, else 0).
  VERL_DEF(m,
      "vocab_log_probs_forward(Tensor logits, Tensor labels, int vocab_start=0) "
      "-> (Tensor log_probs, Tensor logits_max, Tensor sum_exp, Tensor label_logit)");
  // grad_logits [*, V] in logits' dtype = (exp(x - logits_max) / sum_exp - onehot(label)) * -grad_log_probs,
  // logits_max and sum_exp being the whole vocabulary's.
  VERL_DEF(m,
      "vocab_log_probs_backward(Tensor grad_log_probs, Tensor logits, Tensor labels, Tensor logits_max, "
      "Tensor sum_exp, int vocab_start=0) -> Tensor");
  // --- end vocab_log_probs ---
}

STABLE_TORCH_LIBRARY_IMPL(verl_ops, CPU, m) {
  VERL_IMPL(m, "thd_layout", &verl_ops::ops::thd_layout);
  VERL_IMPL(m, "thd_layout_info", &verl_ops::ops::thd_layout_info);
  VERL_IMPL(m, "preprocess_thd", &verl_ops::ops::preprocess_thd_cpu);
  VERL_IMPL(m, "postprocess_thd", &verl_ops::ops::postprocess_thd_cpu);
  VERL_IMPL(m, "jagged_gather", &verl_ops::ops::jagged_gather_cpu);
  VERL_IMPL(m, "jagged_scatter", &verl_ops::ops::jagged_scatter_cpu);
  VERL_IMPL(m, "dynamic_cp_merge_header", &verl_ops::ops::merge_header_cpu);
  VERL_IMPL(m, "dynamic_cp_merge_index", &verl_ops::ops::merge_index_cpu);
  // router replay
  VERL_IMPL(m, "router_topk_record", &verl_ops::ops::router_topk_record_cpu);
  VERL_IMPL(m, "router_topk_scatter", &verl_ops::ops::router_topk_scatter_cpu);
  // mla
  VERL_IMPL(m, "mla_forward_padded", &verl_ops::ops::mla_forward_padded_cpu);
  VERL_IMPL(m, "mla_backward_padded", &verl_ops::ops::mla_backward_padded_cpu);
  VERL_IMPL(m, "mla_cache_info", &verl_ops::ops::mla_cache_info);
  VERL_IMPL(m, "mla_rope", &verl_ops::ops::mla_rope_cpu);
  VERL_IMPL(m, "mla_rope_", &verl_ops::ops::mla_rope_inplace_cpu);
  VERL_IMPL(m, "vocab_log_probs_forward", &verl_ops::ops::vocab_log_probs_forward_cpu);
  VERL_IMPL(m, "vocab_log_probs_backward", &verl_ops::ops::vocab_log_probs_backward_cpu);
}

#ifdef VERL_OPS_WITH_CUDA
STABLE_TORCH_LIBRARY_IMPL(verl_ops, CUDA, m) {
  VERL_IMPL(m, "preprocess_thd", &verl_ops::ops::preprocess_thd_cuda);
  VERL_IMPL(m, "postprocess_thd", &verl_ops::ops::postprocess_thd_cuda);
  VERL_IMPL(m, "jagged_gather", &verl_ops::ops::jagged_gather_cuda);
  VERL_IMPL(m, "jagged_scatter", &verl_ops::ops::jagged_scatter_cuda);
  VERL_IMPL(m, "dynamic_cp_merge_header", &verl_ops::ops::merge_header_cuda);
  VERL_IMPL(m, "dynamic_cp_merge_index", &verl_ops::ops::merge_index_cuda);
  // router replay
  VERL_IMPL(m, "router_topk_record", &verl_ops::ops::router_topk_record_cuda);
  VERL_IMPL(m, "router_topk_scatter", &verl_ops::ops::router_topk_scatter_cuda);
  // mla
  VERL_IMPL(m, "mla_forward_padded", &verl_ops::ops::mla_forward_padded_cuda);
  VERL_IMPL(m, "mla_backward_padded", &verl_ops::ops::mla_backward_padded_cuda);
  // mla_cache_info reads host counters: on CUDA it only reports that `like` must be a CPU tensor.
  VERL_IMPL(m, "mla_cache_info", &verl_ops::ops::mla_cache_info);
  VERL_IMPL(m, "mla_rope", &verl_ops::ops::mla_rope_cuda);
  VERL_IMPL(m, "mla_rope_", &verl_ops::ops::mla_rope_inplace_cuda);
  VERL_IMPL(m, "mla_latent_forward", &verl_ops::ops::mla_latent_forward_cuda);
  VERL_IMPL(m, "mla_latent_backward", &verl_ops::ops::mla_latent_backward_cuda);
  VERL_IMPL(m, "vocab_log_probs_forward", &verl_ops::ops::vocab_log_probs_forward_cuda);
  VERL_IMPL(m, "vocab_log_probs_backward", &verl_ops::ops::vocab_log_probs_backward_cuda);
}
#endif
