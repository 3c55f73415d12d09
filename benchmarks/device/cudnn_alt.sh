#!/usr/bin/env bash
# Run the GPU paths under another cuDNN than the one torch ships (e.g. the cuDNN of a newer torch:
# torch 2.15 depends on nvidia-cudnn-cu13 9.26) on a GPU machine without network.
#
# On a machine with network, `pack` downloads the nvidia-cudnn-cu<major> wheel, keeps its headers
# and libraries (libcudnn_adv, RNN / legacy attention, is left out), compresses them (tar.xz,
# ~350 MB for 9.26) and splits them into 58 MiB parts, one per folder .cudnn_alt_aa, .cudnn_alt_ab,
# ... so that each travels in a call of its own:
#
#   bash benchmarks/device/cudnn_alt.sh pack 9.26.0.51 [cu13]
#
# On the GPU machine, `unpack FOLDER...` copies the parts it is given into /tmp/cudnn_alt_parts
# (which survives between calls while the machine stays up); once all are there it extracts them
# into /tmp/cudnn_alt, adds the frontend headers (.cudnn_fe/include or CUDNN_FRONTEND_INCLUDE)
# next to the new cudnn*.h in /tmp/cudnn_alt/include, and writes /tmp/cudnn_alt/env:
#
#   bash benchmarks/device/cudnn_alt.sh unpack .cudnn_alt_aa          # one call per folder ...
#   source /tmp/cudnn_alt/env                                  # ... then, in the last call:
#   CUDNN_FRONTEND_INCLUDE=$ALT_INCLUDE CUDNN_INCLUDE=$ALT_INCLUDE python3 setup.py build_ext --inplace
#   LD_PRELOAD=$ALT_PRELOAD python3 -m pytest tests/test_mla_varlen.py -k "cuda or gpu"
#
# Build against the new headers: the frontend gates engines on min(compiled, loaded) cuDNN.
# Preload instead of LD_LIBRARY_PATH: torch finds its cuDNN through an RPATH, which wins over
# LD_LIBRARY_PATH; a preloaded libcudnn.so.9 is used by torch and verl_ops alike and loads the
# other cuDNN libraries from its own directory.
set -euo pipefail
HERE="$(cd "$(dirname "$0")/../.." && pwd)"
cmd="${1:-}"; shift || true

case "$cmd" in
pack)
  version="${1:?usage: cudnn_alt.sh pack VERSION [cu13|cu12]}"; flavour="${2:-cu13}"
  work=$(mktemp -d)
  python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_27_x86_64 \
    --python-version 3.12 "nvidia-cudnn-${flavour}==${version}" -d "$work"
  python3 - "$work" <<'EOF'
import glob, os, sys, zipfile
work = sys.argv[1]
whl = glob.glob(os.path.join(work, "*.whl"))[0]
with zipfile.ZipFile(whl) as z:
    for n in z.namelist():
        if n.startswith("nvidia/cudnn/") and "libcudnn_adv" not in n:
            z.extract(n, os.path.join(work, "x"))
EOF
  (cd "$work/x" && tar -cf - nvidia | xz -6 -T0 > "$work/cudnn.tar.xz")
  (cd "$work" && split -b 58M cudnn.tar.xz part_)
  rm -rf "$HERE"/.cudnn_alt_*
  n=0
  for p in "$work"/part_*; do
    d="$HERE/.cudnn_alt_${p##*_}"; mkdir -p "$d"; cp "$p" "$d/"; n=$((n + 1))
  done
  echo "$n" > "$HERE/.cudnn_alt_aa/count"
  rm -rf "$work"
  echo "cuDNN ${version} in ${n} parts: $(cd "$HERE" && ls -d .cudnn_alt_* | tr '\n' ' ')"
  echo "keep them out of git (e.g. '.cudnn_alt_*/' in .git/info/exclude) and carry one folder per call"
  ;;
unpack)
  parts=/tmp/cudnn_alt_parts; dest=/tmp/cudnn_alt
  mkdir -p "$parts"
  for d in "$@"; do cp -f "$d"/* "$parts"/; done
  have=$(find "$parts" -maxdepth 1 -name 'part_*' | wc -l)
  want=$(cat "$parts/count" 2>/dev/null || echo "?")
  if [ "$want" = "?" ] || [ "$have" -lt "$want" ]; then
    echo "cudnn_alt: ${have} of ${want} parts (the count comes with .cudnn_alt_aa): carry the others"
    exit 0
  fi
  rm -rf "$dest"; mkdir -p "$dest"
  cat "$parts"/part_* | tar -xJf - -C "$dest"
  # the new libcudnn looks for NVRTC and cuBLAS beside its own package folder, as torch's does
  site=$(python3 -c "import nvidia, os; print(list(nvidia.__path__)[0])")
  for sub in "$site"/*; do
    [ -e "$dest/nvidia/$(basename "$sub")" ] || ln -s "$sub" "$dest/nvidia/$(basename "$sub")"
  done
  fe="${CUDNN_FRONTEND_INCLUDE:-$HERE/.cudnn_fe/include}"
  mkdir -p "$dest/include"
  cp -r "$fe"/. "$dest/include/"
  cp "$dest"/nvidia/cudnn/include/cudnn*.h "$dest/include/"
  {
    echo "export ALT_INCLUDE=$dest/include"
    echo "export ALT_PRELOAD=$dest/nvidia/cudnn/lib/libcudnn.so.9"
  } > "$dest/env"
  LD_PRELOAD="$dest/nvidia/cudnn/lib/libcudnn.so.9" python3 -c \
    "import torch; print('cudnn_alt: torch', torch.__version__, 'sees cuDNN', torch.backends.cudnn.version())"
  cat "$dest/env"
  ;;
*)
  echo "usage: cudnn_alt.sh pack VERSION [cu13|cu12] | unpack FOLDER..." >&2
  exit 2
  ;;
esac
