#!/usr/bin/env bash
# On a GPU machine without network: verl_ops inside megatron-core models built with
# TransformerEngine's specs, in one call.
#   TE          benchmarks/device/te_setup.sh from .te (carried), into /tmp/te_site; with
#               TE_SO_OUT=DIR the built extension is also kept there (te_setup.sh)
#   build/site  verl_ops built in place and megatron-core MCORE (default "0.16.1 0.19.2") + verl 0.9.1
#               from .whl (gpu_megatron.sh), at the same time as the TE build
#   tests       per megatron-core version: tests/test_megatron_te.py (CP = 1 on one GPU; CP = 2 over
#               NCCL where 2 GPUs are there), FlashAttention-4 on the path where /tmp/fa4/PYTHONPATH
#               exists (benchmarks/device/fa4_setup.sh); a JSON summary per test in $OUT
#   verl        where .vb is carried (verl's import-time dependencies as wheels, see below), or was
#               copied to /tmp/vb by an earlier call within the warm window (.vb does not fit into
#               one call beside .te, .whl and .cudnn_fe: carry [".vb"] alone and run
#               `rm -rf /tmp/vb && cp -r .vb /tmp/vb` first; VB=DIR names another folder): verl's own
#               engine forward with the plugin on and off, per version (VERL_ENGINE=0 skips it)
#   bench       with BENCH_MCORE="0.16.1 ...": bench_megatron_step.py --te per version at the hidden
#               sizes BENCH_TE_SIZES (default 4096; "4096 7168" for both);
#               with BENCH_LOCAL_MCORE="0.16.1 ...": the same bench on megatron-core's local specs at
#               BENCH_LOCAL_SIZES (default "4096 7168")
#   REUSE       auto (default): a call right after another (within the warm window) reuses its setup
# Carry: [".te", ".whl", ".cudnn_fe"]; ".vb" (for the verl step) in a call of its own before (see verl).
#
#   OUT=/some/dir bash benchmarks/device/gpu_te.sh
#   OUT=/some/dir MCORE=0.19.2 PYTEST_ARGS="-k context_parallel" bash benchmarks/device/gpu_te.sh
#   OUT=/some/dir MCORE=0.16.1 TE_TESTS=0 bash benchmarks/device/gpu_te.sh     # the verl step alone
#   PYTEST_ARGS_0_16_1="-k context_parallel": pytest arguments for one version only; TE_PROBE=0 skips
#   te_probe.py (which cuDNN TE loads, and whether its fused / flash attention runs 192/128 THD)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-./gpu_out}"; mkdir -p "$OUT"
MCORE="${MCORE:-0.16.1 0.19.2}"
t0=$(date +%s)
# A call that follows within the machine's warm window finds the last call's setup (/tmp and the
# in-place build survive): REUSE=auto (the default) keeps it where it was made from the same
# sources and carried wheels (a stamp of their contents, written once the setup succeeded).
stamp=$( { find csrc -type f | sort | xargs sha1sum; sha1sum setup.py .te/* .whl/*; echo "$MCORE"; } 2>/dev/null \
  | sha1sum | cut -c1-40)
if [ "${REUSE:-auto}" = auto ] && [ "$(cat /tmp/gpu_te.stamp 2>/dev/null)" = "$stamp" ] \
   && [ -f /tmp/te_site/PYTHONPATH ] && ls verl_ops/_C*.so > /dev/null 2>&1; then
  echo "setup: reused (TE in /tmp/te_site, megatron-core in /tmp/mcore-*, verl_ops built in place: same sources)"
else
rm -f /tmp/gpu_te.stamp
( OUT="$OUT" MAX_JOBS="${TE_JOBS:-12}" bash benchmarks/device/te_setup.sh > "$OUT/te_setup.log" 2>&1
  echo "te_setup rc=$?" >> "$OUT/te_setup.log" ) &
te_pid=$!
OUT="$OUT" MCORE="$MCORE" STEPS="build site" MAX_JOBS="${BUILD_JOBS:-8}" bash benchmarks/device/gpu_megatron.sh \
  > "$OUT/setup.log" 2>&1 || { tail -30 "$OUT/setup.log"; exit 1; }
grep -E "megatron-core|verl_ops " "$OUT/setup.log" | head -4
wait "$te_pid"
grep -vE "^\s*$" "$OUT/te_setup.log" | tail -8
grep -q "te_setup rc=0" "$OUT/te_setup.log" || exit 1
echo "$stamp" > /tmp/gpu_te.stamp
echo "setup: $(( $(date +%s) - t0 )) s"
fi
export PYTHONPATH="$PWD:$(cat /tmp/te_site/PYTHONPATH)"
# TE's core library names every cuDNN library (libcudnn_graph, _heuristic, ...) as a dependency, without
# a search path: each one not yet loaded is looked up by name, and on this machine that finds the
# system's cuDNN in /lib/x86_64-linux-gnu, which differs from torch's (nvidia-cudnn-cu13). Once a
# process has loaded part of torch's cuDNN, TE's import then fails ("libcudnn_heuristic.so.9:
# undefined symbol ..., version libcudnn_graph.so.9"). torch's cuDNN folder first on the library
# path makes every lookup find torch's.
CUDNN_LIB=$(python3 -c "import os, nvidia.cudnn as m; print(os.path.join(list(m.__path__)[0], 'lib'))" 2>/dev/null) \
  && export LD_LIBRARY_PATH="$CUDNN_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# TE loads libcudnn.so itself before its core library, from CUDNN_HOME first (then CUDA_HOME,
# /usr/local/cuda, the library path): pointing it at torch's cuDNN makes that one torch's too.
if [ -n "${CUDNN_LIB:-}" ]; then
  [ -n "${CUDNN_HOME:-}" ] && echo "CUDNN_HOME was $CUDNN_HOME: set to torch's cuDNN instead"
  export CUDNN_HOME="$(dirname "$CUDNN_LIB")"
fi
[ -f /tmp/fa4/PYTHONPATH ] && export PYTHONPATH="$PYTHONPATH:$(cat /tmp/fa4/PYTHONPATH)"
if [ "${TE_PROBE:-1}" = 1 ]; then
  python3 benchmarks/device/te_probe.py > "$OUT/te_probe.txt" 2>&1; echo "te_probe rc=$?"
  grep -E "^(after|env|torch|fused|flash)|Disabling" "$OUT/te_probe.txt" | cut -c1-700 | head -20
fi
status=0
# pytest arguments, as the shell would split them (quotes kept): PYTEST_ARGS for every version,
# PYTEST_ARGS_<version, "." and "-" as "_"> for one
args_of() { local var="$1"; eval "ARGS=(${!var:-})"; }
for v in $MCORE; do
  [ "${TE_TESTS:-1}" = 1 ] || break
  t1=$(date +%s)
  args_of PYTEST_ARGS; all=(${ARGS[@]+"${ARGS[@]}"}); args_of "PYTEST_ARGS_${v//[.-]/_}"; all+=(${ARGS[@]+"${ARGS[@]}"})
  PYTHONPATH="/tmp/mcore-$v:$PYTHONPATH" VERL_OPS_TEST_REPORT_DIR="$OUT" timeout "${TEST_TIMEOUT:-420}" \
    python3 -m pytest tests/test_megatron_te.py -q -p no:cacheprovider -rfEs ${all[@]+"${all[@]}"} \
    > "$OUT/te_tests_$v.log" 2>&1; rc=$?
  echo "megatron-core $v: rc=$rc [$(( $(date +%s) - t1 )) s]"; [ $rc -eq 0 ] || status=1
  grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/te_tests_$v.log" | cut -c1-1500 | tail -8
done
if [ -n "${VB:-}" ]; then [ -d "$VB" ] || echo "VB=$VB: no such folder (verl's engine test not run)"
else VB=.vb; [ -d "$VB" ] || [ ! -d /tmp/vb ] || VB=/tmp/vb; fi
if [ -d "$VB" ] && [ "${VERL_ENGINE:-1}" = 1 ]; then
  VB="$(cd "$VB" && pwd)"; echo "verl's dependencies from $VB"
  # verl's own engine forward with the plugin on and off (tests/test_verl_plugin.py -k engine_forward):
  # verl's import-time dependencies from .vb (carried: tensordict, omegaconf, codetiming, orjson,
  # cloudpickle, pyvers, mbridge; .vb/stubs holds an import-only stand-in for ray), and verl_ops'
  # entry point (verl loads "verl.plugins" entry points; this in-place build has no metadata).
  rm -rf /tmp/vbsite
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vbsite "$VB"/*.whl \
    > "$OUT/vbsite.log" 2>&1 || tail -5 "$OUT/vbsite.log"
  mkdir -p /tmp/vbsite/verl_ops-0.1.0.dist-info
  printf 'Metadata-Version: 2.1\nName: verl_ops\nVersion: 0.1.0\n' > /tmp/vbsite/verl_ops-0.1.0.dist-info/METADATA
  printf '[verl.plugins]\nverl_ops = verl_ops_plugin\n' > /tmp/vbsite/verl_ops-0.1.0.dist-info/entry_points.txt
  for v in $MCORE; do
    t1=$(date +%s)
    PYTHONPATH="/tmp/mcore-$v:/tmp/vbsite:$VB/stubs:$PYTHONPATH" VERL_OPS_REQUIRE_VERL=1 \
      VERL_OPS_TEST_REPORT_DIR="$OUT" timeout "${VERL_TIMEOUT:-300}" \
      python3 -m pytest tests/test_verl_plugin.py -k engine_forward_on_te_specs -q -p no:cacheprovider -rfEs \
      > "$OUT/verl_engine_$v.log" 2>&1; rc=$?
    echo "verl engine forward, megatron-core $v: rc=$rc [$(( $(date +%s) - t1 )) s]"; [ $rc -eq 0 ] || status=1
    grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/verl_engine_$v.log" | cut -c1-1500 | tail -6
  done
fi
# One bench_megatron_step.py run under megatron-core VERSION: bench NAME VERSION ARGS... (its log and
# JSON: $OUT/NAME.log / .json; the tables from "## Step time" on are printed)
bench() {
  local name="$1" v="$2" t1 rc; shift 2; t1=$(date +%s)
  PYTHONPATH="/tmp/mcore-$v:$PYTHONPATH" timeout "${BENCH_TIMEOUT:-240}" python3 benchmarks/megatron/bench_megatron_step.py \
    "$@" --out "$OUT/$name.json" ${BENCH_ARGS:---reps 5 --warmup 2} > "$OUT/$name.log" 2>&1; rc=$?
  echo "$name (megatron-core $v): rc=$rc [$(( $(date +%s) - t1 )) s]"; [ $rc -eq 0 ] || status=1
  grep -vE "^\s*$" "$OUT/$name.log" | grep -v Warning | grep -A60 "^## Step time" | head -60
}
# the step on TE's specs: verl's path with TE flash / fused attention against verl_ops
# (JSON / log: step_te_VERSION at hidden 4096, step_te_VERSION_SIZE at any other size)
for v in ${BENCH_MCORE:-}; do
  for z in ${BENCH_TE_SIZES:-4096}; do
    name="step_te_$v"; [ "$z" = 4096 ] || name="step_te_${v}_$z"
    bench "$name" "$v" --te --sizes "$z"
  done
done
# the step on megatron-core's local specs (issue 42's table), verl_fa4 included where /tmp/fa4 is
for v in ${BENCH_LOCAL_MCORE:-}; do
  for z in ${BENCH_LOCAL_SIZES:-4096 7168}; do bench "step_local_${v}_$z" "$v" --sizes "$z"; done
done
echo "total: $(( $(date +%s) - t0 )) s"
exit $status
