// Standalone check and timing of the SM90 backward kernel (csrc/mla/sm90/mla_sm90_bwd.cu) without
// torch: random bf16 q/k/v/dO over the given lengths, the forward of csrc/mla/sm90/mla_sm90_fwd.cu for
// O and the log-sum-exp, then the backward against a naive fp32 reference (dQ: a thread per row
// and head; dK / dV: a thread per key and kv head), max errors relative to each reference's
// largest entry, then the backward's TFLOP/s (causal: L(L+1)/2 pairs per sequence, 2 * 832 FLOPs
// per pair and head). Usage: prof_mla_sm90_bwd HEADS CAUSAL CHECK ITERS (LENGTHS... | rl SEED);
// HKDIV=g divides the kv heads (grouped heads). Built and run by benchmarks/mla/harness/prof_mla_sm90_bwd.sh.
#include "prof_common.cuh"
#include "../../../csrc/mla/sm90/mla_sm90_fwd.h"
#include "../../../csrc/mla/sm90/mla_sm90_bwd.h"

__device__ float bf(const __nv_bfloat16 x) { return __bfloat162float(x); }

// Thread per (row, head): lse and O (two passes), D = dO . O, dQ = scale * sum_j dS_ij k_j.
__global__ void ref_rows(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                         const __nv_bfloat16* dout, const int* cu, int batch, int tq, int hq, int hk,
                         float scale, int causal, float* lse, float* dd, float* dq) {
  int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (idx >= (int64_t)tq * hq) return;
  int row = idx / hq, h = idx % hq, g = h / (hq / hk);
  int b = 0; while (b < batch && cu[b + 1] <= row) ++b;
  int s = cu[b], L = cu[b + 1] - s, i = row - s;
  int end = causal ? i + 1 : L;
  const __nv_bfloat16* qr = q + ((int64_t)row * hq + h) * 192;
  const __nv_bfloat16* dor = dout + ((int64_t)row * hq + h) * 128;
  auto score = [&](int j) {
    const __nv_bfloat16* kr = k + ((int64_t)(s + j) * hk + g) * 192;
    float dot = 0.f;
    for (int d = 0; d < 192; ++d) dot += bf(qr[d]) * bf(kr[d]);
    return dot * scale;
  };
  float m = -INFINITY;
  for (int j = 0; j < end; ++j) m = fmaxf(m, score(j));
  float l = 0.f, o[128];
  for (int d = 0; d < 128; ++d) o[d] = 0.f;
  for (int j = 0; j < end; ++j) {
    float pj = expf(score(j) - m);
    l += pj;
    const __nv_bfloat16* vr = v + ((int64_t)(s + j) * hk + g) * 128;
    for (int d = 0; d < 128; ++d) o[d] += pj * bf(vr[d]);
  }
  float ls = l > 0 ? m + logf(l) : INFINITY, D = 0.f;
  for (int d = 0; d < 128; ++d) D += bf(dor[d]) * (l > 0 ? o[d] / l : 0.f);
  lse[idx] = ls;
  dd[idx] = D;
  float acc[192];
  for (int d = 0; d < 192; ++d) acc[d] = 0.f;
  for (int j = 0; j < end; ++j) {
    float p = expf(score(j) - ls);
    const __nv_bfloat16* vr = v + ((int64_t)(s + j) * hk + g) * 128;
    float dp = 0.f;
    for (int d = 0; d < 128; ++d) dp += bf(dor[d]) * bf(vr[d]);
    float ds = p * (dp - D);
    const __nv_bfloat16* kr = k + ((int64_t)(s + j) * hk + g) * 192;
    for (int d = 0; d < 192; ++d) acc[d] += ds * bf(kr[d]);
  }
  for (int d = 0; d < 192; ++d) dq[idx * 192 + d] = scale * acc[d];
}

