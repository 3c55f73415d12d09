#include "thd_kernels.h"

#include <dlfcn.h>
#include <sched.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

namespace verl_ops {
namespace cpu {

// The row functions of core/thd_rows.h resolve one output row at a time (a binary search over
// the sequences each). On the CPU the common cases (no attention mask, no roll, and every jagged
// gather) are copied a run at a time instead: a run is a stretch of output rows that reads
// consecutive input rows (one sequence's chunk), so it is one memcpy, found with one search.
// What each row holds is the row functions' answer, row for row; the masked and rolled packs
// and unpacks keep the per-row loop.

namespace {
inline void copy_or_zero(char* dst, const char* src, int64_t src_row, int64_t row_bytes) {
  if (src_row >= 0) {
    std::memcpy(dst, src + src_row * row_bytes, static_cast<size_t>(row_bytes));
  } else {
    std::memset(dst, 0, static_cast<size_t>(row_bytes));
  }
}

inline void zero_rows(char* dst, int64_t n, int64_t row_bytes) {
  if (n > 0) std::memset(dst, 0, static_cast<size_t>(n * row_bytes));
}

// The part [lo, hi) of a run of n rows k -> first + k that lands inside [0, rows).
struct RunPart {
  int64_t lo, hi;
};

inline RunPart inside(int64_t first, int64_t n, int64_t rows) {
  const int64_t lo = std::min(n, std::max<int64_t>(0, -first));
  return {lo, std::max(lo, std::min(n, rows - first))};
}

// dst rows [0, n) <- src rows [first, first + n); the ones outside [0, src_rows) read as zero.
inline void copy_run(char* dst, const char* src, int64_t first, int64_t n, int64_t src_rows,
                     int64_t row_bytes) {
  const auto [lo, hi] = inside(first, n, src_rows);
  zero_rows(dst, lo, row_bytes);
  if (hi > lo) {
    std::memcpy(dst + lo * row_bytes, src + (first + lo) * row_bytes, static_cast<size_t>((hi - lo) * row_bytes));
  }
  zero_rows(dst + hi * row_bytes, n - hi, row_bytes);
}

void pack_rows_each(const core::PackPlan& plan, const char* src, char* dst, int64_t* positions,
                    int64_t row_bytes, int64_t row_begin, int64_t row_end) {
  for (int64_t r = row_begin; r < row_end; ++r) {
    int64_t pos = 0;
    const int64_t s = core::pack_source_row(plan, r, &pos);
    if (positions != nullptr) positions[r] = pos;
    copy_or_zero(dst + r * row_bytes, src, s, row_bytes);
  }
}

void unpack_rows_each(const core::UnpackPlan& plan, const char* src, char* dst, int64_t row_bytes,
                      int64_t row_begin, int64_t row_end) {
  for (int64_t r = row_begin; r < row_end; ++r) {
    copy_or_zero(dst + r * row_bytes, src, core::unpack_source_row(plan, r), row_bytes);
  }
}

// Pack without mask or roll (plain_row_value): a sequence's rows on a rank are one run (cp 1,
// contiguous layout) or two (zigzag: chunk rank, then chunk 2cp-1-rank); each run holds positions
// pos, pos + 1, ...: tokens while pos < length, then padding rows.
void pack_runs(const core::PackPlan& plan, const char* src, char* dst, int64_t* positions,
               int64_t row_bytes, int64_t row_begin, int64_t row_end) {
  const core::ShardSpec& s = plan.spec;
  const bool zigzag = s.cp_size > 1 && s.layout == core::CpLayout::kZigzag;
  int64_t r = row_begin;
  while (r < row_end) {
    int32_t rank = plan.cp_rank;
    int64_t row = r;
    if (rank < 0) {
      rank = static_cast<int32_t>(r / s.local_rows);
      row = r - static_cast<int64_t>(rank) * s.local_rows;
    }
    const core::RowSource rs = core::local_row_to_position(plan.cu_seqlens_padded, s, rank, row);
    if (rs.seq < 0) {  // past the last sequence (an inconsistent layout): the row function's answer
      pack_rows_each(plan, src, dst, positions, row_bytes, r, r + 1);
      ++r;
      continue;
    }
    const int64_t padded = core::padded_length(plan.cu_seqlens_padded, rs.seq);
    int64_t run;
    if (!zigzag) {
      run = padded - rs.pos;
    } else {
      const int64_t chunk = padded / (2 * s.cp_size);
      const int64_t j = row - plan.cu_seqlens_padded[rs.seq] / s.cp_size;
      run = (j < chunk ? chunk : 2 * chunk) - j;
    }
    const int64_t n = std::min({run, s.local_rows - row, row_end - r});
    const int64_t len = core::valid_length(plan.cu_seqlens, rs.seq);
    const int64_t valid = std::min(n, std::max<int64_t>(0, len - rs.pos));
    copy_run(dst + r * row_bytes, src, static_cast<int64_t>(plan.cu_seqlens[rs.seq]) + rs.pos, valid,
             plan.src_rows, row_bytes);
    zero_rows(dst + (r + valid) * row_bytes, n - valid, row_bytes);
    if (positions != nullptr) {
      for (int64_t k = 0; k < n; ++k) {
        const int64_t p = rs.pos + k;
        // Padding rows: 0, except in a zigzag first chunk (positions count on through it).
        positions[r + k] = (k < valid || (zigzag && 2 * p < padded)) ? p : 0;
      }
    }
    r += n;
  }
}

// Output rows [row_begin, row_end) in runs: `step(r)` writes the rows from r on (at least one,
// at most up to row_end) and returns how many; rows from `total` on (past the last sequence) are
// zero.
template <typename Step>
void output_runs(char* dst, int64_t row_bytes, int64_t row_begin, int64_t row_end, int64_t total,
                 Step&& step) {
  int64_t r = row_begin;
  while (r < row_end) {
    if (r >= total) {
      zero_rows(dst + r * row_bytes, row_end - r, row_bytes);
      return;
    }
    r += step(r);
  }
}

// Unpack without mask or roll: output rows are the tokens in order; the tokens of one sequence
// that sit in one chunk (cp 1: the whole sequence; contiguous: up to a rank boundary; zigzag: one
// of the 2cp chunks) are consecutive local rows of one rank.
void unpack_runs(const core::UnpackPlan& plan, const char* src, char* dst, int64_t row_bytes,
                 int64_t row_begin, int64_t row_end) {
  const core::ShardSpec& s = plan.spec;
  const int64_t B = s.num_seqs;
  const int64_t total = B > 0 ? static_cast<int64_t>(plan.cu_seqlens[B]) : 0;
  output_runs(dst, row_bytes, row_begin, row_end, total, [&](int64_t r) -> int64_t {
    const int64_t seq = core::upper_segment(plan.cu_seqlens, B, r);
    const int64_t q = r - plan.cu_seqlens[seq];
    const int64_t len = core::valid_length(plan.cu_seqlens, seq);
    const core::RowLocation loc = core::position_to_local_row(plan.cu_seqlens_padded, s, seq, q);
    if (q < 0 || q >= len || loc.rank < 0) {  // an inconsistent layout: the row function's answer
      unpack_rows_each(plan, src, dst, row_bytes, r, r + 1);
      return 1;
    }
    int64_t run = len - q;
    if (s.cp_size > 1) {
      if (s.layout == core::CpLayout::kContiguous) {
        run = std::min(run, s.local_rows - loc.row);
      } else {
        const int64_t chunk = core::padded_length(plan.cu_seqlens_padded, seq) / (2 * s.cp_size);
        run = std::min(run, chunk - q % chunk);
      }
    }
    const int64_t n = std::min(run, row_end - r);
    char* d = dst + r * row_bytes;
    if (plan.cp_rank >= 0 && loc.rank != plan.cp_rank) {
      zero_rows(d, n, row_bytes);
    } else {
      const int64_t first = (plan.cp_rank >= 0 ? 0 : static_cast<int64_t>(loc.rank) * s.local_rows) + loc.row;
      copy_run(d, src, first, n, plan.packed_rows, row_bytes);
    }
    return n;
  });
}
}  // namespace

void pack_rows(const core::PackPlan& plan, const char* src, char* dst, int64_t* positions,
               int64_t row_bytes, int64_t row_begin, int64_t row_end) {
  if (plan.mask_csum == nullptr && !plan.roll && plan.spec.local_rows > 0) {
    pack_runs(plan, src, dst, positions, row_bytes, row_begin, row_end);
  } else {
    pack_rows_each(plan, src, dst, positions, row_bytes, row_begin, row_end);
  }
}

void unpack_rows(const core::UnpackPlan& plan, const char* src, char* dst, int64_t row_bytes,
                 int64_t row_begin, int64_t row_end) {
  if (plan.mask_csum == nullptr && !plan.roll && plan.spec.local_rows > 0) {
    unpack_runs(plan, src, dst, row_bytes, row_begin, row_end);
  } else {
    unpack_rows_each(plan, src, dst, row_bytes, row_begin, row_end);
  }
}

// Output sequence j is one run: rows [cu_out[j], cu_out[j + 1]) from src_starts[j] on.
void jagged_gather_rows(const core::JaggedGatherPlan& plan, const char* src, char* dst,
                        int64_t row_bytes, int64_t row_begin, int64_t row_end) {
  const int64_t n = plan.num_out_seqs;
  const int64_t total = n > 0 ? static_cast<int64_t>(plan.cu_out[n]) : 0;
  output_runs(dst, row_bytes, row_begin, row_end, total, [&](int64_t r) -> int64_t {
    const int64_t j = core::upper_segment(plan.cu_out, n, r);
    const int64_t run = std::min<int64_t>(plan.cu_out[j + 1], row_end) - r;
    if (run <= 0) {  // offsets that decrease: the row function's answer
      copy_or_zero(dst + r * row_bytes, src, core::jagged_source_row(plan, r), row_bytes);
      return 1;
    }
    char* d = dst + r * row_bytes;
    if (plan.src_starts[j] < 0) {
      zero_rows(d, run, row_bytes);
    } else {
      copy_run(d, src, plan.src_starts[j] + (r - plan.cu_out[j]), run, plan.src_rows, row_bytes);
    }
    return run;
  });
}

void jagged_scatter_rows(const core::JaggedGatherPlan& plan, const char* src, char* dst,
                         int64_t row_bytes, int64_t row_begin, int64_t row_end) {
  const int64_t n = plan.num_out_seqs;
  const int64_t total = n > 0 ? static_cast<int64_t>(plan.cu_out[n]) : 0;
  int64_t r = row_begin;
  while (r < std::min(row_end, total)) {
    const int64_t j = core::upper_segment(plan.cu_out, n, r);
    const int64_t run = std::min<int64_t>(plan.cu_out[j + 1], row_end) - r;
    if (run <= 0) {
      const int64_t d = core::jagged_source_row(plan, r);
      if (d >= 0) std::memcpy(dst + d * row_bytes, src + r * row_bytes, static_cast<size_t>(row_bytes));
      ++r;
      continue;
    }
    if (plan.src_starts[j] >= 0) {
      // rows k of the run go to first + k; those outside [0, src_rows) are dropped
      const int64_t first = plan.src_starts[j] + (r - plan.cu_out[j]);
      const auto [lo, hi] = inside(first, run, plan.src_rows);
      if (hi > lo) {
        std::memcpy(dst + (first + lo) * row_bytes, src + (r + lo) * row_bytes,
                    static_cast<size_t>((hi - lo) * row_bytes));
      }
    }
    r += run;
  }
}

namespace {
// A positive integer from the environment (below 1024), else 0.
int env_threads(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return 0;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  return (*end == '\0' && x > 0 && x < 1024) ? static_cast<int>(x) : 0;
}
constexpr int64_t kMinBytesPerThread = int64_t{1} << 20;
}  // namespace

// torch's intra-op thread count (torch.get_num_threads(), which torch.set_num_threads and
// OMP_NUM_THREADS set), through the stable C shim's torch_get_num_threads: it exists from torch
// 2.10 on, and this module targets 2.9's stable ABI, so it is looked up in the loaded libtorch_cpu
// at run time. 0 where it is not there.
int torch_threads() {
  using Fn = int32_t (*)(uint32_t*);
  static const Fn fn = [] {
    void* lib = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
    return lib != nullptr ? reinterpret_cast<Fn>(dlsym(lib, "torch_get_num_threads")) : nullptr;
  }();
  uint32_t n = 0;
  return fn != nullptr && fn(&n) == 0 ? static_cast<int>(std::min<uint32_t>(n, 1023)) : 0;
}

int copy_threads(int64_t bytes) {
  static const int forced = env_threads("VERL_OPS_CPU_THREADS");
  static const int fallback = [] {
    // The CPUs this process may run on (its affinity mask: cpusets, taskset), not all of the host's.
    cpu_set_t set;
    CPU_ZERO(&set);
    int n = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set)
                                                         : static_cast<int>(std::thread::hardware_concurrency());
    n = std::max(n, 1);
    if (const int omp = env_threads("OMP_NUM_THREADS")) n = std::min(n, omp);
    return n;
  }();
  int max_threads = forced;
  if (max_threads == 0) {
    const int t = torch_threads();
    max_threads = std::min(t > 0 ? t : fallback, 8);
  }
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(max_threads, bytes / kMinBytesPerThread)));
}

void for_row_ranges(int64_t rows, int64_t row_bytes, const std::function<void(int64_t, int64_t)>& f) {
  const int64_t bytes = rows > 0 && row_bytes > 0 && rows <= INT64_MAX / row_bytes ? rows * row_bytes : 0;
  const int threads = static_cast<int>(std::min<int64_t>(copy_threads(bytes), std::max<int64_t>(rows, 1)));
  if (threads <= 1) {
    f(0, rows);
    return;
  }
  const int64_t per = (rows + threads - 1) / threads;
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(threads - 1));
  // Ranges 1 .. started - 1 go to new threads; when a thread cannot be started (a pids limit,
  // RLIMIT_NPROC, no memory for its stack) this thread does the rest of the ranges itself.
  int started = 1;
  for (; started < threads; ++started) {
    const int64_t lo = started * per, hi = std::min(rows, lo + per);
    if (lo >= hi) break;
    try {
      pool.emplace_back(f, lo, hi);
    } catch (...) {
      break;
    }
  }
  f(0, std::min(rows, per));
  if (started * per < rows) f(started * per, rows);
  for (std::thread& t : pool) t.join();
}

}  // namespace cpu
}  // namespace verl_ops
