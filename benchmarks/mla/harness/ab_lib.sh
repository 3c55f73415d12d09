# Shared by benchmarks/mla/harness/prof_mla_sm90_ab.sh and prof_mla_sm90_bwd_ab.sh (sourced): which variants
# the timing rounds leave out. A variant that fails or hangs on a check is not timed (a hang
# would cost RUN_S on every timed run).

# ab_note_check NAME OUTPUT: NAME goes into `failed` unless OUTPUT (a check's lines) has a
# "CHECK ok" line and no "CHECK FAIL" or "CUDA" error line.
ab_note_check() {
  if ! grep -q "^CHECK ok" <<< "$2" || grep -qE "^CHECK FAIL|^CUDA" <<< "$2"; then failed+=("$1"); fi
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