// Thread per (key, kv head): dK = scale * sum_i dS_ij q_i, dV = sum_i P_ij dO_i over the q heads
// of the group.
__global__ void ref_cols(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                         const __nv_bfloat16* dout, const int* cu, int batch, int tk, int hq, int hk,
                         float scale, int causal, const float* lse, const float* dd, float* dk, float* dv) {
  int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (idx >= (int64_t)tk * hk) return;
  int row = idx / hk, g = idx % hk, grp = hq / hk;
  int b = 0; while (b < batch && cu[b + 1] <= row) ++b;
  int s = cu[b], L = cu[b + 1] - s, j = row - s;
  const __nv_bfloat16* kr = k + ((int64_t)row * hk + g) * 192;
  const __nv_bfloat16* vr = v + ((int64_t)row * hk + g) * 128;
  float ak[192], av[128];
  for (int d = 0; d < 192; ++d) ak[d] = 0.f;
  for (int d = 0; d < 128; ++d) av[d] = 0.f;
  for (int h = g * grp; h < (g + 1) * grp; ++h) {
    for (int i = causal ? j : 0; i < L; ++i) {
      int64_t qi = (int64_t)(s + i) * hq + h;
      const __nv_bfloat16* qr = q + qi * 192;
      const __nv_bfloat16* dor = dout + qi * 128;
      float dot = 0.f, dp = 0.f;
      for (int d = 0; d < 192; ++d) dot += bf(qr[d]) * bf(kr[d]);
      for (int d = 0; d < 128; ++d) dp += bf(dor[d]) * bf(vr[d]);
      float p = expf(dot * scale - lse[qi]);
      float ds = p * (dp - dd[qi]);
      for (int d = 0; d < 192; ++d) ak[d] += ds * bf(qr[d]);
      for (int d = 0; d < 128; ++d) av[d] += p * bf(dor[d]);
    }
  }
  for (int d = 0; d < 192; ++d) dk[idx * 192 + d] = scale * ak[d];
  for (int d = 0; d < 128; ++d) dv[idx * 128 + d] = av[d];
}

// Max |got - want| over max |want|, and whether every entry is finite.
static double rel_err(const __nv_bfloat16* got_d, const float* want_d, int64_t n, const char* name, int64_t* bad) {
  std::vector<__nv_bfloat16> got(n);
  std::vector<float> want(n);
  CK(cudaMemcpy(got.data(), got_d, n * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(want.data(), want_d, n * 4, cudaMemcpyDeviceToHost));
  double mx = 0, err = 0;
  int64_t worst = 0;
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, (double)fabs(want[i]));
  for (int64_t i = 0; i < n; ++i) {
    double d = fabs((double)__bfloat162float(got[i]) - want[i]);
    if (!(d <= err)) { err = d; worst = i; }
  }
  double r = mx > 0 ? err / mx : err;
  if (!(r <= 0.03)) {
    ++*bad;
    printf("  %s: worst at %lld: %f vs %f (max |ref| %f)\n", name, (long long)worst,
           __bfloat162float(got[worst]), want[worst], mx);
  }
  return r;
}

