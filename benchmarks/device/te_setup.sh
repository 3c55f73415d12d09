#!/usr/bin/env bash
# On a GPU machine without network: TransformerEngine 2.20.2 (PyTorch) from the folder that
# benchmarks/device/te_prepare.py wrote on a machine with network (.te, carried:
# `carry: [".te"]`, about 40 MB), into /tmp/te_site:
#   core        the core wheel's files (its library keeping only the sm_90 cubins), unpacked
#   deps        pydantic and its parts, einops, wheel, nvidia-cudnn-frontend (pip --target), and the
#               transformer-engine metapackage's metadata (TE's import checks that it is installed)
#   torch ext   transformer_engine_torch built from its source package against the installed torch
#               (a C++ extension: MAX_JOBS compile jobs, default 16), copied into /tmp/te_site
# then `import transformer_engine.pytorch` is checked and /tmp/te_site/PYTHONPATH written. Each
# part's time is printed, so that a session can plan its device time. /tmp survives only while the
# machine stays up (30 s after a call): run the steps that use TE in the same call, or right after.
#
# With TE_SO_OUT=DIR, the built extension is also written there xz-compressed; copied into the .te
# folder here, later calls unpack it instead of building (the same torch build only).
#
#   OUT=/some/dir [TE_SO_OUT=$OUT] bash benchmarks/device/te_setup.sh [FOLDER]   # default: .te here
set -uo pipefail
HERE="$(cd "$(dirname "$0")/../.." && pwd)"
SRC="$(cd "${1:-$HERE/.te}" && pwd)"
OUT="${OUT:-$HERE/gpu_out}"; mkdir -p "$OUT"
DEST=/tmp/te_site
t0=$(date +%s)
rm -rf "$DEST" /tmp/te_build && mkdir -p "$DEST" /tmp/te_build
tar -xJf "$SRC/te_core.tar.xz" -C "$DEST" || { echo "te_setup: cannot unpack $SRC/te_core.tar.xz"; exit 1; }
echo "core: $(( $(date +%s) - t0 )) s"
deps=(); for w in "$SRC"/*.whl; do case "$(basename "$w")" in transformer_engine-*) ;; *) deps+=("$w");; esac; done
python3 -m pip install -q --no-index --no-deps --no-compile --target "$DEST" "${deps[@]}" > "$OUT/te_deps.log" 2>&1 \
  || { tail -5 "$OUT/te_deps.log"; exit 1; }
# TE's import asserts that its metapackage (transformer-engine, installed from a wheel) is there: its
# metadata only, from the metapackage's wheel (its Python files are the core wheel's, unpacked above).
python3 - "$DEST" "$SRC"/transformer_engine-*.whl <<'PY' || { echo "te_setup: no transformer_engine metapackage wheel in $SRC"; exit 1; }
import sys, zipfile
dest, wheel = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if ".dist-info/" in name.split("/", 1)[0] + "/":
            z.extract(name, dest)
PY
echo "deps: $(( $(date +%s) - t0 )) s"
PREBUILT=$(ls "$SRC"/transformer_engine_torch*.so.xz 2>/dev/null | head -1)
if [ -n "$PREBUILT" ]; then
  # the extension an earlier call built (TE_SO_OUT below), for the same torch
  xz -dc "$PREBUILT" > "$DEST/$(basename "${PREBUILT%.xz}")" || { echo "te_setup: cannot unpack $PREBUILT"; exit 1; }
  echo "torch extension (prebuilt $(basename "$PREBUILT")): $(( $(date +%s) - t0 )) s"
else
  tar -xzf "$SRC"/transformer_engine_torch-*.tar.gz -C /tmp/te_build
  cd /tmp/te_build/transformer_engine_torch-*/ || exit 1
  # cuDNN's headers (cudnn.h) where torch's nvidia-cudnn package has them.
  CUDNN_INC=$(python3 -c "import os, nvidia.cudnn as m; p = os.path.join(list(m.__path__)[0], 'include'); print(p if os.path.isfile(os.path.join(p, 'cudnn.h')) else '')" 2>/dev/null)
  export CPLUS_INCLUDE_PATH="${CUDNN_INC}${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}"
  PYTHONPATH="$DEST${PYTHONPATH:+:$PYTHONPATH}" NVTE_FRAMEWORK=pytorch MAX_JOBS="${MAX_JOBS:-16}" \
    python3 setup.py build_ext --inplace > "$OUT/te_build.log" 2>&1 || { tail -40 "$OUT/te_build.log"; exit 1; }
  cp -f transformer_engine_torch*.so "$DEST"/ || { echo "te_setup: no extension built"; tail -20 "$OUT/te_build.log"; exit 1; }
  echo "torch extension: $(( $(date +%s) - t0 )) s"
  if [ -n "${TE_SO_OUT:-}" ]; then
    # Kept for later calls: put the file into the .te folder here (it is then unpacked, not built).
    mkdir -p "$TE_SO_OUT"
    for f in transformer_engine_torch*.so; do xz -T0 -6 -c "$f" > "$TE_SO_OUT/$f.xz"; done
    ls -la "$TE_SO_OUT"/transformer_engine_torch*.so.xz
  fi
fi
cd "$HERE"
rm -f "$DEST/PYTHONPATH"
PYTHONPATH="$DEST${PYTHONPATH:+:$PYTHONPATH}" python3 -c "
import transformer_engine, transformer_engine.pytorch as te, torch
print('transformer_engine', transformer_engine.__version__, 'torch', torch.__version__)
" > "$DEST.import.log" 2>&1; rc=$?
tail -3 "$DEST.import.log"
[ $rc -eq 0 ] || { echo "import transformer_engine.pytorch failed (rc $rc)"; exit 1; }
# (written only once TE imports: the mark that this site is usable)
echo "$DEST" > "$DEST/PYTHONPATH"
echo "PYTHONPATH=$DEST (also in $DEST/PYTHONPATH); total $(( $(date +%s) - t0 )) s"
