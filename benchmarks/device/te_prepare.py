"""TransformerEngine for a GPU machine without network, made small enough to travel in one call.

Run here (a machine with network; no GPU needed), then carry the folder it writes (``.te``, git-
ignored) to the GPU machine and run ``benchmarks/device/te_setup.sh`` there:

    python benchmarks/device/te_prepare.py            # -> .te/ (about 40 MB)

What it does:
- downloads TransformerEngine 2.20.2's CUDA 13 core wheel (``transformer_engine_cu13``, 276 MB), the
  source package of its PyTorch extension (``transformer_engine_torch``, a C++ extension built
  against the installed torch on the GPU machine by te_setup.sh) and what ``import
  transformer_engine.pytorch`` needs beside torch (pydantic and its parts, einops) plus ``wheel``
  (the extension's setup.py imports it) and ``nvidia-cudnn-frontend`` (its headers, found through its
  package metadata), for CPython 3.12 / manylinux x86_64;
- keeps only the sm_90 cubins of the core library's fat binaries (H100 / H200): 89 % of
  ``libtransformer_engine.so`` is device code for eight other architectures. Each fat-binary
  container is rewritten in place with its kept entries and its size field updated, the freed bytes
  zeroed; container starts do not move, so the library's registration pointers stay valid (``cuobjdump
  --list-elf`` on the result lists 89 sm_90 and 1 sm_90a cubins). The library is otherwise unchanged;
- packs the unpacked core wheel (site-packages layout) as ``te_core.tar.xz`` next to the other files.

This is tooling for our GPU test machines only: users install TransformerEngine from its wheels.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
import zipfile

TE_VERSION = "2.20.2"
PY = "3.12"
# (pip matches the listed tags only: older manylinux tags, which most binary wheels carry, are named too)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
# With their dependencies, resolved for CPython 3.12 (pydantic pins its pydantic-core) ...
DEPS = ["pydantic", "einops", "wheel"]
# ... and without (only the frontend's headers and metadata are used; its dependencies are large; of the
# transformer-engine metapackage only its metadata, which TE's import checks for).
DEPS_NO_DEPS = ["nvidia-cudnn-frontend", f"transformer-engine=={TE_VERSION}"]
FATBIN_MAGIC = 0xBA55ED50


def pip_download(specs, dest, *, binary=True, deps=False):
    cmd = [sys.executable, "-m", "pip", "download", "-q", "-d", dest] + ([] if deps else ["--no-deps"])
    if binary:
        cmd += ["--only-binary=:all:", "--python-version", PY] + [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run(cmd + list(specs), check=True)


def pypi_file(name, filename_suffix, dest):
    """A release file of ``name`` from PyPI's JSON API (for a source package pip cannot fetch without
    building it)."""
    base = f"https://pypi.org/pypi/{name}/json"
    data = json.load(urllib.request.urlopen(base))
    if data["info"]["version"] != TE_VERSION:
        data = json.load(urllib.request.urlopen(f"https://pypi.org/pypi/{name}/{TE_VERSION}/json"))
    for u in data["urls"]:
        if u["filename"].endswith(filename_suffix):
            path = os.path.join(dest, u["filename"])
            urllib.request.urlretrieve(urllib.parse.urljoin(base, u["url"]), path)
            return path
    raise LookupError(f"no {filename_suffix} file of {name} {TE_VERSION} on PyPI")


def fatbin_section(path):
    out = subprocess.run(["readelf", "-S", "-W", path], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        parts = line.split()
        if ".nv_fatbin" in parts:
            i = parts.index(".nv_fatbin")
            return int(parts[i + 3], 16), int(parts[i + 4], 16)
    return None


def keep_arch(path, archs=(90,)):
    """Drop every cubin (fat-binary entry of kind 2) whose architecture is not in ``archs``, in place;
    PTX entries are kept. Returns counts."""
    sec = fatbin_section(path)
    stats = {"containers": 0, "kept": 0, "dropped": 0, "kept_bytes": 0, "dropped_bytes": 0}
    if sec is None:
        return stats
    off, size = sec
    with open(path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), 0)
        pos, end = off, off + size
        while pos + 16 <= end:
            magic, _version, hsize, fsize = struct.unpack_from("<IHHQ", mm, pos)
            if magic != FATBIN_MAGIC:
                pos += 8
                continue
            stats["containers"] += 1
            start, stop = pos + hsize, pos + hsize + fsize
            kept, e = [], start
            while e < stop:
                # entry header: kind u16, u16, header size u32, payload size u64, ..., arch u32 at 28
                kind, _, ehs, esize = struct.unpack_from("<HHIQ", mm, e)
                arch = struct.unpack_from("<I", mm, e + 28)[0]
                if kind == 2 and arch not in archs:
                    stats["dropped"] += 1
                    stats["dropped_bytes"] += esize
                else:
                    kept.append(bytes(mm[e:e + ehs + esize]))
                    stats["kept"] += 1
                    stats["kept_bytes"] += esize
                e += ehs + esize
            data = b"".join(kept)
            mm[start:start + len(data)] = data
            mm[start + len(data):stop] = b"\0" * (stop - start - len(data))
            struct.pack_into("<Q", mm, pos + 8, len(data))
            pos = stop
        mm.flush()
        mm.close()
    return stats


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "..", ".te"))
    args = ap.parse_args(argv)
    out = os.path.abspath(args.out)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    with tempfile.TemporaryDirectory() as tmp:
        pip_download([f"transformer-engine-cu13=={TE_VERSION}"], tmp)
        (core,) = [os.path.join(tmp, f) for f in os.listdir(tmp) if f.startswith("transformer_engine_cu13")]
        site = os.path.join(tmp, "site")
        with zipfile.ZipFile(core) as z:
            for info in z.infolist():
                p = z.extract(info, site)
                mode = (info.external_attr >> 16) & 0o777
                if mode and not info.is_dir():
                    os.chmod(p, mode)
        os.remove(core)
        lib_dir = os.path.join(site, "transformer_engine", "wheel_lib")
        for name in sorted(os.listdir(lib_dir)):
            if name.endswith(".so"):
                print(name, keep_arch(os.path.join(lib_dir, name)))
        with tarfile.open(os.path.join(out, "te_core.tar.xz"), "w:xz", preset=6) as t:
            for name in sorted(os.listdir(site)):
                t.add(os.path.join(site, name), arcname=name)
    pypi_file("transformer-engine-torch", ".tar.gz", out)
    pip_download(DEPS, out, deps=True)
    pip_download(DEPS_NO_DEPS, out)
    total = 0
    for f in sorted(os.listdir(out)):
        size = os.path.getsize(os.path.join(out, f))
        total += size
        print(f"{size / 2**20:8.1f} MiB  {f}")
    print(f"{total / 2**20:8.1f} MiB in {out}")


if __name__ == "__main__":
    main()
