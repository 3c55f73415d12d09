#!/usr/bin/env bash
# On a GPU machine without network: build in place with the varlen (cuDNN frontend) backend, a
# smoke run of that backend, the MLA GPU tests, compute-sanitizer memcheck on a reduced set of
# tests/test_mla_varlen.py, then benchmarks/mla/bench_mla.py (uniform and ragged batches, with
# FlashAttention-4 as the peer when benchmarks/device/fa4_setup.sh has unpacked it into /tmp/fa4).
# Every step runs whatever the previous one did (failures are logged, not fatal), under a time cap
# so that the whole script stays within DEADLINE seconds (default 420). Logs and results go to
# ${OUT:-./gpu_out}. STEPS picks steps (default "build smoke tests sanitizer bench"; the build is
# incremental, so e.g. STEPS="build bench" in a second call on a warm machine only benchmarks).
# BENCH_ARGS passes more arguments to bench_mla.py (e.g. "--rounds 3").
#
# The frontend's headers come from .cudnn_fe/include (a copy of the nvidia-cudnn-frontend
# package's include dir, plus cudnn.h in case the machine's nvidia-cudnn package has no headers).
#
#   OUT=/some/dir bash benchmarks/device/gpu_mla.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
DEADLINE="${DEADLINE:-420}"
source benchmarks/device/deadline_lib.sh  # OUT, START, left, cap, step, want
STEPS=" ${STEPS:-build smoke tests sanitizer bench} "

step "device"
{ nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())"
  nvcc --version | tail -1; nproc; } 2>&1 | tee "$OUT/device.txt"

if want build; then
step "build (in place, TORCH_CUDA_ARCH_LIST=9.0, built as 9.0a)"
t0=$(date +%s)
export CUDNN_FRONTEND_INCLUDE="$PWD/.cudnn_fe/include"
CUDNN_SITE=$(python3 -c "import os, nvidia.cudnn as m; p = os.path.join(list(m.__path__)[0], 'include'); print(p if os.path.isfile(os.path.join(p, 'cudnn.h')) else '')" 2>/dev/null)
if [ -n "$CUDNN_SITE" ]; then export CUDNN_INCLUDE="$CUDNN_SITE"; else export CUDNN_INCLUDE="$PWD/.cudnn_fe/include"; fi
echo "frontend headers: $CUDNN_FRONTEND_INCLUDE; cudnn.h: $CUDNN_INCLUDE"
MAX_JOBS="${MAX_JOBS:-16}" TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" \
  timeout "$(cap 300)" python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1; rc=$?
grep -E "verl_ops:" "$OUT/build.log"
if [ $rc -ne 0 ]; then
  echo "build with the frontend failed (rc=$rc):"; grep -E "error|Error" "$OUT/build.log" | head -30
  echo "building without the varlen backend instead, for the other results"
  VERL_OPS_NO_CUDNN_FE=1 MAX_JOBS="${MAX_JOBS:-16}" TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" \
    timeout "$(cap 200)" python3 setup.py build_ext --inplace > "$OUT/build_nofe.log" 2>&1 || tail -20 "$OUT/build_nofe.log"
fi
echo "build: $(( $(date +%s) - t0 )) s"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import verl_ops; print('verl_ops from', verl_ops.__file__, 'cuda', verl_ops.cuda_available(), 'varlen cache', verl_ops.mla_cache_info())" 2>&1 | tee -a "$OUT/device.txt"

if want smoke; then
step "smoke: varlen forward + backward, plan build time, each cuDNN forward implementation"
cat > "$OUT/smoke_varlen.py" <<'EOF'
import itertools, math, time
import torch
import verl_ops
from verl_ops import mla_forward_padded

def ref(q, k, v, cu_q, cu_kv, causal):
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], device=q.device)
    scale = 1 / math.sqrt(q.shape[2])
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_kv[b]), int(cu_kv[b + 1])
        lq, lk = q1 - q0, k1 - k0
        if lq == 0 or lk == 0:
            continue
        s = scale * q[q0:q1].float().transpose(0, 1) @ k[k0:k1].float().permute(1, 2, 0)
        if causal:
            i = torch.arange(lq, device=q.device)[:, None]; j = torch.arange(lk, device=q.device)[None]
            s = s.masked_fill(j > i + lk - lq, float("-inf"))
        p = s.softmax(-1).nan_to_num(0)
        out[q0:q1] = (p @ v[k0:k1].float().transpose(0, 1)).transpose(0, 1)
    return out

torch.manual_seed(0)
cases = [("self causal", [1, 300, 0, 129, 2048], None, True), ("self full", [1, 300, 0, 129, 2048], None, False),
         ("cross bottom-right", [5, 300, 0, 64, 7], [2, 100, 40, 0, 7], True)]
