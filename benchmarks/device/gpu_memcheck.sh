#!/usr/bin/env bash
# On a GPU machine: compute-sanitizer memcheck over every CUDA test of the suites in SUITES, each
# suite cut into shards (its collected CUDA test ids split round-robin) so that a whole run fits
# one call; PARALLEL shards at a time (memcheck is mostly host-bound). Builds first (in place, with
# the cuDNN frontend headers from .cudnn_fe/include where carried). megatron-core 0.16.1 and verl
# 0.9.1 are unpacked from .whl/ where carried (for test_megatron_model and the real-model cases of
# test_mla_fp32). Logs per shard and a summary (memcheck.txt) go to ${OUT:-./gpu_out}.
#
#   SUITES="thd:4 mla_varlen:2 mla" PARALLEL=8 SHARD_TIMEOUT=500 bash benchmarks/device/gpu_memcheck.sh
#
# A suite is the stem of tests/test_<stem>.py, optionally ":N" shards. CUDA tests: those whose
# name or markers match K (default "cuda or gpu"), torch.compile cases included.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-./gpu_out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SUITES="${SUITES:-thd:4 mla_varlen:2 mla:2 mla_sm90 jagged router merge_ops rope mla_fp32 megatron_model}"
K="${K:-cuda or gpu}"
nvidia-smi -L | tee "$OUT/device.txt"

t0=$(date +%s)
if [ "${BUILD:-1}" = 1 ]; then
  [ -d .cudnn_fe/include ] && export CUDNN_FRONTEND_INCLUDE="$PWD/.cudnn_fe/include"
  CUDNN_SITE=$(python3 -c "import os, nvidia.cudnn as m; p = os.path.join(list(m.__path__)[0], 'include'); print(p if os.path.isfile(os.path.join(p, 'cudnn.h')) else '')" 2>/dev/null)
  export CUDNN_INCLUDE="${CUDNN_SITE:-$PWD/.cudnn_fe/include}"
  MAX_JOBS="${MAX_JOBS:-16}" TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" \
    python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
  echo "build: $(( $(date +%s) - t0 )) s"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/megatron_core-0.16.1-*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mcore-site \
    .whl/megatron_core-0.16.1-*.whl .whl/verl-0.9.1-*.whl > "$OUT/site.log" 2>&1 || tail -5 "$OUT/site.log"
  export PYTHONPATH="$PYTHONPATH:/tmp/mcore-site"
fi
python3 -c "import verl_ops; assert verl_ops.cuda_available(); print('verl_ops', verl_ops.mla_cache_info()['hopper_forward'])" || exit 1

# The shards: one file of test ids each (the suites collected in parallel), in a folder of this run's
# own (two runs side by side must not share one).
SHARDS=$(mktemp -d /tmp/memcheck_shards.XXXXXX); export SHARDS
collect() {
  local entry="$1" suite n total i
  suite="${entry%%:*}"; n=1; [ "$entry" != "$suite" ] && n="${entry##*:}"
  python3 -m pytest "tests/test_${suite}.py" -q --collect-only -k "$K" -p no:cacheprovider 2>/dev/null \
    | grep "::" > "$SHARDS/${suite}.ids"
  total=$(wc -l < "$SHARDS/${suite}.ids")
  for ((i = 0; i < n; i++)); do
    awk -v n="$n" -v i="$i" 'NR % n == i' "$SHARDS/${suite}.ids" > "$SHARDS/${suite}.${i}"
  done
  rm "$SHARDS/${suite}.ids"
  echo "${suite}: ${total} CUDA tests in ${n} shard(s)"
}
export -f collect; export K
printf '%s\n' $SUITES | xargs -P 16 -I{} bash -c 'collect "$1"' _ {} | sort | tee "$OUT/shards.txt"

one() {
  local shard="$1" name t0 rc
  name=$(basename "$shard")
  t0=$(date +%s)
  [ -s "$shard" ] || { echo "${name}: no tests"; return 0; }
  local ids suite frac; mapfile -t ids < "$shard"
  # Each shard's share of the GPU's memory (FRACTION_<suite>, default FRACTION, 0.04): shards run
  # side by side on one GPU, and torch's caching allocator would otherwise hold what another needs.
  suite="${name%.*}"; frac="FRACTION_${suite}"; frac="${!frac:-${FRACTION:-0.04}}"
  VERL_OPS_TEST_CUDA_MEMORY_FRACTION="$frac" timeout "${SHARD_TIMEOUT:-500}" compute-sanitizer --tool memcheck --error-exitcode 9 \
    python3 -m pytest "${ids[@]}" -q -p no:cacheprovider > "$OUT/memcheck_${name}.log" 2>&1; rc=$?
  echo "${name}: rc=${rc} $(grep -E 'ERROR SUMMARY' "$OUT/memcheck_${name}.log" | tail -1) $(tail -1 "$OUT/memcheck_${name}.log" | grep -E 'passed|failed|error') [$(( $(date +%s) - t0 )) s]"
}
export -f one; export OUT SHARD_TIMEOUT
ls $SHARDS/* | xargs -P "${PARALLEL:-8}" -I{} bash -c 'one "$1"' _ {} | sort | tee "$OUT/memcheck.txt"
# Logs of the shards come back in one file (the tool returns at most 8 files).
for f in "$OUT"/memcheck_*.log; do
  echo "==== $f"
  # the kinds of error reported (first line of each report, addresses and sizes blanked), counted
  grep -E "^========= [A-Z]" "$f" | grep -v "ERROR SUMMARY" | sed -E 's/0x[0-9a-f]+/X/g; s/[0-9]+ bytes/N bytes/g' | sort | uniq -c | sort -rn | head -15
  grep -E "ERROR SUMMARY|^(FAILED|ERROR) |passed|failed" "$f" | tail -12
  echo "memory-access errors: $(grep -cE "^========= (Invalid|Misaligned|Out-of-range|Uninitialized|Race)" "$f")," \
    "CUDA API errors: $(grep -cE "^========= Program hit" "$f")"
  grep -m3 -A8 -E "^========= (Invalid|Misaligned|Out-of-range|Uninitialized|Race)" "$f"
  # the first CUDA API error with its host backtrace (which library made the call)
  grep -m1 -A24 -E "^========= Program hit" "$f"
  # why a test failed (pytest's E lines)
  grep -m12 -E "^E  " "$f"
done > "$OUT/memcheck_logs.txt"
rm -f "$OUT"/memcheck_*.log
echo "total: $(( $(date +%s) - t0 )) s"
grep -qv "rc=0 " "$OUT/memcheck.txt" && exit 1
exit 0
