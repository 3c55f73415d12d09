"""A CPU output larger than the memory the process may use is refused with an error (op, argument,
shape) instead of being left to the OOM killer (csrc/ops/stable.h, st::output). That bound is the
host's RAM + swap, or less where the process's memory cgroup has a lower limit
(host_memory_bytes: cgroup v1 memory.limit_in_bytes / memory.memsw.limit_in_bytes, cgroup v2
memory.max + memory.swap.max, the parents' limits too).

The bound is read once per process, so each case runs in a child process whose test hooks
(VERL_OPS_PROC_CGROUP for /proc/self/cgroup, VERL_OPS_CGROUP_ROOT for /sys/fs/cgroup) point at a
fake cgroup tree built in tmp_path. The op is the raw jagged_scatter, whose [total_in, 4] float32
output takes 16 * total_in bytes: 64 MiB against a fake 16 MiB limit must be refused, 1 MiB
allowed. The error names the bound, which is checked against the value computed here from the
fake tree and the host's RAM + swap (the reference)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

MIB = 1 << 20
LIMIT = 16 * MIB
TOO_LARGE = 64 * MIB  # output bytes
ALLOWED = 1 * MIB
HUGE = 16 << 40  # past any host: its error names the bound even where there is no cgroup limit
V1_UNLIMITED = 9223372036854771712  # cgroup v1's "no limit" (LONG_MAX rounded down to a page)

CHILD = r"""
import json, sys
import torch
import verl_ops  # noqa: F401
out = []
for nbytes in json.loads(sys.argv[1]):
    try:
        r = torch.ops.verl_ops.jagged_scatter(torch.zeros(3, 4), torch.tensor([0]),
                                              torch.tensor([0, 3], dtype=torch.int32), nbytes // 16)
        out.append({"ok": list(r.shape)})
    except RuntimeError as e:
        out.append({"error": str(e)})
print(json.dumps(out))
"""


def host_ram_swap() -> int:
    """RAM + swap as sysinfo() reports them (the pages of physical memory, SwapTotal)."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with open("/proc/meminfo") as f:
        swap_kib = next(int(line.split()[1]) for line in f if line.startswith("SwapTotal:"))
    return ram + swap_kib * 1024


def host_swap() -> int:
    return host_ram_swap() - os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def write(root, files: dict[str, object]) -> None:
    for rel, value in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{value}\n")


def run_child(tmp_path, proc_cgroup: str, tree: dict[str, object], sizes: list[int]) -> list[dict]:
    root = tmp_path / "cgroup"
    root.mkdir()
    write(root, tree)
    (tmp_path / "proc_cgroup").write_text(proc_cgroup)
    env = dict(os.environ, VERL_OPS_CGROUP_ROOT=str(root), VERL_OPS_PROC_CGROUP=str(tmp_path / "proc_cgroup"))
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(sizes)], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def assert_refused(result: dict, nbytes: int, bound: int) -> None:
    assert "error" in result, f"an output of {nbytes} bytes was allocated against a bound of {bound}: {result}"
    msg = result["error"]
    assert msg.startswith("jagged_scatter: cannot allocate the output sized by total_in"), msg
    assert f"shape [{nbytes // 16}, 4], Float" in msg, msg
    m = re.search(r"cgroup's limit\) of (\d+) bytes", msg)
    assert m is not None, msg
    assert int(m.group(1)) == bound, f"bound {m.group(1)}, expected {bound}: {msg}"


