#!/usr/bin/env bash
# FlashAttention-4 (the peer of benchmarks/mla/bench_mla.py) on a GPU machine without network, from
# wheels fetched on a machine with network:
#
#   pip download --no-deps --python-version 3.12 --platform manylinux_2_28_x86_64 \
#     --only-binary=:all: flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 \
#     nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 \
#     nvidia-cutlass-dsl-libs-cu13==4.8.1 "apache-tvm-ffi<0.2" torch-c-dlpack-ext quack-kernels einops
#
# The 92 MB libs-cu13 wheel is split (`split -b 50M`, parts *.part_aa, *.part_ab) and the files
# spread over two folders (.fa4_a, .fa4_b) so that each travels in a call of its own. Each call
# runs this script: it copies the folders it finds into /tmp/fa4_parts (which survives between
# calls while the machine stays up); once every part is there it reassembles the split wheel,
# extracts every wheel with zipfile into /tmp/fa4 (pip --target drops files when two wheels share
# a package folder, as the cutlass-dsl wheels do) and writes the PYTHONPATH to use into
# /tmp/fa4/PYTHONPATH (and prints it).
#
#   bash benchmarks/device/fa4_setup.sh [FOLDER ...]   # default: .fa4_a / .fa4_b here or two levels up
#
# Only the folders a call carries reach the machine: the other carried folders the build and the
# benchmarks need (.whl, .cudnn_fe) are kept in /tmp/fa4_keep by the call that carries them and put
# back by the next one (run from the repository root). The two calls must come within the
# machine's warm window (30 s), or /tmp is gone.
set -uo pipefail
HERE="$(cd "$(dirname "$0")/../.." && pwd)"
PARTS=/tmp/fa4_parts
DEST=/tmp/fa4
mkdir -p "$PARTS"
folders=("$@")
if [ ${#folders[@]} -eq 0 ]; then
  for d in "$PWD/.fa4_a" "$PWD/.fa4_b" "$HERE/.fa4_a" "$HERE/.fa4_b" "$HERE/../.fa4_a" "$HERE/../.fa4_b"; do
    [ -d "$d" ] && folders+=("$d")
  done
fi
for d in "${folders[@]}"; do
  echo "copying $d"; cp -f "$d"/* "$PARTS"/
done
mkdir -p /tmp/fa4_keep
for d in .whl .cudnn_fe; do
  if [ -d "$PWD/$d" ]; then rm -rf "/tmp/fa4_keep/$d"; cp -r "$PWD/$d" /tmp/fa4_keep/;
  elif [ -d "/tmp/fa4_keep/$d" ]; then cp -r "/tmp/fa4_keep/$d" "$PWD/"; echo "restored $d"; fi
done
ls -la "$PARTS"

python3 - "$PARTS" "$DEST" <<'EOF'
import glob, os, shutil, sys, zipfile

parts_dir, dest = sys.argv[1], sys.argv[2]
need = ["flash_attn_4-", "nvidia_cutlass_dsl-", "nvidia_cutlass_dsl_libs_base-", "nvidia_cutlass_dsl_libs_core-",
        "apache_tvm_ffi-", "torch_c_dlpack_ext-", "quack_kernels-", "einops-"]
have = os.listdir(parts_dir)
split = sorted(glob.glob(os.path.join(parts_dir, "*.part_*")))
missing = [n for n in need if not any(h.startswith(n) and h.endswith(".whl") for h in have)]
if len(split) < 2 and not any(h.startswith("nvidia_cutlass_dsl_libs_cu13-") and h.endswith(".whl") for h in have):
    missing.append("the two parts of nvidia_cutlass_dsl_libs_cu13 (*.part_aa, *.part_ab)")
if missing:
    print("fa4_setup: waiting for more files (run again with the other folder):", missing)
    sys.exit(0)
if split:
    whole = os.path.join(parts_dir, "nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl")
    with open(whole, "wb") as out:
        for p in split:
            with open(p, "rb") as f:
                shutil.copyfileobj(f, out)
if os.path.isdir(dest):
    shutil.rmtree(dest)
os.makedirs(dest)
for whl in sorted(glob.glob(os.path.join(parts_dir, "*.whl"))):
    with zipfile.ZipFile(whl) as z:
        for info in z.infolist():
            path = z.extract(info, dest)
            mode = (info.external_attr >> 16) & 0o777
            if mode and not info.is_dir():
                os.chmod(path, mode)
    print("extracted", os.path.basename(whl))
# flash-attn-4 ships flash_attn/cute without flash_attn/__init__.py: a namespace package, which a
# regular flash_attn (FlashAttention-2) elsewhere on the path would hide.
init = os.path.join(dest, "flash_attn", "__init__.py")
if not os.path.exists(init):
    open(init, "w").close()
paths = [dest]
for sub in ("python_packages", "dsl_packages"):
    p = os.path.join(dest, "nvidia_cutlass_dsl", sub)
    if os.path.isdir(p):
        paths.append(p)
with open(os.path.join(dest, "PYTHONPATH"), "w") as f:
    f.write(":".join(paths))
print("PYTHONPATH=" + ":".join(paths))
EOF

if [ -f "$DEST/PYTHONPATH" ]; then
  PYTHONPATH="$(cat "$DEST/PYTHONPATH")${PYTHONPATH:+:$PYTHONPATH}" python3 -c "
import torch
from flash_attn.cute import flash_attn_varlen_func
print('flash_attn.cute importable; torch', torch.__version__)" 2>&1 | tail -5
fi
