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
names=()
for spec in "$@"; do
  name="${spec%%=*}"; rest="${spec#*=}"
  src="${rest%%@*}"; flags=""
  [ "$rest" != "$src" ] && flags="${rest#*@}"
  names+=("$name")
  nvcc -std=c++17 -O3 -lineinfo -gencode arch=compute_90a,code=sm_90a -DVERL_OPS_HAS_SM90A -I csrc/mla/sm90 $flags \
    benchmarks/mla/harness/prof_mla_sm90.cu "$src" -o "$DIR/$name" > "$DIR/$name.build.log" 2>&1 &
done
wait
for name in "${names[@]}"; do
  [ -x "$DIR/$name" ] || { echo "$name: build failed"; cat "$DIR/$name.build.log"; exit 1; }
done
checks=("2 1 1 0 1 2 127 128 129 300 1000" "3 0 1 0 0 5 300 0 77" "4 1 1 0 rl 7")
failed=()
for name in "${names[@]}"; do
  for c in "${checks[@]}"; do
    if [ "$c" = "4 1 1 0 rl 7" ]; then r=$(HKDIV=2 timeout "$RUN_S" "$DIR/$name" $c | grep CHECK); else r=$(timeout "$RUN_S" "$DIR/$name" $c | grep CHECK); fi
    [ -n "$r" ] || r="no CHECK line (crashed or timed out after ${RUN_S} s)"
    echo "$name check [$c]: $r"
    ab_note_check "$name" "$r"
  done
  if [ "${MEMCHECK:-}" = "$name" ]; then
    for c in "${checks[@]:0:2}"; do
      timeout $((4 * RUN_S)) compute-sanitizer --tool memcheck "$DIR/$name" $c 2>&1 | grep -E "CHECK|ERROR SUMMARY" | sed "s/^/$name memcheck [$c]: /"
    done
  fi
done
ab_keep_checked
SHORT=$(python3 -c "import random; random.seed(1); print(' '.join(str(random.randint(64, 1024)) for _ in range(64)))")
batches=("rl-H16|16 1 0 20 rl 7" "rl-H128|128 1 0 ${H128_REPS:-5} rl 7" "4x4096|16 1 0 20 4096 4096 4096 4096"
         "4x4096full|16 0 0 20 4096 4096 4096 4096"
         "1x16384|16 1 0 20 16384" "64short|16 1 0 20 $SHORT")
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
python3 - "$DIR/times.txt" "${names[@]}" <<'EOF'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1]) if len(l.split()) == 3]
names = sys.argv[2:]
labels = list(dict.fromkeys(r[1] for r in rows))
print("median forward TFLOP/s (" + ", ".join(names) + "; ratio to the first)")
for lab in labels:
    med = {n: statistics.median([float(r[2]) for r in rows if r[0] == n and r[1] == lab] or [float("nan")]) for n in names}
    base = med[names[0]]
    print(f"{lab:10s} " + "  ".join(f"{n} {med[n]:6.1f} ({med[n] / base:.3f}x)" for n in names))
EOF
