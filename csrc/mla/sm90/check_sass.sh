#!/usr/bin/env bash
# Does this tree compile the SM90 attention kernels to the same machine code as revision REV?
#
#   bash csrc/mla/sm90/check_sass.sh [REV]        (default REV: main)
#
# Builds mla_sm90_fwd.cu and mla_sm90_bwd.cu of REV (found under csrc/mla/sm90/ or, before the
# split by role, csrc/cuda/) and of the working tree with setup.py's nvcc flags for sm_90a, dumps
# the SASS of every kernel (cuobjdump -sass) and compares, kernel by kernel:
#   instructions  the SASS text without the address comments;
#   registers     where the instructions differ: how many lines still differ once register
#                 numbers are ignored (0: the same code with other register names);
#   encodings     the same plus each instruction's 128-bit encoding (scheduling control bits:
#                 stall counts, barriers, yields), i.e. the machine code itself;
#   resources     registers, shared / local / constant memory (cuobjdump -res-usage).
# Kernels are paired by name without namespaces (moving code between namespaces or files changes
# the mangled names only). Then both working-tree files are compiled for sm_80 as .ci/run does.
# Exit status 0 when every kernel matches on all of them; the dumps stay in $OUT (default: a temp
# dir). Against 98b6e41, the last revision with single-function kernels, every kernel is the same
# except the forward's producer thread (warpgroup 0, its tile loop): the same instructions, 44 of
# them with other register numbers and one zero move two slots earlier (registers: 2); the
# consumer warpgroups' code is the same instruction for instruction.
# Needs nvcc, and cuobjdump + nvdisasm of a CUDA 13 toolkit (on PATH, in $CUDA_HOME/bin, or from
# `pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`).
set -euo pipefail
ROOT="$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
REV="${1:-main}"
OUT="${OUT:-$(mktemp -d /tmp/check_sass.XXXXXX)}"
CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
NVCC="${NVCC:-$CUDA_HOME/bin/nvcc}"

for tool in cuobjdump nvdisasm; do
  command -v "$tool" > /dev/null && continue
  for dir in "$CUDA_HOME/bin" $(python3 - << 'PY' 2> /dev/null
import glob, site, sysconfig
dirs = set(site.getsitepackages() + [sysconfig.get_paths()["purelib"]])
print("\n".join(sorted({p for d in dirs for p in glob.glob(d + "/nvidia/cu*/bin")})))
PY
  ) /opt/cuobjdump/nvidia/cu13/bin /opt/nvdisasm/nvidia/cu13/bin; do
    [ -x "$dir/$tool" ] && { PATH="$PATH:$dir"; break; }
  done
  command -v "$tool" > /dev/null || { echo "check_sass: $tool not found (pip install nvidia-cuda-${tool})"; exit 2; }
done

# setup.py's nvcc command for a .cu of verl_ops._C (torch's COMMON_NVCC_FLAGS, then _make()'s
# flags with VERL_OPS_HAS_SM90A and the cuDNN frontend on, then the arch and extension defines).
# The SM90 files include no torch or cuDNN header, so include paths do not matter here.
FLAGS=(-D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__
       -D__CUDA_NO_HALF2_OPERATORS__ --expt-relaxed-constexpr --compiler-options -fPIC
       -O3 -std=c++17 -DVERL_OPS_WITH_CUDA --expt-relaxed-constexpr -lineinfo
       -DTORCH_TARGET_VERSION=0x0209000000000000 -DPy_LIMITED_API=0x030A0000
       -DVERL_OPS_HAS_SM90A -DVERL_OPS_WITH_CUDNN_FE
       -gencode arch=compute_90a,code=sm_90a -DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=_C)

find_source() {  # find_source TREE FILE: the file under the split layout or the old one
  local p
  for p in csrc/mla/sm90 csrc/cuda; do
    [ -f "$1/$p/$2" ] && { echo "$1/$p/$2"; return; }
  done
  echo "check_sass: no $2 under $1" >&2
  return 1
}

