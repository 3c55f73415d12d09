# Shared by benchmarks/device/gpu_mla.sh and gpu_dist.sh (sourced after DEADLINE is set): a whole script
# stays within DEADLINE seconds of the moment this file is sourced.
START=$(date +%s)
left() { echo $(( DEADLINE - ($(date +%s) - START) )); }
# cap SECONDS: the smaller of SECONDS and the time left before the deadline (at least 10).
cap() { local l; l=$(left); [ "$l" -lt "$1" ] && echo $(( l > 10 ? l : 10 )) || echo "$1"; }
step() { echo; echo "=== $1 (t=$(( $(date +%s) - START )) s, $(left) s left)"; }
