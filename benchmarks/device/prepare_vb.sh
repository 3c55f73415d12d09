#!/usr/bin/env bash
# .vb (git-ignored, carried to a GPU machine without network for gpu_te.sh's verl step): the wheels
# of verl 0.9.1's import-time dependencies that torch / numpy / pytest do not bring, for CPython
# $PYVER (default 3.12, the GPU machine's) on manylinux x86_64, plus .vb/stubs/ray, an import-only
# stand-in for Ray (benchmarks/device/vb_stubs/ray: what verl's import chain touches of Ray).
# gpu_te.sh installs them with `pip install --no-index --no-deps --target /tmp/vbsite .vb/*.whl` and
# puts /tmp/vbsite and .vb/stubs on PYTHONPATH (verl 0.9.1 and megatron-core come from .whl).
#
# The set is what `import ray, tensordict, omegaconf, transformers, codetiming, megatron.core, verl`
# (tests/test_verl_plugin.py) and the engine_forward scenario (tests/verl_plugin_child.py: mbridge's
# DeepSeek-V3 bridge, verl's model_forward / engine modules) import, at the versions CI pins
# (.ci/run): tensordict 0.10.0, transformers <5.11, mbridge 0.15.1, omegaconf, codetiming, and what
# those import in turn: tokenizers (transformers' configuration_utils imports integrations.ggml, which
# imports it), huggingface-hub and its httpx stack (httpx, httpcore, h11, anyio, certifi, idna),
# safetensors, regex, pyyaml, tqdm, packaging; tensordict's cloudpickle, orjson, pyvers;
# megatron-core's einops. Left out (not imported on that path): ray itself (the stub), hf-xet, typer,
# click, rich, importlib_metadata, sniffio; typing-extensions, filelock, fsspec, jinja2, sympy, networkx
# come with torch. ~19 MB, of which transformers 11 MB.
#
# SLIM=1: transformers' wheel rewritten without the model folders that path does not import (all of
# transformers/models/ but KEEP_MODELS: auto, deepseek_v3 and those verl / mbridge import at import
# time), RECORD rewritten to match: ~10 MB in all (transformers 1.8 MB); AutoConfig etc. then know
# only the kept model types. A call carries at most 64 MiB (67.1 MB) with the tree (~3.9 MB): .te
# (44.4 MB) + .whl (6.7) + .cudnn_fe (3.1) leave ~9 MB, so even the slim .vb (9.9 MB) is ~1 MB over.
# So .vb travels in a call of its own that copies it to /tmp/vb (carry [".vb"], run
# `rm -rf /tmp/vb && cp -r .vb /tmp/vb`); gpu_te.sh, called within the warm window with .te, .whl and
# .cudnn_fe, takes /tmp/vb where no .vb is carried.
# (Checked on the CPU only: a 3.11 build of this set ran tests/test_verl_plugin.py, 18 passed.)
#
#   bash benchmarks/device/prepare_vb.sh                  # .vb for CPython 3.12 (kept if it exists)
#   SLIM=1 bash benchmarks/device/prepare_vb.sh           # the same, transformers trimmed
#   PYVER=3.11 DEST=/tmp/vb311 bash benchmarks/device/prepare_vb.sh   # another Python, elsewhere
set -euo pipefail
cd "$(dirname "$0")/../.."
PYVER="${PYVER:-3.12}"
DEST="${DEST:-.vb}"
if [ -d "$DEST" ]; then echo "$DEST exists: kept (delete it to remake it)"; du -sh "$DEST"; exit 0; fi
PKGS=(
  "tensordict>=0.8,<=0.10.0,!=0.9.0" "transformers>=5.5.3,<5.11,!=5.6.0" mbridge==0.15.1 omegaconf codetiming
  "tokenizers>=0.22.0,<=0.23.0" "huggingface-hub>=1.5.0,<2.0" httpx httpcore h11 anyio certifi idna
  "safetensors>=0.4.3" "regex>=2025.10.22" "pyyaml>=5.1" "tqdm>=4.27" "packaging>=20.0"
  cloudpickle orjson "pyvers>=0.1.0,<0.2.0" einops
)
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$tmp/vb" "${PKGS[@]}"
if [ "${SLIM:-0}" = 1 ]; then
  python3 - "$tmp"/vb/transformers-*.whl ${KEEP_MODELS:-auto deepseek_v3 encoder_decoder glm4v glm4v_moe mistral} <<'PY'
import base64, hashlib, os, sys, zipfile
whl, keep = sys.argv[1], set(sys.argv[2:])
out = whl + ".slim"
with zipfile.ZipFile(whl) as zi, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zo:
    record, lines = None, []
    for info in zi.infolist():
        p = info.filename.split("/")
        if len(p) > 3 and p[:2] == ["transformers", "models"] and p[2] not in keep:
            continue
        if p[-1] == "RECORD" and p[0].endswith(".dist-info"):
            record = info.filename
            continue
        data = zi.read(info)
        zo.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        lines.append(f"{info.filename},sha256={digest},{len(data)}")
    lines.append(f"{record},,")
    zo.writestr(record, "\n".join(lines) + "\n")
os.replace(out, whl)
print(f"transformers trimmed to models/{{{','.join(sorted(keep))}}}: {os.path.getsize(whl) / 1e6:.1f} MB")
PY
fi
mkdir -p "$tmp/vb/stubs"
cp -r benchmarks/device/vb_stubs/. "$tmp/vb/stubs/"
find "$tmp/vb/stubs" -name __pycache__ -prune -exec rm -rf {} +
mkdir -p "$(dirname "$DEST")"
mv "$tmp/vb" "$DEST"
ls "$DEST"/*.whl | xargs -n1 basename
du -sh "$DEST"
