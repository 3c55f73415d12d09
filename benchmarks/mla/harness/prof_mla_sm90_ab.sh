#!/usr/bin/env bash
# A / B of SM90 forward kernel variants on one GPU, in one call (no torch, no package build):
# each variant is built with benchmarks/mla/harness/prof_mla_sm90.cu, checked against its naive fp32
# reference (edge lengths causal, non-causal with empty sequences, grouped heads on an RL-like
# batch), then timed ROUNDS times (default 3) on each batch, the variants interleaved within a
# round so that clock drift hits them alike. Prints each variant's median forward TFLOP/s per
# batch. MEMCHECK=NAME also runs that variant's checks under compute-sanitizer memcheck. A variant
# that fails a check (or crashes, or hangs past RUN_S) is reported and not timed.
#
#   bash benchmarks/mla/harness/prof_mla_sm90_ab.sh NAME=SOURCE[@NVCC_FLAGS] ...
#   e.g. git archive main csrc | tar -x -C /tmp/base   (a variant: a whole copy of the sources)
#        bash benchmarks/mla/harness/prof_mla_sm90_ab.sh base=/tmp/base/csrc/mla/sm90/mla_sm90_fwd.cu \
#          new=csrc/mla/sm90/mla_sm90_fwd.cu "nofence=csrc/mla/sm90/mla_sm90_fwd.cu@-DVERL_OPS_SM90_NO_SOFTMAX_FENCE"
# (a SOURCE includes the headers of its own folder, the kernel's pieces; a lone file elsewhere finds
# mla_sm90_fwd.h through -I csrc/mla/sm90).
set -uo pipefail
cd "$(dirname "$0")/../../.."
source benchmarks/mla/harness/ab_lib.sh
ROUNDS="${ROUNDS:-3}"
RUN_S="${RUN_S:-60}"  # a variant that hangs (a barrier protocol bug) is cut off, not the call
DIR="${AB_DIR:-/tmp/prof_ab}"
mkdir -p "$DIR"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
ab_build benchmarks/mla/harness/prof_mla_sm90.cu "" "$@"
ab_check
ab_keep_checked
SHORT=$(python3 -c "import random; random.seed(1); print(' '.join(str(random.randint(64, 1024)) for _ in range(64)))")
batches=("rl-H16|16 1 0 20 rl 7" "rl-H128|128 1 0 ${H128_REPS:-5} rl 7" "4x4096|16 1 0 20 4096 4096 4096 4096"
         "4x4096full|16 0 0 20 4096 4096 4096 4096"
         "1x16384|16 1 0 20 16384" "64short|16 1 0 20 $SHORT")
ab_time
ab_report forward
