"""Where a traced step's GPU idle time goes.

The GPU is idle between the device's busy intervals (kernels, copies, memsets; overlapping streams
count once). For each such gap this module names the host work that filled it: the CUDA runtime /
driver calls that overlapped it (a synchronisation, a cudaMalloc, a device-to-host copy) and the ops
that started in it, and the op (and ``bench::`` range) that launched the kernel after it. The step's
edges count too: from the first host op to the first kernel, and from the last kernel to the
last host call.

:func:`analyse` works on plain tuples (tests/test_idle_gaps.py); :func:`from_profiler` reads them from
a ``torch.profiler.profile`` of one step (Kineto's events: times in ns on one clock for host and
device; a kernel's ``linked_correlation_id`` is the ``correlation_id`` of the op that launched it).
"""

from __future__ import annotations

import bisect
import collections
import re

# CUDA runtime / driver API calls (host side): cudaLaunchKernel, cuLaunchKernelEx, cudaMalloc, ...
RUNTIME = re.compile(r"^(cuda|cu)[A-Z]")
# the autograd engine's range around a backward node's ops
_NODE = "autograd::engine::evaluate_function: "


def gaps(device):
    """``device``: ``[(start, end, payload)]``. The gaps in the union of the intervals, in time order:
    ``[(length, start, end, payload before, payload after)]`` (before: the interval that ended last
    before the gap)."""
    out = []
    end = last = None
    for s, e, p in sorted(device, key=lambda x: (x[0], x[1])):
        if end is not None and s > end:
            out.append((s - end, end, s, last, p))
        if end is None or e > end:
            end, last = e, p
    return out


def overlap_by_name(events, start, end):
    """``events``: ``[(start, end, name)]``. {name: summed overlap with [start, end]}."""
    got = collections.Counter()
    for s, e, name in events:
        o = min(e, end) - max(s, start)
        if o > 0:
            got[name] += o
    return got


def _enclosing(ops_by_thread, thread, t):
    """The ops of ``thread`` whose interval holds instant ``t``, outermost first."""
    starts, ops = ops_by_thread.get(thread, ([], []))
    i = bisect.bisect_right(starts, t)
    return [op for op in ops[:i] if op[1] >= t]


def analyse(device, runtime, ops, *, top=5, min_gap=20_000, label_prefix="bench::"):
    """The idle report of one traced step.

    - ``device``: ``[(start, end, name, launching op's id)]`` the GPU's own work;
    - ``runtime``: ``[(start, end, name)]`` CUDA runtime / driver calls;
    - ``ops``: ``[(start, end, name, thread, id)]`` every other host event (aten ops, ranges).

    Times in ns. Returns a dict (times in ms): ``idle_ms`` (gaps + edges), ``gaps_ms`` / ``n_gaps``
    (gaps of at least ``min_gap`` ns), ``small_gaps_ms`` (the rest), ``head_ms`` / ``tail_ms`` (first
    host op to first kernel, last kernel to last host call), ``host_calls_ms`` (runtime calls'
    overlap with the counted gaps, summed by name), ``by_label_ms`` (gap time by the ``bench::`` range
    that launched the kernel after it, or for a backward op the autograd node it ran in) and ``largest`` (the ``top`` longest gaps, each with where it
    begins from the first kernel, the kernel after it, its launching op and range, and the host calls
    and ops in it)."""
    ms = 1e-6
    by_thread = collections.defaultdict(list)
    for op in ops:
        by_thread[op[3]].append(op)
    ops_by_thread = {}
    for th, lst in by_thread.items():
        lst.sort(key=lambda o: (o[0], -o[1]))
        ops_by_thread[th] = ([o[0] for o in lst], lst)
    ops_by_id = {o[4]: o for o in ops if o[4] is not None and o[4] > 0}
    runtime_spans = [(r[0], r[1], r[2]) for r in runtime]

    def launched_by(op_id):
        o = ops_by_id.get(op_id)
        if o is None:
            return None, None
        chain = _enclosing(ops_by_thread, o[3], o[0])
        label = next((c[2] for c in reversed(chain) if c[2].startswith(label_prefix)), None)
        if label is None:  # a backward op (the autograd engine's thread): its node
            label = next((c[2][len(_NODE):] for c in reversed(chain) if c[2].startswith(_NODE)), None)
        return o[2], label

    all_gaps = gaps([(s, e, (name, corr)) for s, e, name, corr in device])
    counted = [g for g in all_gaps if g[0] >= min_gap]
    host_calls = collections.Counter()
    by_label = collections.Counter()
    for length, s, e, _, (_, corr) in counted:
        host_calls.update(overlap_by_name(runtime_spans, s, e))
        by_label[launched_by(corr)[1] or "(no range)"] += length
    first = min((d[0] for d in device), default=0)
    largest = []
    for length, s, e, before, (name, corr) in sorted(counted, key=lambda g: -g[0])[:top]:
        op, label = launched_by(corr)
        started = collections.Counter(o[2] for o in ops if s <= o[0] < e and not o[2].startswith(label_prefix))
        largest.append({
            "ms": length * ms, "at_ms": (s - first) * ms, "kernel_after": name, "kernel_before": before[0],
            "launched_by": op, "range": label,
            "host_calls_ms": {k: v * ms for k, v in overlap_by_name(runtime_spans, s, e).most_common(4)},
            "ops_started": dict(started.most_common(5)),
        })
    host_times = [o[0] for o in ops] + [r[0] for r in runtime]
    host_ends = [o[1] for o in ops] + [r[1] for r in runtime]
    head = tail = 0
    if device and host_times:
        head = max(0, min(d[0] for d in device) - min(host_times))
        tail = max(0, max(host_ends) - max(d[1] for d in device))
    gap_total = sum(g[0] for g in all_gaps)
    return {
        "idle_ms": (gap_total + head + tail) * ms,
        "gaps_ms": sum(g[0] for g in counted) * ms,
        "n_gaps": len(counted),
        "small_gaps_ms": (gap_total - sum(g[0] for g in counted)) * ms,
        "min_gap_us": min_gap / 1000,
        "head_ms": head * ms,
        "tail_ms": tail * ms,
        "host_calls_ms": {k: v * ms for k, v in host_calls.most_common(6)},
        "by_label_ms": {k: v * ms for k, v in by_label.most_common(6)},
        "largest": largest,
    }


