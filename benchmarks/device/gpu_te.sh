#!/usr/bin/env bash
# On a GPU machine without network: verl_ops inside megatron-core models built with
# TransformerEngine's specs, in one call.
#   TE          benchmarks/device/te_setup.sh from .te (carried), into /tmp/te_site; with
#               TE_SO_OUT=DIR the built extension is also kept there (te_setup.sh)
#   build/site  verl_ops built in place and megatron-core MCORE (default "0.16.1 0.19.2") + verl 0.9.1
#               from .whl (gpu_megatron.sh), at the same time as the TE build
#   tests       per megatron-core version: tests/test_megatron_te.py (CP = 1 on one GPU; CP = 2 over
#               NCCL where 2 GPUs are there), FlashAttention-4 on the path where /tmp/fa4/PYTHONPATH
#               exists (benchmarks/device/fa4_setup.sh); a JSON summary per test in $OUT
# Carry: [".te", ".whl", ".cudnn_fe"].
#
#   OUT=/some/dir bash benchmarks/device/gpu_te.sh
#   OUT=/some/dir MCORE=0.19.2 PYTEST_ARGS="-k context_parallel" bash benchmarks/device/gpu_te.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-./gpu_out}"; mkdir -p "$OUT"
MCORE="${MCORE:-0.16.1 0.19.2}"
t0=$(date +%s)
( OUT="$OUT" MAX_JOBS="${TE_JOBS:-12}" bash benchmarks/device/te_setup.sh > "$OUT/te_setup.log" 2>&1
  echo "te_setup rc=$?" >> "$OUT/te_setup.log" ) &
te_pid=$!
OUT="$OUT" MCORE="$MCORE" STEPS="build site" MAX_JOBS="${BUILD_JOBS:-8}" bash benchmarks/device/gpu_megatron.sh \
  > "$OUT/setup.log" 2>&1 || { tail -30 "$OUT/setup.log"; exit 1; }
grep -E "megatron-core|verl_ops " "$OUT/setup.log" | head -4
wait "$te_pid"
grep -vE "^\s*$" "$OUT/te_setup.log" | tail -8
grep -q "te_setup rc=0" "$OUT/te_setup.log" || exit 1
echo "setup: $(( $(date +%s) - t0 )) s"
export PYTHONPATH="$PWD:$(cat /tmp/te_site/PYTHONPATH)"
# TE loads cuDNN from the system before Python packages: where the machine's own cuDNN differs from
# torch's (nvidia-cudnn-cu13) and torch has loaded its own first, TE's library fails to load
# (undefined cudnn symbols). CUDNN_HOME points TE at torch's.
CUDNN_HOME=$(python3 -c "import nvidia.cudnn as m; print(list(m.__path__)[0])" 2>/dev/null) && export CUDNN_HOME
[ -f /tmp/fa4/PYTHONPATH ] && export PYTHONPATH="$PYTHONPATH:$(cat /tmp/fa4/PYTHONPATH)"
status=0
for v in $MCORE; do
  t1=$(date +%s)
  PYTHONPATH="/tmp/mcore-$v:$PYTHONPATH" VERL_OPS_TEST_REPORT_DIR="$OUT" timeout "${TEST_TIMEOUT:-220}" \
    python3 -m pytest tests/test_megatron_te.py -q -p no:cacheprovider -rfEs ${PYTEST_ARGS:-} \
    > "$OUT/te_tests_$v.log" 2>&1; rc=$?
  echo "megatron-core $v: rc=$rc [$(( $(date +%s) - t1 )) s]"; [ $rc -eq 0 ] || status=1
  grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/te_tests_$v.log" | cut -c1-1500 | tail -8
done
echo "total: $(( $(date +%s) - t0 )) s"
exit $status
