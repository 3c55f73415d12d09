#!/usr/bin/env bash
# The SM90 forward kernel on its own (no torch, no build of the package): nvcc builds
# benchmarks/mla/harness/prof_mla_sm90.cu with csrc/mla/sm90/mla_sm90_fwd.cu (extra nvcc flags: NVCC_FLAGS, e.g.
# -D macros of an experiment), checks it against a naive fp32 reference on edge lengths, grouped
# heads and a ragged batch, then times forward TFLOP/s on an RL-like lognormal batch (16 and 128
# heads), 4 x 4096 (causal and full), 1 x 16384 and 64 short sequences. TRACE=1 adds where a
# tile's time goes (clock64 stamps per tile: waiting for Q, first S, first softmax, main loop,
# last PV, epilogue, gap to the next tile). NCU=1 adds an Nsight Compute profile of the 4 x 4096
# full-attention launch. On an H100 / H200:
#
#   bash benchmarks/mla/harness/prof_mla_sm90.sh
set -uo pipefail
cd "$(dirname "$0")/../../.."
BIN="${BIN:-/tmp/prof_mla_sm90}"
nvcc -std=c++17 -O3 -lineinfo -gencode arch=compute_90a,code=sm_90a -DVERL_OPS_HAS_SM90A ${NVCC_FLAGS:-} \
  benchmarks/mla/harness/prof_mla_sm90.cu csrc/mla/sm90/mla_sm90_fwd.cu -o "$BIN" || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader
SHORT=$(python3 -c "import random; random.seed(1); print(' '.join(str(random.randint(64, 1024)) for _ in range(64)))")
"$BIN" 2 1 1 0 1 2 127 128 129 300 1000 | grep CHECK
"$BIN" 3 0 1 0 0 5 300 0 77 | grep CHECK
HKDIV=2 "$BIN" 4 1 1 0 rl 7 | grep CHECK
for args in "16 1 0 20 rl 7" "128 1 0 5 rl 7" "16 1 0 20 4096 4096 4096 4096" "16 0 0 20 4096 4096 4096 4096" \
            "16 1 0 20 16384" "16 1 0 20 $SHORT"; do
  set -- $args
  echo "heads $1 causal $2 $(echo "${@:5}" | cut -c1-40): $("$BIN" "$@" | grep TIME)"
done
if [ "${TRACE:-0}" = 1 ]; then
  # Where a tile's time goes: a build with clock64 stamps (-DVERL_OPS_SM90_TRACE), one launch per batch.
  nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -DVERL_OPS_HAS_SM90A -DVERL_OPS_SM90_TRACE ${NVCC_FLAGS:-} \
    benchmarks/mla/harness/prof_mla_sm90.cu csrc/mla/sm90/mla_sm90_fwd.cu -o "$BIN.trace" || exit 1
  for args in "16 1 0 0 rl 7" "128 1 0 0 rl 7" "16 1 0 0 16384" "16 1 0 0 $SHORT"; do
    set -- $args
    echo "trace: heads $1 causal $2 $(echo "${@:5}" | cut -c1-40)"
    TRACE=1 "$BIN.trace" "$@" | grep TRACE
  done
fi
if [ "${NCU:-0}" = 1 ]; then
  ncu --kernel-name regex:mla_sm90 --launch-skip 2 --launch-count 1 --section SpeedOfLight \
    --section ComputeWorkloadAnalysis --section WarpStateStats "$BIN" 16 0 0 3 4096 4096 4096 4096
fi
