#!/usr/bin/env bash
# On a GPU machine: the latent MLA path in one call. Build (in place, with the cuDNN frontend headers
# from .cudnn_fe), megatron-core from .whl (MCORE, default 0.16.1), the GPU tests of the latent ops
# and of the SM90 kernels they share with the varlen backend, compute-sanitizer memcheck on a subset
# of the latent cases, and the one-step benchmark at hidden 4096 (verl, verl_ops_cat, verl_ops, and
# verl_fa4 where /tmp/fa4/PYTHONPATH exists). Each part capped; logs to ${OUT:-./gpu_out}.
#
#   OUT=/some/dir bash benchmarks/device/gpu_latent.sh
#   OUT=/some/dir MCORE=0.19.2 TESTS=tests/test_mla_latent.py MEMCHECK=0 bash benchmarks/device/gpu_latent.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-./gpu_out}"; mkdir -p "$OUT"
MCORE="${MCORE:-0.16.1}"
OUT="$OUT" MCORE="$MCORE" STEPS="build site" bash benchmarks/device/gpu_megatron.sh > "$OUT/setup.log" 2>&1 \
  || { tail -30 "$OUT/setup.log"; exit 1; }
grep -E "^==|megatron-core|verl_ops " "$OUT/setup.log" | head -8
export PYTHONPATH="$PWD:/tmp/mcore-$MCORE"
[ -f /tmp/fa4/PYTHONPATH ] && export PYTHONPATH="$PYTHONPATH:$(cat /tmp/fa4/PYTHONPATH)"
t0=$(date +%s)
timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider -rfE ${TESTS:-tests/test_mla_latent.py tests/test_mla_sm90.py} \
  > "$OUT/tests.log" 2>&1; echo "tests rc=$? [$(( $(date +%s) - t0 )) s]"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -15
t0=$(date +%s)
[ "${MEMCHECK:-1}" = 1 ] && timeout "${MEMCHECK_TIMEOUT:-100}" compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
  tests/test_mla_latent.py -k "${MEMCHECK_K:-cross or (equals_dense and lengths1)}" \
  > "$OUT/memcheck.log" 2>&1; echo "memcheck rc=$? [$(( $(date +%s) - t0 )) s]"
grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -3
grep -m3 -A6 -E "^========= (Invalid|Misaligned|Out-of-range|Uninitialized)" "$OUT/memcheck.log"
t0=$(date +%s)
timeout "${BENCH_TIMEOUT:-150}" python3 benchmarks/megatron/bench_megatron_step.py --sizes 4096 --out "$OUT/step.json" \
  ${BENCH_ARGS:---reps 5 --warmup 2} > "$OUT/step.log" 2>&1; echo "bench rc=$? [$(( $(date +%s) - t0 )) s]"
grep -vE "^\s*$" "$OUT/step.log" | grep -v Warning | tail -45
