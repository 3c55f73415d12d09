// Shared by prof_mla_sm90.cu and prof_mla_sm90_bwd.cu: the CUDA error check, the random bf16
// inputs, the batch named on the command line (HEADS CAUSAL CHECK ITERS (LENGTHS... | rl SEED);
// HKDIV=g divides the kv heads) and the timing loop.
#pragma once

#include <cuda_bf16.h>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <vector>
#include <random>
#include <string>
#include <algorithm>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d: %s\n", #x, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)

__global__ void init_kernel(__nv_bfloat16* x, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    uint64_t z = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed; z ^= z >> 31; z *= 0xBF58476D1CE4E5B9ull; z ^= z >> 29;
    float u = ((z >> 40) & 0xFFFFFF) / 16777216.0f;
    x[i] = __float2bfloat16((u - 0.5f) * 4.0f);
  }
}

// The batch: heads, mask, what to run, and the sequence lengths (rl SEED: an RL-like lognormal
// batch of about 32k rows) with their offsets cu.
struct Batch {
  int hq, hk, causal, check, iters;
  std::vector<int> lens, cu;
  int batch, T, maxlen;
};

inline Batch parse_batch(int argc, char** argv) {
  Batch b;
  b.hq = atoi(argv[1]); b.causal = atoi(argv[2]); b.check = atoi(argv[3]); b.iters = atoi(argv[4]);
  b.hk = getenv("HKDIV") ? b.hq / atoi(getenv("HKDIV")) : b.hq;
  if (std::string(argv[5]) == "rl") {
    std::mt19937_64 rng(atoi(argv[6]));
    std::lognormal_distribution<double> ln(std::log(1500.0), 0.9);
    int total = 0;
    while (total < 32768) { int x = std::min(8192, std::max(64, (int)ln(rng))); b.lens.push_back(x); total += x; }
  } else {
    for (int i = 5; i < argc; ++i) b.lens.push_back(atoi(argv[i]));
  }
  b.cu.assign(1, 0);
  for (int x : b.lens) b.cu.push_back(b.cu.back() + x);
  b.batch = b.lens.size(); b.T = b.cu.back(); b.maxlen = *std::max_element(b.lens.begin(), b.lens.end());
  return b;
}

// "lens(N): " and the first 40 lengths.
inline void print_lens(const Batch& b) {
  printf("lens(%d):", b.batch); for (int i = 0; i < std::min(b.batch, 40); ++i) printf(" %d", b.lens[i]);
}

// FLOPs of the batch: flops_per_pair per (query, key) pair and q head (causal: L(L+1)/2 pairs per
// sequence).
inline double batch_flops(const Batch& b, double flops_per_pair) {
  double flops = 0;
  for (int L : b.lens) { double pairs = b.causal ? (double)L * (L + 1) / 2 : (double)L * L; flops += pairs * b.hq * flops_per_pair; }
  return flops;
}

// The mean time of `iters` calls of launch() after 3 warm-up ones, in ms.
template <class Launch>
float time_ms(int iters, Launch launch) {
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  for (int i = 0; i < 3; ++i) launch();
  cudaEventRecord(e0);
  for (int i = 0; i < iters; ++i) launch();
  cudaEventRecord(e1); CK(cudaEventSynchronize(e1));
  float ms; cudaEventElapsedTime(&ms, e0, e1);
  return ms / iters;
}
