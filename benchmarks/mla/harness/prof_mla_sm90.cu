// Standalone check and timing of the SM90 forward kernel (csrc/mla/sm90/mla_sm90_fwd.cu) without torch:
// random bf16 q/k/v over the given lengths,
// a naive fp32 reference (thread per row and head), max errors, then TFLOP/s (causal: L(L+1)/2
// pairs per sequence). Usage: prof_mla_sm90 HEADS CAUSAL CHECK ITERS (LENGTHS... | rl SEED);
// HKDIV=g divides the kv heads (grouped heads). Built and run by benchmarks/mla/harness/prof_mla_sm90.sh.
#include "prof_common.cuh"
#include "../../../csrc/mla/sm90/mla_sm90_fwd.h"

// thread per (row, head)
__global__ void ref_kernel(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                           const int* cu, int batch, int tq, int hq, int hk, float scale, int causal,
                           float* out, float* lse) {
  int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (idx >= (int64_t)tq * hq) return;
  int row = idx / hq, h = idx % hq, g = h / (hq / hk);
  int b = 0; while (b < batch && cu[b + 1] <= row) ++b;
  int s = cu[b], L = cu[b + 1] - s, i = row - s;
  int end = causal ? i + 1 : L;
  float m = -INFINITY, l = 0.f, acc[128];
  for (int d = 0; d < 128; ++d) acc[d] = 0.f;
  const __nv_bfloat16* qr = q + ((int64_t)row * hq + h) * 192;
  for (int j = 0; j < end; ++j) {
    const __nv_bfloat16* kr = k + ((int64_t)(s + j) * hk + g) * 192;
    float dot = 0.f;
    for (int d = 0; d < 192; ++d) dot += __bfloat162float(qr[d]) * __bfloat162float(kr[d]);
    dot *= scale;
    float mn = fmaxf(m, dot), a = expf(m - mn), pj = expf(dot - mn);
    l = l * a + pj;
    const __nv_bfloat16* vr = v + ((int64_t)(s + j) * hk + g) * 128;
    for (int d = 0; d < 128; ++d) acc[d] = acc[d] * a + pj * __bfloat162float(vr[d]);
    m = mn;
  }
  for (int d = 0; d < 128; ++d) out[idx * 128 + d] = l > 0 ? acc[d] / l : 0.f;
  lse[idx] = l > 0 ? m + logf(l) : INFINITY;
}

#if defined(VERL_OPS_SM90_TRACE)
// Where a tile's time goes (built with -DVERL_OPS_SM90_TRACE, run with TRACE=1): the consumer
// warpgroups' stamps per tile (see mla_sm90_fwd.h), summed over every traced tile, as mean
// cycles per tile and share of the warpgroups' time; the producer's wait for the Q buffer.
static void trace_report() {
  using namespace verl_ops::cuda;
  const int C = kSm90TraceCtas, K = kSm90TraceTiles, E = kSm90TraceEvents;
  std::vector<long long> tr((size_t)C * 3 * K * E);
  CK(sm90_trace_read(tr.data()));
  auto at = [&](int c, int r, int k, int e) { return tr[(((size_t)c * 3 + r) * K + k) * E + e]; };
  double part[7] = {0, 0, 0, 0, 0, 0, 0}, span = 0, iters = 0, p_q = 0, p_kv = 0;
  long tiles = 0, full = 0, keyed = 0, ptiles = 0;
  for (int c = 0; c < C; ++c) {
    for (int r = 1; r <= 2; ++r) {
      int k = 0;
      for (; k < K && at(c, r, k, 0) != 0; ++k) {
        const long long n = at(c, r, k, 7), e0 = at(c, r, k, 0), e6 = at(c, r, k, 6);
        if (n > 0) {
          for (int e = 1; e <= 6; ++e) part[e - 1] += at(c, r, k, e) - at(c, r, k, e - 1);
          iters += n - 1;
          ++keyed;
        } else {
          part[5] += e6 - e0;
        }
        if (k + 1 < K && at(c, r, k + 1, 0) != 0) part[6] += at(c, r, k + 1, 0) - e6;
        ++tiles;
      }
      if (k > 0) span += at(c, r, k - 1, 6) - at(c, r, 0, 0);
      if (k == K) ++full;
    }
    for (int k = 0; k < K && at(c, 0, k, 0) != 0; ++k) {
      if (at(c, 0, k, 7) > 0) { p_q += at(c, 0, k, 1) - at(c, 0, k, 0); p_kv += at(c, 0, k, 2) - at(c, 0, k, 1); }
      ++ptiles;
    }
  }
  if (tiles == 0 || span <= 0) { printf("TRACE no tiles\n"); return; }
  const char* names[7] = {"wait Q", "first S", "first softmax", "main loop", "last PV", "epilogue", "to next tile"};
  printf("TRACE %ld warpgroup tiles (%ld with keys, %.2f key tiles each; %ld warpgroups hit the %d-tile cap)\n",
         tiles, keyed, keyed ? 1.0 + iters / keyed : 0.0, full, K);
  for (int i = 0; i < 7; ++i)
    printf("TRACE %-14s %9.0f cycles/tile %5.1f%%\n", names[i], part[i] / (i < 5 ? (keyed ? keyed : 1) : tiles),
           100.0 * part[i] / span);
  if (iters > 0) printf("TRACE main loop per key tile %9.0f cycles\n", part[3] / iters);
  if (ptiles > 0) printf("TRACE producer: waits %.0f cycles/tile for the Q buffer, issues K / V over %.0f\n", p_q / ptiles, p_kv / ptiles);
}
#endif

