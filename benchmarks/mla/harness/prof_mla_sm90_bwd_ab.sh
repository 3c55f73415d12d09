#!/usr/bin/env bash
# A / B of SM90 backward kernel variants on one GPU, in one call (no torch, no package build):
# each variant is built with benchmarks/mla/harness/prof_mla_sm90_bwd.cu (and the forward, for O and the
# log-sum-exp), checked against the naive fp32 reference (edge lengths causal, non-causal with
# empty sequences, grouped heads on an RL-like batch), then timed ROUNDS times (default 3) per
# batch, the variants interleaved within a round. Prints each variant's median backward TFLOP/s.
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
names=()
for spec in "$@"; do
  name="${spec%%=*}"; rest="${spec#*=}"
  src="${rest%%@*}"; flags=""
  [ "$rest" != "$src" ] && flags="${rest#*@}"
  names+=("$name")
  nvcc -std=c++17 -O3 -lineinfo -gencode arch=compute_90a,code=sm_90a -DVERL_OPS_HAS_SM90A -I csrc/mla/sm90 $flags \
    benchmarks/mla/harness/prof_mla_sm90_bwd.cu "$src" csrc/mla/sm90/mla_sm90_fwd.cu -o "$DIR/$name" > "$DIR/$name.build.log" 2>&1 &
done
wait
for name in "${names[@]}"; do
  [ -x "$DIR/$name" ] || { echo "$name: build failed"; tail -20 "$DIR/$name.build.log"; exit 1; }
done
checks=("2 1 1 0 1 2 127 128 129 300 1000" "3 0 1 0 0 5 300 0 77" "4 1 1 0 rl 7")
failed=()
for name in "${names[@]}"; do
  for c in "${checks[@]}"; do
    if [ "$c" = "4 1 1 0 rl 7" ]; then r=$(HKDIV=2 timeout "$RUN_S" "$DIR/$name" $c | grep -E "CHECK|worst|CUDA"); else r=$(timeout "$RUN_S" "$DIR/$name" $c | grep -E "CHECK|worst|CUDA"); fi
    [ -n "$r" ] || r="no CHECK line (crashed or timed out after ${RUN_S} s)"
    echo "$name check [$c]: $r"
    ab_note_check "$name" "$r"
  done
done
ab_keep_checked
SHORT=$(python3 -c "import random; random.seed(1); print(' '.join(str(random.randint(64, 1024)) for _ in range(64)))")
batches=("rl-H16|16 1 0 10 rl 7" "rl-H128|128 1 0 ${H128_REPS:-3} rl 7" "4x4096|16 1 0 10 4096 4096 4096 4096"
         "1x16384|16 1 0 10 16384" "16x1024|16 1 0 10 1024 1024 1024 1024 1024 1024 1024 1024 1024 1024 1024 1024 1024 1024 1024 1024"
         "64short|16 1 0 10 $SHORT")
: > "$DIR/times.txt"
for ((r = 0; r < ROUNDS; ++r)); do
  for b in "${batches[@]}"; do
    label="${b%%|*}"; args="${b#*|}"
    for name in "${names[@]}"; do
      t=$(timeout "$RUN_S" "$DIR/$name" $args | grep TIME | awk '{print $4}')
      [ -n "$t" ] && echo "$name $label $t" >> "$DIR/times.txt"
    done
  done
done
python3 - "$DIR/times.txt" "${names[@]}" <<'PY'
import collections, statistics, sys
path, names = sys.argv[1], sys.argv[2:]
t = collections.defaultdict(list)
labels = []
for line in open(path):
    n, label, v = line.split()
    t[(n, label)].append(float(v))
    if label not in labels:
        labels.append(label)
print(f"median backward TFLOP/s ({', '.join(names)}; ratio to the first)")
for label in labels:
    base = statistics.median(t[(names[0], label)]) if t[(names[0], label)] else float("nan")
    cells = []
    for n in names:
        v = statistics.median(t[(n, label)]) if t[(n, label)] else float("nan")
        cells.append(f"{n} {v:6.1f} ({v / base:.3f}x)")
    print(f"{label:10s} " + "  ".join(cells))
PY
