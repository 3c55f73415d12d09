// dynamic_cp_merge's header and reorder-index layouts, shared by the CPU and CUDA kernels.
//
// Header, one int64 row per CP group [9 + 2B]: 8 meta words (sequences n, rows, dtype hash,
// feature shape hash, row bytes, key hash, num_samples B, local_cp_size), the status word (0 in an
// accepted row), then the B lengths (0-padded) and the B sample ids (-1-padded). The status word
// sits right before the lengths, so a running sum from it gives each sequence's first row in its
// group and then the group's row count.
//
// Index buffer, int64 [size], from the gathered header [G, 9 + 2B]:
//   [0, G)                   validate: 1 where group g's lengths sum to its rows, else 0;
//                            without validate [G] holds the merged total
//   [G, G + 2)               validate: the smallest merged length and row start (-1 where a sample
//                            has no entry: both >= 0 iff every sample in [0, B) was given)
//   [meta_at, merged_at)     the G x 9 meta words
//   [merged_at, + B + 1)     the merged lengths in sample order (+ a spare word)
//   [src_at, + B + 1)        the first row of each merged sequence in the gathered values
//                            (group g's rows start at g * max rows) (+ a spare word)
// Unfilled words are -1 with validate, else 0. Sample ids outside [0, B) go to the spare words.
// cu int32 [B + 1]: the merged offsets, summed from the word before the merged lengths.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define VERL_MERGE_HD __host__ __device__
#else
#define VERL_MERGE_HD
#endif

namespace verl_ops {
namespace core {

constexpr int kMergeMeta = 9;  // 8 meta words + the status word
constexpr int kMergeRows = 1;
constexpr int kMergeStatus = 8;

struct MergeIndexLayout {
  int64_t meta_at, merged_at, src_at, size;
  VERL_MERGE_HD MergeIndexLayout(int64_t G, int64_t B)
      : meta_at(G + 2),
        merged_at(G + 2 + G * kMergeMeta),
        src_at(G + 2 + G * kMergeMeta + B + 1),
        size(G + 2 + G * kMergeMeta + 2 * (B + 1)) {}
};

}  // namespace core
}  // namespace verl_ops

#undef VERL_MERGE_HD
