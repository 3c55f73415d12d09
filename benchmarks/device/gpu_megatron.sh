#!/usr/bin/env bash
# On a GPU machine without network: verl_ops inside real megatron-core models.
#   build       in place, with the varlen (cuDNN frontend) backend (.cudnn_fe/include, as gpu_mla.sh)
#   site        megatron-core versions (MCORE, default "0.16.1 0.19.2") and verl 0.9.1 unpacked from
#               the wheels in .whl/ (carried: `carry: [".whl", ".cudnn_fe"]`) into /tmp/mcore-<v>
#   tests       per version: tests/test_megatron_model.py, test_megatron_mla.py, test_rope.py (GPU
#               cases included), and test_mla_cp.py (NCCL at 2 / 4 ranks where the GPUs are there)
#   sanitizer   compute-sanitizer memcheck on the CUDA cases of test_rope.py and one model test
#   bench       benchmarks/megatron/bench_megatron_step.py under BENCH_MCORE (default the last of MCORE)
#   cpbench     benchmarks/megatron/bench_mla_cp.py under torchrun at 2 and 4 ranks (as many as there are)
# STEPS picks steps (default all of them); every step is capped so that the whole stays within
# DEADLINE seconds. Logs and tables go to ${OUT:-./gpu_out}.
#
#   OUT=/some/dir MCORE="0.19.2" STEPS="build site tests" bash benchmarks/device/gpu_megatron.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
DEADLINE="${DEADLINE:-560}"
source benchmarks/device/deadline_lib.sh  # OUT, START, left, cap, step, want
STEPS=" ${STEPS:-build site tests sanitizer bench cpbench} "
MCORE="${MCORE:-0.16.1 0.19.2}"
BENCH_MCORE="${BENCH_MCORE:-${MCORE##* }}"
NGPU=$(nvidia-smi -L | wc -l)

step "device"
{ nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())"
  python3 --version; nproc; } 2>&1 | tee "$OUT/device.txt"

if want build; then
step "build (in place, TORCH_CUDA_ARCH_LIST=9.0, built as 9.0a)"
export CUDNN_FRONTEND_INCLUDE="$PWD/.cudnn_fe/include"
CUDNN_SITE=$(python3 -c "import os, nvidia.cudnn as m; p = os.path.join(list(m.__path__)[0], 'include'); print(p if os.path.isfile(os.path.join(p, 'cudnn.h')) else '')" 2>/dev/null)
export CUDNN_INCLUDE="${CUDNN_SITE:-$PWD/.cudnn_fe/include}"
MAX_JOBS="${MAX_JOBS:-16}" TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" \
  timeout "$(cap 300)" python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
grep -E "^verl_ops:" "$OUT/build.log"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import verl_ops; assert verl_ops.cuda_available(); print('verl_ops', verl_ops.__file__, verl_ops.mla_cache_info())" \
  | tee -a "$OUT/device.txt" || exit 1

site_of() { echo "/tmp/mcore-$1"; }
if want site; then
step "site: megatron-core $MCORE + verl 0.9.1 from .whl/"
for v in $MCORE; do
  rm -rf "$(site_of "$v")"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$(site_of "$v")" \
    .whl/megatron_core-"$v"-*cp312*.whl .whl/verl-0.9.1-*.whl > "$OUT/site_$v.log" 2>&1 || tail -5 "$OUT/site_$v.log"
  PYTHONPATH="$(site_of "$v"):$PYTHONPATH" python3 -c "import megatron.core as m; print('megatron-core', m.__version__)"
done
fi
with_mcore() { local v="$1"; shift; PYTHONPATH="$(site_of "$v"):$PYTHONPATH" "$@"; }

status=0
if want tests; then
for v in $MCORE; do
  step "tests under megatron-core $v"
  with_mcore "$v" timeout "$(cap "${TEST_TIMEOUT:-240}")" python3 -m pytest tests/test_megatron_model.py \
    tests/test_megatron_mla.py tests/test_rope.py tests/test_mla_cp.py -q -p no:cacheprovider -rfEs \
    ${PYTEST_ARGS:-} > "$OUT/tests_$v.log" 2>&1 || status=1
  grep -E "^(FAILED|ERROR|SKIPPED)" "$OUT/tests_$v.log" | head -30; tail -1 "$OUT/tests_$v.log"
done
fi

if want sanitizer; then
step "compute-sanitizer memcheck: CUDA cases of test_rope.py and the bf16 one-GPU model test"
v="${MCORE##* }"
with_mcore "$v" timeout "$(cap 240)" compute-sanitizer --tool memcheck --error-exitcode 9 --target-processes all \
  python3 -m pytest tests/test_rope.py tests/test_megatron_model.py -q -p no:cacheprovider \
  -k "cuda and not cp" > "$OUT/memcheck.log" 2>&1; rc=$?
grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -3; [ $rc -eq 0 ] || { echo "memcheck rc=$rc"; status=1; }
fi

if want bench; then
step "bench_megatron_step under megatron-core $BENCH_MCORE"
with_mcore "$BENCH_MCORE" timeout "$(cap "${BENCH_TIMEOUT:-300}")" python3 benchmarks/megatron/bench_megatron_step.py \
  --out "$OUT/step.json" ${BENCH_ARGS:-} > "$OUT/step.log" 2>&1 || { tail -30 "$OUT/step.log"; status=1; }
grep -vE "^\s*$" "$OUT/step.log" | tail -60
fi

if want cpbench && [ "$NGPU" -ge 2 ]; then
for n in 2 4; do
  [ "$NGPU" -ge "$n" ] || continue
  step "bench_mla_cp at $n ranks"
  timeout "$(cap 200)" torchrun --standalone --nproc_per_node "$n" benchmarks/megatron/bench_mla_cp.py \
    --out "$OUT/cp$n.json" ${CPBENCH_ARGS:-} > "$OUT/cp$n.log" 2>&1 || { tail -20 "$OUT/cp$n.log"; status=1; }
  grep -vE "^\s*$" "$OUT/cp$n.log" | tail -25
done
fi
echo "total: $(( $(date +%s) - START )) s, status $status"
exit $status