def assert_allowed(result: dict, nbytes: int) -> None:
    assert result == {"ok": [nbytes // 16, 4]}, result


# A v1 host as systemd and docker leave it: the memory controller on a line of its own (or
# sharing its hierarchy with others), a named hierarchy and the empty v2 line besides.
def v1_lines(path: str, controllers: str = "memory") -> str:
    return f"12:name=systemd:/\n4:{controllers}:{path}\n3:cpu,cpuacct:/\n0::/\n"


CASES = {
    # name: (/proc/self/cgroup, files under the cgroup root, expected bound or None for the host's)
    "v1_limit": (v1_lines("/job/step"), {
        "memory/memory.limit_in_bytes": V1_UNLIMITED,
        "memory/job/memory.limit_in_bytes": V1_UNLIMITED,
        "memory/job/step/memory.limit_in_bytes": LIMIT,
    }, lambda: LIMIT + host_swap()),
    # memsw bounds RAM + swap together: it wins over limit_in_bytes + the host's swap.
    "v1_memsw": (v1_lines("/job", "blkio,memory"), {
        "memory/job/memory.limit_in_bytes": V1_UNLIMITED,
        "memory/job/memory.memsw.limit_in_bytes": LIMIT,
    }, lambda: LIMIT),
    "v1_parent": (v1_lines("/job/step"), {
        "memory/job/memory.limit_in_bytes": LIMIT,
        "memory/job/memory.memsw.limit_in_bytes": LIMIT,
        "memory/job/step/memory.limit_in_bytes": V1_UNLIMITED,
        "memory/job/step/memory.memsw.limit_in_bytes": V1_UNLIMITED,
    }, lambda: LIMIT),
    # Inside a container: /proc/self/cgroup names the host's path, the mount is the container's.
    "v1_mount_root": (v1_lines("/docker/0123abcd"), {
        "memory/memory.limit_in_bytes": LIMIT,
        "memory/memory.memsw.limit_in_bytes": LIMIT,
    }, lambda: LIMIT),
    "v1_unlimited": (v1_lines("/job"), {
        "memory/memory.limit_in_bytes": V1_UNLIMITED,
        "memory/job/memory.limit_in_bytes": V1_UNLIMITED,
        "memory/job/memory.memsw.limit_in_bytes": V1_UNLIMITED,
    }, None),
    "v2_limit": ("0::/user.slice/job.scope\n", {
        "user.slice/job.scope/memory.max": LIMIT,
        "user.slice/job.scope/memory.swap.max": 0,
        "user.slice/memory.max": "max",
    }, lambda: LIMIT),
    # No memory.swap.max (no swap accounting): the host's swap stays usable.
    "v2_limit_no_swap_file": ("0::/job\n", {"job/memory.max": LIMIT}, lambda: LIMIT + host_swap()),
    "v2_max": ("0::/job\n", {"job/memory.max": "max", "job/memory.swap.max": "max"}, None),
    "v2_parent": ("0::/kubepods/pod1/ctr\n", {
        "kubepods/memory.max": "max",
        "kubepods/pod1/memory.max": LIMIT,
        "kubepods/pod1/memory.swap.max": 0,
        "kubepods/pod1/ctr/memory.max": 1 << 30,
        "kubepods/pod1/ctr/memory.swap.max": "max",
    }, lambda: LIMIT),
    # A cgroup namespace shows "/", the mount's root being the container's cgroup.
    "v2_namespace_root": ("0::/\n", {"memory.max": LIMIT, "memory.swap.max": 0}, lambda: LIMIT),
    "unreadable": ("0::/job\n", {"job/memory.max": "garbage", "job/memory.swap.max": ""}, None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_cpu_output_bounded_by_cgroup(tmp_path, name):
    proc_cgroup, tree, expected = CASES[name]
    bound = host_ram_swap() if expected is None else expected()
    assert bound < HUGE
    if expected is not None and bound >= TOO_LARGE:
        pytest.skip(f"the host's swap ({host_swap()} bytes) lifts the bound over {TOO_LARGE} bytes")
    too_large, allowed, huge = run_child(tmp_path, proc_cgroup, tree, [TOO_LARGE, ALLOWED, HUGE])
    assert_allowed(allowed, ALLOWED)
    if expected is None:  # no cgroup bound: 64 MiB is fine, only what exceeds the host is refused
        assert_allowed(too_large, TOO_LARGE)
    else:
        assert_refused(too_large, TOO_LARGE, bound)
    assert_refused(huge, HUGE, bound)


def test_no_cgroup_files(tmp_path):
    """Neither /proc/self/cgroup nor the mount there: the host's RAM + swap, no error."""
    env = dict(os.environ, VERL_OPS_CGROUP_ROOT=str(tmp_path / "absent"),
               VERL_OPS_PROC_CGROUP=str(tmp_path / "absent_cgroup"))
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps([TOO_LARGE, HUGE])], capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    too_large, huge = json.loads(r.stdout.strip().splitlines()[-1])
    assert_allowed(too_large, TOO_LARGE)
    assert_refused(huge, HUGE, host_ram_swap())
