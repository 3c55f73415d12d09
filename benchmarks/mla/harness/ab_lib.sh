# Shared by benchmarks/mla/harness/prof_mla_sm90_ab.sh and prof_mla_sm90_bwd_ab.sh (sourced, from the
# repository root): build the variants, check them, time the ones that passed, report the medians.
# State: `names` (the variants), `failed`, and the caller's DIR, RUN_S, ROUNDS and `batches`. A variant that fails or hangs on a check is not timed (a hang would cost RUN_S on every
# timed run).

# ab_build HARNESS EXTRA NAME=SOURCE[@NVCC_FLAGS] ...: builds each variant in the background (HARNESS,
# SOURCE, then EXTRA, a source every variant shares or ""), into $DIR/NAME; exit 1 when one fails.
ab_build() {
  local harness="$1" extra="$2" spec name rest src flags
  shift 2
  names=()
  for spec in "$@"; do
    name="${spec%%=*}"; rest="${spec#*=}"
    src="${rest%%@*}"; flags=""
    [ "$rest" != "$src" ] && flags="${rest#*@}"
    names+=("$name")
    nvcc -std=c++17 -O3 -lineinfo -gencode arch=compute_90a,code=sm_90a -DVERL_OPS_HAS_SM90A -I csrc/mla/sm90 $flags \
      "$harness" "$src" $extra -o "$DIR/$name" > "$DIR/$name.build.log" 2>&1 &
  done
  wait
  for name in "${names[@]}"; do
    [ -x "$DIR/$name" ] || { echo "$name: build failed"; cat "$DIR/$name.build.log"; exit 1; }
  done
}

# ab_note_check NAME OUTPUT: NAME goes into `failed` unless OUTPUT (a check's lines) has a
# "CHECK ok" line and no "CHECK FAIL" or "CUDA" error line.
ab_note_check() {
  if ! grep -q "^CHECK ok" <<< "$2" || grep -qE "^CHECK FAIL|^CUDA" <<< "$2"; then failed+=("$1"); fi
}

# ab_check: every variant on the checks (edge lengths causal, non-causal with empty sequences,
# grouped heads on an RL-like batch), each cut off after RUN_S; MEMCHECK=NAME also runs the first
# two under compute-sanitizer memcheck.
ab_check() {
  local name c r
  local checks=("2 1 1 0 1 2 127 128 129 300 1000" "3 0 1 0 0 5 300 0 77" "4 1 1 0 rl 7")
  failed=()
  for name in "${names[@]}"; do
    for c in "${checks[@]}"; do
      if [ "$c" = "4 1 1 0 rl 7" ]; then r=$(HKDIV=2 timeout "$RUN_S" "$DIR/$name" $c | grep -E "CHECK|worst|CUDA"); else r=$(timeout "$RUN_S" "$DIR/$name" $c | grep -E "CHECK|worst|CUDA"); fi
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
}

# ab_keep_checked: `names` without the ones in `failed` (each reported); exit 1 when none is left.
ab_keep_checked() {
  local timed=() name
  for name in "${names[@]}"; do
    if [[ " ${failed[*]} " == *" $name "* ]]; then echo "$name: a check failed, not timed"; else timed+=("$name"); fi
  done
  [ "${#timed[@]}" -gt 0 ] || exit 1
  names=("${timed[@]}")
}

# ab_time: ROUNDS rounds over `batches` (LABEL|ARGS), the variants interleaved within a round so
# that clock drift hits them alike; each run's TFLOP/s into $DIR/times.txt.
ab_time() {
  local r b label args name t
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
}

# ab_report WHAT: each variant's median TFLOP/s per batch and its ratio to the first variant's
# (WHAT: forward or backward).
ab_report() {
  python3 - "$1" "$DIR/times.txt" "${names[@]}" <<'EOF_PY'
import statistics, sys
what, path, names = sys.argv[1], sys.argv[2], sys.argv[3:]
rows = [l.split() for l in open(path) if len(l.split()) == 3]
labels = list(dict.fromkeys(r[1] for r in rows))
print(f"median {what} TFLOP/s (" + ", ".join(names) + "; ratio to the first)")
for lab in labels:
    med = {n: statistics.median([float(r[2]) for r in rows if r[0] == n and r[1] == lab] or [float("nan")]) for n in names}
    base = med[names[0]]
    print(f"{lab:10s} " + "  ".join(f"{n} {med[n]:6.1f} ({med[n] / base:.3f}x)" for n in names))
EOF_PY
}
