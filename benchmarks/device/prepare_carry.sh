#!/usr/bin/env bash
# The git-ignored folders the device scripts carry to a GPU machine without network, made here (a
# machine with network) from PyPI, for CPython 3.12 / manylinux x86_64 (the GPU machine's Python):
#   .whl        megatron-core 0.16.1 and 0.19.2 (cp312), verl 0.9.1            ~6.4 MB  gpu_megatron.sh, gpu_te.sh
#   .cudnn_fe   the cuDNN frontend's C++ headers (include/)                      ~3.2 MB  the varlen MLA backend's build
#   .fa4_a/_b   FlashAttention-4 4.0.0b36 and its wheels, the 92 MB cutlass-dsl   ~48 / 51 MB  fa4_setup.sh (two calls)
#               libs-cu13 wheel split in two parts (one per folder)
#   .te         TransformerEngine 2.20.2 (benchmarks/device/te_prepare.py)        ~41 MB  te_setup.sh, gpu_te.sh
# .vb (verl's import-time dependencies for gpu_te.sh's verl step) is made by prepare_vb.sh.
# A folder that exists is kept (delete it to remake it). Each call carries at most 64 MiB with the
# tree (~4.5 MB), hence the split: see fa4_setup.sh and gpu_te.sh for which call carries what.
# (te_setup.sh builds TE's PyTorch extension on the GPU machine, ~105 s; with TE_SO_OUT it also
# writes the built extension, xz-compressed: put it into .te and later calls unpack it instead.)
#
#   bash benchmarks/device/prepare_carry.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
dl() { python3 -m pip download -q --no-deps --python-version 3.12 --platform manylinux_2_28_x86_64 \
  --only-binary=:all: -d "$@"; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT

if [ ! -d .whl ]; then
  mkdir -p "$tmp/whl"
  for v in 0.16.1 0.19.2; do dl "$tmp/whl" "megatron-core==$v"; done
  dl "$tmp/whl" verl==0.9.1
  mv "$tmp/whl" .whl
fi
if [ ! -d .cudnn_fe ]; then
  dl "$tmp/fe" "nvidia-cudnn-frontend>=1.32"
  mkdir -p "$tmp/cudnn_fe"
  python3 - "$tmp/fe" "$tmp/cudnn_fe" <<'EOF'
import glob, sys, zipfile
src, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(glob.glob(f"{src}/*.whl")[0]) as z:
    z.extractall(dest, [n for n in z.namelist() if n.startswith("include/")])
EOF
  test -f "$tmp/cudnn_fe/include/cudnn_frontend.h"
  mv "$tmp/cudnn_fe" .cudnn_fe
fi
if [ ! -d .fa4_a ] || [ ! -d .fa4_b ]; then
  dl "$tmp/fa4" flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
    nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 "apache-tvm-ffi<0.2" \
    torch-c-dlpack-ext quack-kernels einops
  big=$(ls "$tmp"/fa4/nvidia_cutlass_dsl_libs_cu13-*.whl)
  ( cd "$tmp/fa4" && split -b 50M "$(basename "$big")" "$(basename "$big").part_" && rm "$(basename "$big")" )
  rm -rf .fa4_a .fa4_b; mkdir -p .fa4_a .fa4_b
  mv "$tmp"/fa4/*.part_aa .fa4_b/
  mv "$tmp"/fa4/*.part_ab "$tmp"/fa4/*.whl .fa4_a/
fi
[ -d .te ] || python3 benchmarks/device/te_prepare.py
du -sh .whl .cudnn_fe .fa4_a .fa4_b .te
