#!/usr/bin/env bash
# On a multi-GPU machine without network: build in place, run the NCCL / CUDA cases of the
# distributed and merge tests, then benchmarks/dcp/bench_dist.py on every GPU, and the merge table once
# more for each older dynamic_cp.py named in VERSIONS (files under $VERSIONS_DIR, swapped in for
# verl_ops/dynamic_cp.py one at a time, the current one restored afterwards and timed again last).
# Logs and tables go to ${OUT:-./gpu_out}; each step is capped so the whole stays within DEADLINE s.
#
#   mkdir -p .dcp_versions && git show a809d2f^:verl_ops/dynamic_cp.py > .dcp_versions/v0.py
#   VERSIONS="v0" OUT=/some/dir bash benchmarks/device/gpu_dist.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
DEADLINE="${DEADLINE:-560}"
source benchmarks/device/deadline_lib.sh  # OUT, START, left, cap, step, want
NPROC="${NPROC:-$(nvidia-smi -L | wc -l)}"
VERSIONS_DIR="${VERSIONS_DIR:-.dcp_versions}"

step "device"
{ nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"; nproc; } 2>&1 | tee "$OUT/device.txt"

step "build"
VERL_OPS_NO_CUDNN_FE=1 MAX_JOBS="${MAX_JOBS:-32}" TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" \
  timeout "$(cap 300)" python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import verl_ops; assert verl_ops.cuda_available(); print('verl_ops', verl_ops.__file__)" || exit 1

if [ "${TESTS:-1}" = 1 ]; then
step "tests: NCCL and CUDA cases of the distributed / merge tests"
timeout "$(cap "${TEST_TIMEOUT:-200}")" python3 -m pytest tests/test_distributed.py tests/test_merge_ops.py -q -p no:cacheprovider \
  -k "nccl or cuda" > "$OUT/tests.log" 2>&1
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20; tail -1 "$OUT/tests.log"
fi

cp verl_ops/dynamic_cp.py "$OUT/now.py.bak"
restore() { cp "$OUT/now.py.bak" verl_ops/dynamic_cp.py; }
trap restore EXIT
step "bench_dist --nproc $NPROC (current code, both tables)"
timeout "$(cap 400)" python3 benchmarks/dcp/bench_dist.py --nproc "$NPROC" --out "$OUT/dist${NPROC}_now.md" > "$OUT/dist${NPROC}_now.log" 2>&1 \
  || tail -20 "$OUT/dist${NPROC}_now.log"
for v in ${VERSIONS:-}; do
  step "bench_dist --only merge with $v"
  cp "$VERSIONS_DIR/$v.py" verl_ops/dynamic_cp.py
  timeout "$(cap 300)" python3 benchmarks/dcp/bench_dist.py --nproc "$NPROC" --only merge --out "$OUT/dist${NPROC}_$v.md" \
    > "$OUT/dist${NPROC}_$v.log" 2>&1 || tail -20 "$OUT/dist${NPROC}_$v.log"
  restore
done
if [ -n "${VERSIONS:-}" ]; then
  step "bench_dist --only merge, current code again"
  timeout "$(cap 300)" python3 benchmarks/dcp/bench_dist.py --nproc "$NPROC" --only merge --out "$OUT/dist${NPROC}_now2.md" \
    > "$OUT/dist${NPROC}_now2.log" 2>&1 || tail -20 "$OUT/dist${NPROC}_now2.log"
fi
step "done"
for f in "$OUT"/dist*.md; do echo "--- $f"; sed -n '/dynamic_cp_merge vs/,$p' "$f"; done
