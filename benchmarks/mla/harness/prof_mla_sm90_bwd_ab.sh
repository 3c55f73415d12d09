#!/usr/bin/env bash
# A / B of SM90 backward kernel variants on one GPU, in one call (no torch, no package build):
# each variant is built with benchmarks/mla/harness/prof_mla_sm90_bwd.cu (and the forward, for O and the
# log-sum-exp), checked against the naive fp32 reference (edge lengths causal, non-causal with
# empty sequences, grouped heads on an RL-like batch), then timed ROUNDS times (default 3) per
# batch, the variants interleaved within a round. Prints each variant's median backward TFLOP/s.
# MEMCHECK=NAME also runs that variant's checks under compute-sanitizer memcheck.
# A variant that fails a check (or crashes, or hangs past RUN_S) is reported and not timed.
#
#   bash benchmarks/mla/harness/prof_mla_sm90_bwd_ab.sh NAME=SOURCE[@NVCC_FLAGS] ...
#   e.g. git archive main csrc | tar -x -C /tmp/base   (a variant: a whole copy of the sources)
#        bash benchmarks/mla/harness/prof_mla_sm90_bwd_ab.sh base=/tmp/base/csrc/mla/sm90/mla_sm90_bwd.cu \
#          new=csrc/mla/sm90/mla_sm90_bwd.cu
# (a SOURCE includes the headers of its own folder; the forward is always this tree's).
set -uo pipefail
cd "$(dirname "$0")/../../.."
source benchmarks/mla/harness/ab_lib.sh
ROUNDS="${ROUNDS:-3}"
RUN_S="${RUN_S:-20}"
DIR="${AB_DIR:-/tmp/prof_bwd_ab}"
mkdir -p "$DIR"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
ab_build benchmarks/mla/harness/prof_mla_sm90_bwd.cu csrc/mla/sm90/mla_sm90_fwd.cu "$@"
ab_check
ab_keep_checked
SHORT=$(python3 -c "import random; random.seed(1); print(' '.join(str(random.randint(64, 1024)) for _ in range(64)))")
batches=("rl-H16|16 1 0 10 rl 7" "rl-H128|128 1 0 ${H128_REPS:-3} rl 7" "4x4096|16 1 0 10 4096 4096 4096 4096"
         "1x16384|16 1 0 10 16384" "16x1024|16 1 0 10 1024 1024 1024 1024 1024 1024 1024 1024 1024 1024 1024 1024 1024 1024 1024 1024"
         "64short|16 1 0 10 $SHORT")
ab_time
ab_report backward