for name, lq, lk, causal in cases:
    lk = lq if lk is None else lk
    cu_q = torch.tensor([0, *itertools.accumulate(lq)], dtype=torch.int32, device="cuda")
    cu_kv = cu_q if lk is lq else torch.tensor([0, *itertools.accumulate(lk)], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lq), 16, 192, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(sum(lk), 16, 192, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(sum(lk), 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    try:
        for it in range(2):
            torch.cuda.synchronize(); t0 = time.perf_counter()
            out = mla_forward_padded(q, k, v, cu_q, cu_kv, max(lq), max(lk), causal=causal, backend="varlen")
            out.backward(torch.ones_like(out))
            torch.cuda.synchronize(); dt = time.perf_counter() - t0
            print(f"{name}: call {it}: {dt * 1e3:.1f} ms (fwd+bwd{', plan builds included' if it == 0 else ''})")
        want = ref(q.detach(), k.detach(), v.detach(), cu_q, cu_kv, causal)
        err = float((out.float() - want).norm() / want.norm().clamp_min(1e-6))
        print(f"{name}: out rel err {err:.2e}, finite grads {all(bool(torch.isfinite(t.grad).all()) for t in (q, k, v))}")
    except Exception as e:
        print(f"{name}: FAILED {type(e).__name__}: {e}")
print("cache", verl_ops.mla_cache_info())
EOF
for impl in default composite; do
  echo "--- VERL_OPS_CUDNN_SDPA_IMPL=$impl"
  env $( [ "$impl" = default ] || echo VERL_OPS_CUDNN_SDPA_IMPL=$impl ) \
    CUDNN_FRONTEND_LOG_INFO=1 CUDNN_FRONTEND_LOG_FILE="$OUT/cudnn_fe_$impl.log" \
    timeout "$(cap 90)" python3 "$OUT/smoke_varlen.py" 2>&1 | tee "$OUT/smoke_$impl.log" | tail -12
done
# The frontend's log is long: keep its errors and the chosen engines.
for f in "$OUT"/cudnn_fe_*.log; do
  [ -f "$f" ] && { grep -iE "error|fail|not supported|implementation|engine" "$f" | head -200 > "$f.short"; rm -f "$f"; }
done
fi

if want tests; then
step "MLA GPU tests (tests/test_mla*.py, tests/test_megatron_mla.py -m gpu)"
t0=$(date +%s)
timeout "$(cap 240)" python3 -m pytest tests/test_mla.py tests/test_mla_varlen.py tests/test_mla_sm90.py tests/test_megatron_mla.py -m gpu -q \
  -p no:cacheprovider -rfE --durations=15 > "$OUT/tests_mla.log" 2>&1; echo "rc=$?"
grep -E "^(FAILED|ERROR)" "$OUT/tests_mla.log" | head -40; tail -3 "$OUT/tests_mla.log"
echo "tests: $(( $(date +%s) - t0 )) s"
fi

if want sanitizer; then
step "compute-sanitizer memcheck (reduced tests/test_mla_varlen.py, tests/test_mla_sm90.py)"
t0=$(date +%s)
timeout "$(cap 110)" compute-sanitizer --tool memcheck --error-exitcode 9 \
  python3 -m pytest tests/test_mla_varlen.py tests/test_mla_sm90.py -q -x -p no:cacheprovider \
  -k "${SANITIZE_K:-(small_ragged and bf16 and h3) or (cross_attention and 192) or capture_and_replay or builds_no_plan}" \
  > "$OUT/sanitizer_mla_varlen.log" 2>&1; rc=$?
timeout "$(cap 150)" compute-sanitizer --tool memcheck --error-exitcode 9 python3 benchmarks/mla/memcheck_mla.py \
  > "$OUT/sanitizer_memcheck_mla.log" 2>&1; echo "memcheck_mla.py: rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer_memcheck_mla.log")"
grep -E "finite|ran|Invalid|out of bounds" "$OUT/sanitizer_memcheck_mla.log" | head -12
echo "sanitizer: rc=$rc $(grep -E 'ERROR SUMMARY|passed|failed' "$OUT/sanitizer_mla_varlen.log" | tail -2 | tr '\n' ' ')"
grep -E "Invalid|out of bounds|Address" "$OUT/sanitizer_mla_varlen.log" | head -10
echo "sanitizer: $(( $(date +%s) - t0 )) s"
fi

if want bench; then
step "bench_mla.py (${BENCH_BATCHES:-all} batches)"
t0=$(date +%s)
if [ -d /tmp/fa4 ] && [ -f /tmp/fa4/PYTHONPATH ]; then
  FA4_PATH=$(cat /tmp/fa4/PYTHONPATH); echo "FlashAttention-4 from $FA4_PATH"
else
  FA4_PATH=""; echo "no /tmp/fa4 (run benchmarks/device/fa4_setup.sh first for the FlashAttention-4 column)"
fi
PLOT=()
eval "EXTRA=(${BENCH_ARGS:-})"  # shell words, so quoted method names with spaces stay one argument
python3 -c "import matplotlib" 2>/dev/null && PLOT=(--plot "$OUT/mla.png")
PYTHONPATH="$PYTHONPATH${FA4_PATH:+:$FA4_PATH}" timeout "$(cap 400)" python3 benchmarks/mla/bench_mla.py \
  --batches "${BENCH_BATCHES:-all}" --reps "${BENCH_REPS:-10}" --out "$OUT/results_mla.md" "${PLOT[@]}" "${EXTRA[@]}" \
  > "$OUT/bench_mla.log" 2>&1; echo "rc=$?"
grep -vE "^\s*$" "$OUT/bench_mla.log" | tail -${BENCH_TAIL:-80}
echo "bench: $(( $(date +%s) - t0 )) s"
fi
echo; echo "total: $(( $(date +%s) - START )) s"
