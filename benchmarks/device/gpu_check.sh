#!/usr/bin/env bash
# On a GPU machine: build, run the test suite (GPU cases included), compute-sanitizer memcheck on
# the CUDA tests of each suite, then the benchmarks named in BENCH (default: none; e.g.
# BENCH="thd mla router": benchmarks/*/bench_<name>.py). Logs and results go to ${OUT:-./gpu_out}.
# FILES_PARALLEL=N runs the test files as N parallel pytest processes instead of one (see below);
# SANITIZE_PARALLEL=N runs N memcheck suites at a time.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-./gpu_out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi -L | tee "$OUT/device.txt"
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)" | tee -a "$OUT/device.txt"

t0=$(date +%s)
REPO="$(pwd)"
if [ "${WHEEL:-0}" = 1 ]; then
  # The binary wheel built against this machine's torch, installed as a user would; the tests run
  # from outside the tree so that `import verl_ops` finds the installed package.
  rm -rf "$OUT/wheel" && mkdir -p "$OUT/wheel"
  TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-16}" \
    python3 -m pip wheel -q --no-build-isolation --no-deps . -w "$OUT/wheel" > "$OUT/build.log" 2>&1 \
    || { tail -40 "$OUT/build.log"; exit 1; }
  python3 -m pip install -q --no-deps --force-reinstall "$OUT"/wheel/verl_ops-*.whl >> "$OUT/build.log" 2>&1 || exit 1
  ls "$OUT"/wheel; rm -rf "$OUT/wheel"
  RUN_DIR="$(mktemp -d)"
else
  TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-16}" \
    python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 \
    || { tail -40 "$OUT/build.log"; exit 1; }
  RUN_DIR="$REPO"
fi
echo "build: $(( $(date +%s) - t0 )) s"
(cd "$RUN_DIR" && python3 -c "import verl_ops; assert verl_ops.cuda_available(); print('cuda kernels ok', verl_ops.__file__, verl_ops._library.HAS_LAYERS)") || exit 1

status=0
if [ -n "${FILES_PARALLEL:-}" ]; then
  # Each test file (tests/test_*.py, minus test_wheel and the stems in SKIP_FILES) as its own pytest process,
  # FILES_PARALLEL at a time, each under FILE_TIMEOUT seconds: a whole-suite run that fits one
  # call, and a per-file account of time and failures (files/<stem>.log).
  t0=$(date +%s); mkdir -p "$OUT/files"
  for f in "$REPO"/tests/test_*.py; do
    stem=$(basename "$f" .py); stem=${stem#test_}
    case " wheel ${SKIP_FILES:-} " in *" $stem "*) continue ;; esac
    echo "$stem"
  done | xargs -P "$FILES_PARALLEL" -I{} bash -c 'cd "$1" && s=$(date +%s); timeout "$2" python3 -m pytest "$3/tests/test_{}.py" -q -rfE \
      -k "not wheel" -p no:cacheprovider ${4:-} > "$5/files/{}.log" 2>&1; rc=$?; \
      echo "{}: rc=$rc $(tail -1 "$5/files/{}.log") [$(( $(date +%s) - s )) s]"' _ "$RUN_DIR" "${FILE_TIMEOUT:-400}" "$REPO" "${PYTEST_ARGS:-}" "$OUT" \
    | sort | tee "$OUT/files.txt"
  grep -hE "^(FAILED|ERROR)" "$OUT"/files/*.log | head -30
  grep -qv ": rc=0 " "$OUT/files.txt" && status=1
  echo "test files: $(( $(date +%s) - t0 )) s"
elif [ "${TESTS:-1}" = 1 ]; then
  t0=$(date +%s)
  (cd "$RUN_DIR" && timeout "${TEST_TIMEOUT:-400}" python3 -m pytest "$REPO/tests" -q -k "not wheel" -p no:cacheprovider \
    ${PYTEST_ARGS:-}) > "$OUT/tests.log" 2>&1 || status=1
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -30; tail -2 "$OUT/tests.log"
  echo "tests: $(( $(date +%s) - t0 )) s"
fi
sanitize_one() {
  # $1: a test file stem; only its CUDA cases (compile tests excluded: memcheck slows the
  # compiler, not our kernels).
  local suite="$1" t0 rc
  t0=$(date +%s)
  (cd "$RUN_DIR" && timeout "${SANITIZER_TIMEOUT:-240}" compute-sanitizer --tool memcheck --error-exitcode 9 \
    python3 -m pytest "$REPO/tests/test_${suite}.py" -q -x -k "${SANITIZE_K:-cuda and not compile}" -p no:cacheprovider) \
    > "$OUT/sanitizer_${suite}.log" 2>&1; rc=$?
  echo "sanitizer ${suite}: rc=$rc $(grep -E 'ERROR SUMMARY|passed|failed' "$OUT/sanitizer_${suite}.log" | tail -2 | tr '\n' ' ') [$(( $(date +%s) - t0 )) s]"
  return $rc
}
if [ -n "${SANITIZE:-}" ]; then
  # SANITIZE_PARALLEL=N: N suites at a time (memcheck is mostly host-bound; one GPU serves several).
  export -f sanitize_one; export RUN_DIR REPO OUT
  printf '%s\n' ${SANITIZE} | xargs -P "${SANITIZE_PARALLEL:-1}" -I{} bash -c 'sanitize_one "$1"' _ {} \
    | tee "$OUT/sanitizer.txt"
  grep -qv ": rc=0 " "$OUT/sanitizer.txt" && status=1
fi
for b in ${BENCH:-}; do
  t0=$(date +%s)
  script=$(ls benchmarks/*/bench_"${b}".py 2>/dev/null | head -1)  # e.g. thd -> benchmarks/thd/bench_thd.py
  [ -n "$script" ] || { echo "bench ${b}: no benchmarks/*/bench_${b}.py"; status=1; continue; }
  python3 "$script" --out "$OUT/results_${b}.md" ${BENCH_ARGS:-} > "$OUT/bench_${b}.log" 2>&1 || status=1
  tail -${BENCH_TAIL:-25} "$OUT/bench_${b}.log"; echo "bench ${b}: $(( $(date +%s) - t0 )) s"
done
exit $status
