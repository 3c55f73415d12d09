#!/usr/bin/env bash
# Build on a GPU machine, run the test suite (GPU cases included), compute-sanitizer memcheck on the
# GPU tests, and the THD benchmark. Logs and results go to ${OUT:-./gpu_out}.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-./gpu_out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi -L | tee "$OUT/device.txt"
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)" | tee -a "$OUT/device.txt"

t0=$(date +%s)
TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-16}" \
  python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 \
  || { tail -40 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
python3 -c "import verl_ops; assert verl_ops.cuda_available(); print('cuda kernels ok')" || exit 1

status=0
python3 -m pytest tests -q -x -k "not wheel" ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/tests.log" | tail -15 || status=1
echo "--- compute-sanitizer memcheck (GPU tests)"
timeout "${SANITIZER_TIMEOUT:-300}" compute-sanitizer --tool memcheck --error-exitcode 9 \
  python3 -m pytest tests/test_thd.py -q -x -k "cuda and not compile" -p no:cacheprovider \
  > "$OUT/sanitizer.log" 2>&1; rc=$?
tail -6 "$OUT/sanitizer.log"; echo "sanitizer rc=$rc"; [ $rc -eq 0 ] || status=1
echo "--- benchmark"
python3 benchmarks/bench_thd.py --out "$OUT/results.md" --plot "$OUT/thd.png" 2>&1 | tee "$OUT/bench.log" | tail -40 || status=1
exit $status
