# Shared by benchmarks/device/gpu_mla.sh, gpu_dist.sh and gpu_megatron.sh (sourced from the
# repository root after DEADLINE is set): logs and tables go to ${OUT:-./gpu_out}, Python output is
# unbuffered, and a whole script stays within DEADLINE seconds of the moment this file is sourced.
OUT="${OUT:-./gpu_out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
START=$(date +%s)
left() { echo $(( DEADLINE - ($(date +%s) - START) )); }
# cap SECONDS: the smaller of SECONDS and the time left before the deadline (at least 10).
cap() { local l; l=$(left); [ "$l" -lt "$1" ] && echo $(( l > 10 ? l : 10 )) || echo "$1"; }
step() { echo; echo "=== $1 (t=$(( $(date +%s) - START )) s, $(left) s left)"; }
# want STEP: whether STEP is named in STEPS (" step1 step2 ", set by the script).
want() { [[ "$STEPS" == *" $1 "* ]]; }
