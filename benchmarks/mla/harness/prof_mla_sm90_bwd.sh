#!/usr/bin/env bash
# The SM90 backward kernel on its own (no torch, no build of the package): nvcc builds
# benchmarks/mla/harness/prof_mla_sm90_bwd.cu with csrc/mla/sm90/mla_sm90_bwd.cu and the forward (for O and the
# log-sum-exp), checks dQ / dK / dV against a naive fp32 reference on edge lengths (causal, and
# non-causal with empty sequences), grouped heads and a ragged batch, then times the backward on
# an RL-like lognormal batch (16 and 128 heads), 4 x 4096, 1 x 16384 and 64 short sequences.
# Extra nvcc flags: NVCC_FLAGS. MEMCHECK=1 runs the edge checks under compute-sanitizer memcheck.
#
#   bash benchmarks/mla/harness/prof_mla_sm90_bwd.sh
set -uo pipefail
cd "$(dirname "$0")/../../.."
BIN="${BIN:-/tmp/prof_mla_sm90_bwd}"
nvcc -std=c++17 -O3 -lineinfo -gencode arch=compute_90a,code=sm_90a -DVERL_OPS_HAS_SM90A ${NVCC_FLAGS:-} \
  benchmarks/mla/harness/prof_mla_sm90_bwd.cu csrc/mla/sm90/mla_sm90_bwd.cu csrc/mla/sm90/mla_sm90_fwd.cu -o "$BIN" || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader
RUN_S="${RUN_S:-20}"
checks=("2 1 1 0 1 2 127 128 129 300 1000" "3 0 1 0 0 5 300 0 77" "2 1 1 0 64 65 200 513")
for c in "${checks[@]}"; do echo "check [$c]: $(timeout "$RUN_S" "$BIN" $c | grep -E "CHECK|worst|CUDA")"; done
echo "check [4 1 1 0 rl 7, HKDIV=2]: $(HKDIV=2 timeout "$RUN_S" "$BIN" 4 1 1 0 rl 7 | grep -E "CHECK|worst|CUDA")"
if [ "${MEMCHECK:-0}" = 1 ]; then
  for c in "${checks[@]:0:2}"; do
    echo "memcheck [$c]: $(timeout $((4 * RUN_S)) compute-sanitizer --tool memcheck "$BIN" $c 2>&1 | grep -E "CHECK|ERROR SUMMARY" | tr '\n' ' ')"
  done
fi
SHORT=$(python3 -c "import random; random.seed(1); print(' '.join(str(random.randint(64, 1024)) for _ in range(64)))")
for args in "16 1 0 10 rl 7" "128 1 0 3 rl 7" "16 1 0 10 4096 4096 4096 4096" "16 1 0 10 16384" "16 1 0 10 $SHORT"; do
  set -- $args
  echo "heads $1 causal $2 $(echo "${@:5}" | cut -c1-40): $(timeout "$RUN_S" "$BIN" "$@" | grep -E "TIME|CUDA")"
done
if [ "${NCU:-0}" = 1 ]; then
  ncu --kernel-name regex:mla_sm90_bwd --launch-skip 1 --launch-count 1 --section SpeedOfLight \
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats \
    --section InstructionStats "$BIN" 16 1 0 2 rl 7
fi