int main(int argc, char** argv) {
  const Batch bt = parse_batch(argc, argv);
  const int hq = bt.hq, hk = bt.hk, causal = bt.causal, check = bt.check, iters = bt.iters;
  const int batch = bt.batch, T = bt.T, maxlen = bt.maxlen;
  const std::vector<int>& cu = bt.cu;
  __nv_bfloat16 *q, *k, *v, *o, *dout, *dq, *dk, *dv; float *lse, *acc; float2* lse_d; int *dcu, *ws;
  CK(cudaMalloc(&q, (size_t)T * hq * 192 * 2)); CK(cudaMalloc(&k, (size_t)T * hk * 192 * 2));
  CK(cudaMalloc(&v, (size_t)T * hk * 128 * 2)); CK(cudaMalloc(&o, (size_t)T * hq * 128 * 2));
  CK(cudaMalloc(&dout, (size_t)T * hq * 128 * 2)); CK(cudaMalloc(&dq, (size_t)T * hq * 192 * 2));
  CK(cudaMalloc(&dk, (size_t)T * hk * 192 * 2)); CK(cudaMalloc(&dv, (size_t)T * hk * 128 * 2));
  CK(cudaMalloc(&lse, (size_t)T * hq * 4)); CK(cudaMalloc(&acc, (size_t)T * hq * 192 * 4));
  CK(cudaMalloc(&lse_d, (size_t)T * hq * 8)); CK(cudaMalloc(&dcu, cu.size() * 4));
  CK(cudaMalloc(&ws, (2 * batch + 2) * 4));
  CK(cudaMemcpy(dcu, cu.data(), cu.size() * 4, cudaMemcpyHostToDevice));
  init_kernel<<<1024, 256>>>(q, (int64_t)T * hq * 192, 1); init_kernel<<<1024, 256>>>(k, (int64_t)T * hk * 192, 2);
  init_kernel<<<1024, 256>>>(v, (int64_t)T * hk * 128, 3); init_kernel<<<1024, 256>>>(dout, (int64_t)T * hq * 128, 4);
  CK(cudaMemset(dq, 0xFF, (size_t)T * hq * 192 * 2)); CK(cudaMemset(dk, 0xFF, (size_t)T * hk * 192 * 2));
  CK(cudaMemset(dv, 0xFF, (size_t)T * hk * 128 * 2));
  float scale = 1.0f / sqrtf(192.f);
  verl_ops::cuda::Sm90FwdArgs fa{verl_ops::cuda::sm90_dense_parts(q, k, v, hq, hk), o, lse, dcu, dcu, ws, batch, T, T, hq, hk, maxlen, scale, (bool)causal, true, false};
  CK(verl_ops::cuda::launch_sm90_forward(fa, 0));
  verl_ops::cuda::Sm90BwdArgs ba{verl_ops::cuda::sm90_dense_parts(q, k, v, hq, hk), o, dout, lse, dq,
                                 {dk, (int64_t)hk * 192, 192}, {(char*)dk + 256, (int64_t)hk * 192, 192},
                                 {dv, (int64_t)hk * 128, 128}, dcu, dcu, ws, acc, lse_d, hq, 1,
                                 batch, T, T, hq, hk, scale, (bool)causal, true, false};
  CK(verl_ops::cuda::launch_sm90_backward(ba, 0));
  CK(cudaDeviceSynchronize());
  print_lens(bt); printf("  T=%d H=%d Hk=%d causal=%d\n", T, hq, hk, causal);
  if (check) {
    float *rl, *rd, *rdq, *rdk, *rdv;
    CK(cudaMalloc(&rl, (size_t)T * hq * 4)); CK(cudaMalloc(&rd, (size_t)T * hq * 4));
    CK(cudaMalloc(&rdq, (size_t)T * hq * 192 * 4)); CK(cudaMalloc(&rdk, (size_t)T * hk * 192 * 4));
    CK(cudaMalloc(&rdv, (size_t)T * hk * 128 * 4));
    int64_t nq = (int64_t)T * hq, nk = (int64_t)T * hk;
    ref_rows<<<(nq + 127) / 128, 128>>>(q, k, v, dout, dcu, batch, T, hq, hk, scale, causal, rl, rd, rdq);
    ref_cols<<<(nk + 127) / 128, 128>>>(q, k, v, dout, dcu, batch, T, hq, hk, scale, causal, rl, rd, rdk, rdv);
    CK(cudaDeviceSynchronize());
    int64_t bad = 0;
    double eq = rel_err(dq, rdq, nq * 192, "dQ", &bad);
    double ek = rel_err(dk, rdk, nk * 192, "dK", &bad);
    double ev = rel_err(dv, rdv, nk * 128, "dV", &bad);
    printf("CHECK %s: dQ %.3g dK %.3g dV %.3g (max error / max |ref|)\n", bad ? "FAIL" : "ok", eq, ek, ev);
  }
  if (iters > 0) {
    const float ms = time_ms(iters, [&] { verl_ops::cuda::launch_sm90_backward(ba, 0); });
    printf("TIME %.4f ms  %.1f TFLOP/s (backward)\n", ms, batch_flops(bt, 2.0 * 832) / ms / 1e9);
  }
  return 0;
}
