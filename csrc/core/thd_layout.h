// THD layout rules and row <-> (sequence, position) index maps.
//
// Plain C++17 with no torch dependency. Everything here is written once and used by the
// layout builder (host), the CPU kernels and the CUDA kernels, so that packing, unpacking
// and the layout itself can never disagree about which row holds which token.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define VERL_HD __host__ __device__ __forceinline__
#else
#define VERL_HD inline
#endif

namespace verl_ops {
namespace core {

enum class CpLayout : int32_t { kZigzag = 0, kContiguous = 1 };

// Describes how the global padded THD buffer is sharded over context-parallel ranks.
struct ShardSpec {
  int64_t num_seqs;    // B
  int64_t local_rows;  // total_padded / cp_size
  int32_t cp_size;
  CpLayout layout;
};

// Largest i in [0, n) with cu[i] <= value, for a non-decreasing cu of length n + 1.
// Zero-length sequences share their offset with the next one; taking the largest index
// skips them, so a row is always attributed to the sequence that actually covers it.
template <typename T>
VERL_HD int64_t upper_segment(const T* cu, int64_t n, int64_t value) {
  int64_t lo = 0, hi = n - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) >> 1;
    if (static_cast<int64_t>(cu[mid]) <= value) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Where a local row of rank `rank` lives in the padded sequences.
struct RowSource {
  int64_t seq;  // sequence index, or -1 when the row lies past the last sequence
  int64_t pos;  // position inside the padded sequence
};

// Local row -> (sequence, position within the padded sequence).
VERL_HD RowSource local_row_to_position(const int32_t* cu_padded, const ShardSpec& s,
                                        int32_t rank, int64_t row) {
  RowSource r{-1, 0};
  if (s.num_seqs <= 0) return r;
  if (s.cp_size == 1 || s.layout == CpLayout::kContiguous) {
    const int64_t g = static_cast<int64_t>(rank) * s.local_rows + row;
    if (g >= cu_padded[s.num_seqs]) return r;
    r.seq = upper_segment(cu_padded, s.num_seqs, g);
    r.pos = g - cu_padded[r.seq];
    return r;
  }
  // Zigzag: sequence i occupies local rows [cu_padded[i] / cp, cu_padded[i+1] / cp) on every
  // rank; the first half of that span is chunk `rank`, the second half chunk 2cp-1-rank.
  const int64_t g = row * s.cp_size;
  if (g >= cu_padded[s.num_seqs]) return r;
  const int64_t i = upper_segment(cu_padded, s.num_seqs, g);
  const int64_t start = cu_padded[i] / s.cp_size;
  const int64_t chunk = (static_cast<int64_t>(cu_padded[i + 1]) - cu_padded[i]) / (2 * s.cp_size);
  const int64_t j = row - start;
  if (chunk <= 0 || j >= 2 * chunk) return r;
  r.seq = i;
  r.pos = (j < chunk) ? rank * chunk + j : (2 * s.cp_size - 1 - rank) * chunk + (j - chunk);
  return r;
}

struct RowLocation {
  int32_t rank;
  int64_t row;
};

// (sequence, position within the padded sequence) -> (rank, local row). Inverse of the above.
VERL_HD RowLocation position_to_local_row(const int32_t* cu_padded, const ShardSpec& s,
                                          int64_t seq, int64_t pos) {
  // A position past the padded sequence (only possible with an inconsistent layout) maps to
  // no row rather than to a neighbour's row or a division by zero.
  const int64_t padded = static_cast<int64_t>(cu_padded[seq + 1]) - cu_padded[seq];
  if (pos < 0 || pos >= padded) return RowLocation{-1, 0};
  if (s.cp_size == 1 || s.layout == CpLayout::kContiguous) {
    const int64_t g = cu_padded[seq] + pos;
    if (s.cp_size == 1) return RowLocation{0, g};
    if (s.local_rows <= 0) return RowLocation{-1, 0};
    return RowLocation{static_cast<int32_t>(g / s.local_rows), g % s.local_rows};
  }
  const int64_t start = cu_padded[seq] / s.cp_size;
  const int64_t chunk = padded / (2 * s.cp_size);
  if (chunk <= 0) return RowLocation{-1, 0};
  const int64_t k = pos / chunk;
  const int64_t j = pos - k * chunk;
  if (k < s.cp_size) return RowLocation{static_cast<int32_t>(k), start + j};
  return RowLocation{static_cast<int32_t>(2 * s.cp_size - 1 - k), start + chunk + j};
}

// Valid-token position that feeds padded position `pos` of a sequence of length `len`;
// with roll, position p reads token p+1 and the last valid position wraps to token 0.
VERL_HD int64_t source_position(int64_t pos, int64_t len, bool roll) {
  if (!roll) return pos;
  return (pos + 1 < len) ? pos + 1 : 0;
}

// Inverse of source_position: the padded position that reads token q.
VERL_HD int64_t reading_position(int64_t q, int64_t len, bool roll) {
  if (!roll) return q;
  return (q == 0) ? len - 1 : q - 1;
}

// Index of the k-th (0-based) true entry of a mask row, given the row's inclusive prefix
// count `csum` (non-decreasing, length n). Returns n when the row has fewer than k+1 trues.
VERL_HD int64_t select_kth(const int32_t* csum, int64_t n, int64_t k) {
  int64_t lo = 0, hi = n;  // first index with csum[idx] >= k + 1
  while (lo < hi) {
    const int64_t mid = (lo + hi) >> 1;
    if (static_cast<int64_t>(csum[mid]) >= k + 1) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

// ---------------------------------------------------------------------------------------
// Layout rules (docs/layout.md#rules). Host only; the results are checked and then shipped to
// the kernels as cu_seqlens / cu_seqlens_padded.

inline int64_t gcd64(int64_t a, int64_t b) {
  while (b != 0) {
    const int64_t t = a % b;
    a = b;
    b = t;
  }
  return a < 0 ? -a : a;
}

// Checked arithmetic: layout sizes come from user arguments, and an overflow must become an
// error, never a wrapped (or zero) alignment.
inline bool mul_ok(int64_t a, int64_t b, int64_t* out) { return !__builtin_mul_overflow(a, b, out); }

inline bool lcm_ok(int64_t a, int64_t b, int64_t* out) { return mul_ok(a / gcd64(a, b), b, out); }

// Smallest multiple of m (> 0) that is >= x (>= 0).
inline bool ceil_to_ok(int64_t x, int64_t m, int64_t* out) {
  int64_t sum;
  if (__builtin_add_overflow(x, m - 1, &sum)) return false;
  return mul_ok(sum / m, m, out);
}

struct LayoutParams {
  int64_t tp_size = 1;
  int64_t cp_size = 1;
  CpLayout layout = CpLayout::kZigzag;
  bool fp8_padding = false;
  int64_t min_local_rows = -1;        // < 0: not set
  int64_t pad_to_length_bucket = -1;  // < 0: not set (0 is rejected by the caller)
};

// Fills padded[i] for every sequence (rules 1-6 of docs/layout.md#rules); `padded` must have room
// for n entries. Returns false when a size overflows int64 (the caller reports it).
inline bool compute_padded_lengths(const int64_t* lengths, int64_t n, const LayoutParams& p,
                                   int64_t* padded) {
  const int64_t factor = (p.layout == CpLayout::kZigzag && p.cp_size > 1) ? 2 : 1;
  int64_t align, total_align = 1;
  if (!mul_ok(p.tp_size, p.cp_size, &align) || !mul_ok(align, factor, &align)) return false;
  if (p.fp8_padding) {
    if (!mul_ok(align, 128, &total_align) || !lcm_ok(16, align, &align)) return false;
  }
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (!ceil_to_ok(lengths[i], align, &padded[i])) return false;
    if (__builtin_add_overflow(total, padded[i], &total)) return false;
  }
  if (n == 0) return true;
  int64_t target = total;
  if (p.fp8_padding && !ceil_to_ok(target, total_align, &target)) return false;
  if (p.min_local_rows >= 0) {
    int64_t min_total;
    if (!mul_ok(p.cp_size, p.min_local_rows, &min_total)) return false;
    if (target < min_total) target = min_total;
  }
  if (p.pad_to_length_bucket > 0) {
    int64_t m;
    if (!lcm_ok(p.pad_to_length_bucket, p.cp_size, &m)) return false;
    if (p.fp8_padding && !lcm_ok(m, total_align, &m)) return false;
    if (!ceil_to_ok(target, m, &target)) return false;
  }
  padded[n - 1] += target - total;
  return true;
}

}  // namespace core
}  // namespace verl_ops
