"""Importing verl_ops (the package, its Megatron integration, the verl plugin's module) loads no
part of cuDNN beyond what ``import torch`` loads.

A library that loads part of cuDNN at import changes which cuDNN a later import picks up:
TransformerEngine's core library names every cuDNN library as a dependency, and where the
machine has its own cuDNN beside torch's, a process that has loaded torch's libcudnn_graph
before importing TE gets a mix of the two and TE's import fails. verl loads the verl_ops plugin in
every worker before it builds the model (and imports TE), so the import must not do that.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

_CHILD = r"""
import sys

def cudnn_libs():
    with open("/proc/self/maps") as f:
        return sorted({line.split()[-1].rsplit("/", 1)[-1] for line in f if "libcudnn" in line})

import torch
before = cudnn_libs()
import verl_ops
import verl_ops_plugin
try:
    import megatron.core  # noqa: F401
except Exception:
    pass
else:
    import verl_ops.integrations.megatron_mla  # noqa: F401
after = cudnn_libs()
print("BEFORE", before)
print("AFTER", after)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_import_loads_no_more_of_cudnn_than_torch():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
               VERL_OPS_PLUGIN="off")
    res = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in res.stdout.splitlines() if line.startswith(("BEFORE", "AFTER")))
    before, after = ast.literal_eval(lines["BEFORE"]), ast.literal_eval(lines["AFTER"])
    assert after == before, f"importing verl_ops loaded {sorted(set(after) - set(before))} (torch had {before})"