def from_profiler(prof, *, skip=(), top=5, min_gap=20_000):
    """:func:`analyse` on a ``torch.profiler.profile`` (CPU + CUDA activities) of one step. ``skip``:
    names of host ranges whose device-side copies are not the GPU's own work (record_function
    labels)."""
    from torch.autograd import DeviceType

    device, runtime, ops = [], [], []
    for e in prof.profiler.kineto_results.events():
        name = e.name()
        if e.device_type() == DeviceType.CUDA:
            if getattr(e, "is_user_annotation", lambda: False)() or name in skip or name.startswith("ProfilerStep"):
                continue
            device.append((e.start_ns(), e.end_ns(), name, e.linked_correlation_id()))
        elif e.device_type() == DeviceType.CPU:
            if getattr(e, "is_hidden_event", lambda: False)():
                continue
            # (host events linked to an op are its device calls: runtime / driver API)
            if e.linked_correlation_id() > 0 or RUNTIME.match(name):
                runtime.append((e.start_ns(), e.end_ns(), name))
            else:
                ops.append((e.start_ns(), e.end_ns(), name, e.start_thread_id(), e.correlation_id()))
    return analyse(device, runtime, ops, top=top, min_gap=min_gap)


def describe(path, report, *, top=3):
    """Markdown lines for one path's report."""
    r = report
    calls = ", ".join(f"{k} {v:.2f} ms" for k, v in r["host_calls_ms"].items()) or "none"
    labels = ", ".join(f"{k} {v:.2f} ms" for k, v in r["by_label_ms"].items()) or "none"
    lines = [f"- GPU idle of one traced {path} step: {r['idle_ms']:.2f} ms = {r['n_gaps']} gaps of >= "
             f"{r['min_gap_us']:.0f} us ({r['gaps_ms']:.2f} ms) + smaller gaps {r['small_gaps_ms']:.2f} ms + "
             f"before the first kernel {r['head_ms']:.2f} ms + after the last {r['tail_ms']:.2f} ms. "
             f"Host calls during the gaps: {calls}. Gap time by the range that launched the next "
             f"kernel: {labels}."]
    for g in r["largest"][:top]:
        calls = ", ".join(f"{k} {v:.2f}" for k, v in g["host_calls_ms"].items()) or "none"
        ops = ", ".join(f"{k} x{v}" for k, v in g["ops_started"].items()) or "none"
        lines.append(f"  - {g['ms']:.2f} ms at {g['at_ms']:.1f} ms, before `{g['kernel_after'][:70]}` "
                     f"(launched by {g['launched_by']} in {g['range']}); host calls (ms): {calls}; "
                     f"ops started: {ops}")
    return lines