int main(int argc, char** argv) {
  const Batch bt = parse_batch(argc, argv);
  const int hq = bt.hq, hk = bt.hk, causal = bt.causal, check = bt.check, iters = bt.iters;
  const int batch = bt.batch, T = bt.T, maxlen = bt.maxlen;
  const std::vector<int>& cu = bt.cu;
  __nv_bfloat16 *q, *k, *v, *o; float* lse; int* dcu;
  CK(cudaMalloc(&q, (size_t)T * hq * 192 * 2)); CK(cudaMalloc(&k, (size_t)T * hk * 192 * 2));
  CK(cudaMalloc(&v, (size_t)T * hk * 128 * 2)); CK(cudaMalloc(&o, (size_t)T * hq * 128 * 2));
  CK(cudaMalloc(&lse, (size_t)T * hq * 4)); CK(cudaMalloc(&dcu, cu.size() * 4));
  CK(cudaMemcpy(dcu, cu.data(), cu.size() * 4, cudaMemcpyHostToDevice));
  init_kernel<<<1024, 256>>>(q, (int64_t)T * hq * 192, 1); init_kernel<<<1024, 256>>>(k, (int64_t)T * hk * 192, 2);
  init_kernel<<<1024, 256>>>(v, (int64_t)T * hk * 128, 3);
  CK(cudaMemset(o, 0xFF, (size_t)T * hq * 128 * 2)); CK(cudaMemset(lse, 0, (size_t)T * hq * 4));
  float scale = 1.0f / sqrtf(192.f);
  int* ord = nullptr; CK(cudaMalloc(&ord, (2 * batch + 2) * 4));
  verl_ops::cuda::Sm90FwdArgs a{verl_ops::cuda::sm90_dense_parts(q, k, v, hq, hk), o, lse, dcu, dcu, ord, batch, T, T, hq, hk, maxlen, scale, (bool)causal, true, false};
  CK(verl_ops::cuda::launch_sm90_forward(a, 0));
  CK(cudaDeviceSynchronize());
  print_lens(bt); printf("  T=%d H=%d causal=%d\n", T, hq, causal);
  if (check) {
    float *ro, *rl; CK(cudaMalloc(&ro, (size_t)T * hq * 128 * 4)); CK(cudaMalloc(&rl, (size_t)T * hq * 4));
    int64_t n = (int64_t)T * hq;
    ref_kernel<<<(n + 127) / 128, 128>>>(q, k, v, dcu, batch, T, hq, hk, scale, causal, ro, rl);
    CK(cudaDeviceSynchronize());
    std::vector<__nv_bfloat16> ho((size_t)n * 128); std::vector<float> hro((size_t)n * 128), hl(n), hrl(n);
    CK(cudaMemcpy(ho.data(), o, ho.size() * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hro.data(), ro, hro.size() * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hl.data(), lse, n * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hrl.data(), rl, n * 4, cudaMemcpyDeviceToHost));
    double eo = 0, el = 0; int64_t bad = 0;
    for (int64_t i = 0; i < n * 128; ++i) {
      double d = fabs((double)__bfloat162float(ho[i]) - hro[i]);
      if (!(d <= 0.03)) { if (bad < 5) printf("  bad O at row %lld head %lld col %lld: %f vs %f\n", (long long)(i / 128 / hq), (long long)(i / 128 % hq), (long long)(i % 128), __bfloat162float(ho[i]), hro[i]); ++bad; }
      if (d > eo || d != d) eo = d;
    }
    for (int64_t i = 0; i < n; ++i) {
      double d = (std::isinf(hl[i]) && std::isinf(hrl[i])) ? 0 : fabs(hl[i] - hrl[i]);
      if (!(d <= 1e-3)) { if (bad < 10) printf("  bad lse at row %lld head %lld: %f vs %f\n", (long long)(i / hq), (long long)(i % hq), hl[i], hrl[i]); ++bad; }
      if (d > el || d != d) el = d;
    }
    printf("CHECK %s: max|dO|=%.4g max|dLSE|=%.4g bad=%lld\n", bad ? "FAIL" : "ok", eo, el, (long long)bad);
  }
#if defined(VERL_OPS_SM90_TRACE)
  if (getenv("TRACE")) {
    CK(verl_ops::cuda::sm90_trace_clear());
    CK(verl_ops::cuda::launch_sm90_forward(a, 0));
    CK(cudaDeviceSynchronize());
    trace_report();
  }
#endif
  if (iters > 0) {
    const float ms = time_ms(iters, [&] { verl_ops::cuda::launch_sm90_forward(a, 0); });
    printf("TIME %.4f ms  %.1f TFLOP/s\n", ms, batch_flops(bt, 2.0 * (192 + 128)) / ms / 1e9);
  }
  return 0;
}