# dump SIDE FILE: one file per kernel of $OUT/SIDE/FILE.o under $OUT/SIDE/: FILE.NAME.sass
# (instructions), FILE.NAME.enc (instructions and encodings), FILE.NAME.res (resources), NAME the
# demangled name without namespaces or parameter list.
dump() {
  local side="$1" obj="$OUT/$1/$2.o" dir="$OUT/$1/$2"
  cuobjdump -sass "$obj" | awk -v dir="$dir" '
    function short(m,   cmd, d) {
      cmd = "c++filt " m; cmd | getline d; close(cmd)
      gsub(/\(anonymous namespace\)::/, "", d); gsub(/[A-Za-z_0-9]+::/, "", d)
      sub(/^void /, "", d); sub(/\(.*$/, "", d); gsub(/[<> ,]/, "_", d)
      return d
    }
    /Function : / { name = short($3); enc = dir "." name ".enc"; sass = dir "." name ".sass"; next }
    name == "" { next }
    /^[ \t]*\/\*[0-9a-f]+\*\// {
      line = $0
      sub(/^[ \t]*\/\*[0-9a-f]+\*\/[ \t]*/, "", line)
      code = line; sub(/[ \t]*\/\* 0x[0-9a-f]+ \*\/[ \t]*$/, "", code); gsub(/[ \t]+/, " ", code)
      print code > sass
      gsub(/[ \t]+/, " ", line)
      print line > enc
      next
    }
    /^[ \t]*\/\* 0x[0-9a-f]+ \*\// { gsub(/[ \t]+/, "", $0); print "  " $0 > enc }
  '
  cuobjdump -res-usage "$obj" | awk -v dir="$dir" '
    function short(m,   cmd, d) {
      cmd = "c++filt " m; cmd | getline d; close(cmd)
      gsub(/\(anonymous namespace\)::/, "", d); gsub(/[A-Za-z_0-9]+::/, "", d)
      sub(/^void /, "", d); sub(/\(.*$/, "", d); gsub(/[<> ,]/, "_", d)
      return d
    }
    /Function / { m = $2; sub(/:$/, "", m); name = short(m); next }
    name != "" && /REG:/ { gsub(/^[ \t]+/, ""); print > (dir "." name ".res"); name = "" }
  '
}

build() {  # build SIDE TREE
  local side="$1" tree="$2" f src
  mkdir -p "$OUT/$side"
  for f in mla_sm90_fwd mla_sm90_bwd; do
    src="$(find_source "$tree" "$f.cu")"
    "$NVCC" "${FLAGS[@]}" -c "$src" -o "$OUT/$side/$f.o"
    dump "$side" "$f"
  done
}

rm -rf "$OUT/rev" "$OUT/tree" "$OUT/src"
mkdir -p "$OUT/src"
git -C "$ROOT" archive "$REV" csrc | tar -x -C "$OUT/src"
echo "check_sass: $REV ($(git -C "$ROOT" rev-parse --short "$REV")) against the working tree of $ROOT; dumps in $OUT"
build rev "$OUT/src"
build tree "$ROOT"

status=0
for f in "$OUT"/rev/*.sass "$OUT"/tree/*.sass; do basename "$f" .sass; done | sort -u > "$OUT/kernels"
printf '%-48s %7s  %-12s %-10s %-10s %-10s %s\n' kernel instrs instructions registers encodings resources "REG (rev -> tree)"
while read -r k; do
  a="$OUT/rev/$k" b="$OUT/tree/$k"
  if [ ! -f "$a.sass" ] || [ ! -f "$b.sass" ]; then
    echo "$k: only in $([ -f "$a.sass" ] && echo "$REV" || echo "the working tree")"; status=1; continue
  fi
  same() { cmp -s "$1" "$2" && echo same || echo DIFFERENT; }
  cmp -s "$a.enc" "$b.enc" && cmp -s "$a.res" "$b.res" || status=1
  reg() { grep -o 'REG:[0-9]*' "$1" | cut -d: -f2; }
  noreg() { sed -E 's/\bU?R[0-9]+\b/R/g; s/\bU?P[0-6]\b/P/g; s/\.reuse//g' "$1"; }
  if cmp -s "$a.sass" "$b.sass"; then regs=-; else regs="$(diff <(noreg "$a.sass") <(noreg "$b.sass") | grep -c '^[<>]' || true)"; fi
  printf '%-48s %7s  %-12s %-10s %-10s %-10s %s -> %s\n' "$k" "$(wc -l < "$b.sass")" "$(same "$a.sass" "$b.sass")" \
    "$regs" "$(same "$a.enc" "$b.enc")" "$(same "$a.res" "$b.res")" "$(reg "$a.res")" "$(reg "$b.res")"
  cmp -s "$a.enc" "$b.enc" || diff "$a.enc" "$b.enc" > "$OUT/$k.diff" || true
done < "$OUT/kernels"
[ "$status" = 0 ] || echo "check_sass: differences (diff -u $OUT/rev/KERNEL.sass $OUT/tree/KERNEL.sass; encodings: $OUT/KERNEL.diff)"

# .ci/run's sm_80 compile of the same files (their kernels compile to nothing there).
for f in mla_sm90_fwd mla_sm90_bwd; do
  if "$NVCC" -std=c++17 -O1 -gencode arch=compute_80,code=sm_80 -c "$(find_source "$ROOT" "$f.cu")" -o "$OUT/$f.sm80.o"; then
    echo "sm_80: $f.cu compiles"
  else
    echo "sm_80: $f.cu does not compile"; status=1
  fi
done
exit "$status"
