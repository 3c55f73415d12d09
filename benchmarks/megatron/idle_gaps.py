"""Where a traced step's GPU idle time goes.

The GPU is idle between the device's busy intervals (kernels, copies, memsets; overlapping streams
count once). For each such gap this module names the host work that filled it: the CUDA runtime /
driver calls that overlapped it (a synchronisation, a cudaMalloc, a device-to-host copy) and the ops
that started in it, and the op (and ``bench::`` range, or for a backward op its autograd node) that
launched the kernel after it. The step's edges count too: from the first host op to the first
kernel, and from the last kernel to the end of the last host op.

:func:`analyse` works on plain tuples (tests/test_idle_gaps.py); :func:`from_profiler` reads them from
a ``torch.profiler.profile`` of one step (Kineto's events: times in ns on one clock for host and
device). A kernel is tied to the op that launched it by its ``linked_correlation_id`` (the
``correlation_id`` of the innermost op open at its launch). A kernel launched with no op open (a
``record_function`` range is not one: FlashAttention-4's CuTe DSL kernels, launched through the
driver inside the bench's ranges) has none; it is then tied to its launch call by their shared
CUPTI ``correlation_id``, and to the ops open on that call's thread at that instant.
"""

from __future__ import annotations

import bisect
import collections
import re

# CUDA runtime / driver API calls (host side): cudaLaunchKernel, cuLaunchKernelEx, cudaMalloc, ...
RUNTIME = re.compile(r"^(cuda|cu)[A-Z]")
# the autograd engine's range around a backward node's ops
_NODE = "autograd::engine::evaluate_function: "


class _Threads:
    """The host ops per thread, each with its parent (the op that encloses it), for the question
    "which ops were open on thread T at instant t"."""

    def __init__(self, ops):
        by_thread = collections.defaultdict(list)
        for op in ops:
            by_thread[op[3]].append(op)
        self.threads = {}
        for th, lst in by_thread.items():
            lst.sort(key=lambda o: (o[0], -o[1]))
            parent, stack = [], []
            for i, o in enumerate(lst):
                while stack and lst[stack[-1]][1] < o[0]:
                    stack.pop()
                parent.append(stack[-1] if stack else -1)
                stack.append(i)
            self.threads[th] = ([o[0] for o in lst], lst, parent)

    def innermost(self, thread, t):
        """(thread's list, index) of the innermost op of ``thread`` open at ``t``, or None."""
        entry = self.threads.get(thread)
        if entry is None:
            return None
        starts, lst, parent = entry
        i = bisect.bisect_right(starts, t) - 1
        while i >= 0 and lst[i][1] < t:
            i = parent[i]
        return (thread, i) if i >= 0 else None

    def chain(self, where):
        """The ops from ``where`` outwards (innermost first)."""
        if where is None:
            return []
        thread, i = where
        _, lst, parent = self.threads[thread]
        out = []
        while i >= 0:
            out.append(lst[i])
            i = parent[i]
        return out

    def locate(self, op):
        """(thread, index) of ``op`` itself."""
        starts, lst, _ = self.threads[op[3]]
        i = bisect.bisect_left(starts, op[0])
        while i < len(lst) and lst[i] is not op:
            i += 1
        return (op[3], i) if i < len(lst) else None


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


def overlaps_per_window(events, windows):
    """``windows``: disjoint ``[(start, end)]`` in time order. For each window, {name: summed overlap}
    of ``events`` (``[(start, end, name, ...)]``) with it; each event is placed by bisection, so the
    cost is the events times log(windows), plus the overlaps."""
    ends = [w[1] for w in windows]
    got = [collections.Counter() for _ in windows]
    for ev in events:
        s, e, name = ev[0], ev[1], ev[2]
        i = bisect.bisect_right(ends, s)
        while i < len(windows) and windows[i][0] < e:
            o = min(e, windows[i][1]) - max(s, windows[i][0])
            if o > 0:
                got[i][name] += o
            i += 1
    return got


def analyse(device, runtime, ops, *, top=5, min_gap=20_000, label_prefix="bench::"):
    """The idle report of one traced step.

    - ``device``: ``[(start, end, name, launching op's id[, CUPTI correlation])]`` the GPU's own work;
    - ``runtime``: ``[(start, end, name[, CUPTI correlation, thread])]`` CUDA runtime / driver calls;
    - ``ops``: ``[(start, end, name, thread, id)]`` every other host event (aten ops, ranges).

    Times in ns. Returns a dict (times in ms): ``idle_ms`` (gaps + edges), ``gaps_ms`` / ``n_gaps``
    (gaps of at least ``min_gap`` ns), ``small_gaps_ms`` (the rest), ``head_ms`` / ``tail_ms`` (first
    host op to first kernel, last kernel to the end of the last host op), ``host_calls_ms`` (runtime
    calls' overlap with the counted gaps, summed by name), ``by_label_ms`` (gap time by the ``bench::``
    range that launched the kernel after it, or for a backward op the autograd node it ran in) and
    ``largest`` (the ``top`` longest gaps, each with where it begins from the first kernel, the
    kernel after it, its launching op and range, and the host calls and ops in it)."""
    ms = 1e-6
    threads = _Threads(ops)
    ops_by_id = {o[4]: o for o in ops if o[4] is not None and o[4] > 0}
    launches = {r[3]: r for r in runtime if len(r) > 4 and r[3] is not None and r[3] > 0}
    memo = {}

    def label_of(chain):
        label = next((c[2] for c in chain if c[2].startswith(label_prefix)), None)
        if label is None:  # a backward op (the autograd engine's thread): its node
            label = next((c[2][len(_NODE):] for c in chain if c[2].startswith(_NODE)), None)
        return label

    def launched_by(kernel):
        op_id = kernel[3]
        corr = kernel[4] if len(kernel) > 4 else None
        key = (op_id, corr)
        if key in memo:
            return memo[key]
        got = (None, None)
        o = ops_by_id.get(op_id)
        if o is not None:
            chain = threads.chain(threads.locate(o))
            got = (o[2], label_of(chain))
        elif corr is not None and corr in launches:
            r = launches[corr]
            chain = threads.chain(threads.innermost(r[4], r[0]))
            inner = next((c[2] for c in chain if not c[2].startswith(label_prefix)), None)
            got = (inner or r[2], label_of(chain))
        memo[key] = got
        return got

    all_gaps = gaps([(d[0], d[1], d) for d in device])
    counted = [g for g in all_gaps if g[0] >= min_gap]
    per_gap = overlaps_per_window(runtime, [(g[1], g[2]) for g in counted])
    host_calls = collections.Counter()
    by_label = collections.Counter()
    for g, calls in zip(counted, per_gap):
        host_calls.update(calls)
        by_label[launched_by(g[4])[1] or "(no range)"] += g[0]
    first = min((d[0] for d in device), default=0)
    ops_sorted = sorted(ops, key=lambda o: o[0])
    op_starts = [o[0] for o in ops_sorted]
    largest = []
    for i in sorted(range(len(counted)), key=lambda i: -counted[i][0])[:top]:
        length, s, e, before, after = counted[i]
        op, label = launched_by(after)
        lo, hi = bisect.bisect_left(op_starts, s), bisect.bisect_left(op_starts, e)
        started = collections.Counter(o[2] for o in ops_sorted[lo:hi] if not o[2].startswith(label_prefix))
        largest.append({
            "ms": length * ms, "at_ms": (s - first) * ms, "kernel_after": after[2], "kernel_before": before[2],
            "launched_by": op, "range": label,
            "host_calls_ms": {k: v * ms for k, v in per_gap[i].most_common(4)},
            "ops_started": dict(started.most_common(5)),
        })
    head = tail = 0
    if device and ops:
        head = max(0, first - min(o[0] for o in ops))
        tail = max(0, max(o[1] for o in ops) - max(d[1] for d in device))
    gap_total = sum(g[0] for g in all_gaps)
    counted_total = sum(g[0] for g in counted)
    return {
        "idle_ms": (gap_total + head + tail) * ms,
        "gaps_ms": counted_total * ms,
        "n_gaps": len(counted),
        "small_gaps_ms": (gap_total - counted_total) * ms,
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
    labels). Host threads are told apart by the system thread (``device_resource_id``) where Kineto
    gives it, so that a launch call and the ops around it are on one thread. Runtime calls from a
    thread that ran no op (a communicator's watchdog polling its events) are left out."""
    from torch.autograd import DeviceType

    def thread(e):
        tid = getattr(e, "device_resource_id", lambda: 0)()
        return tid if tid else e.start_thread_id()

    device, runtime, ops = [], [], []
    for e in prof.profiler.kineto_results.events():
        name = e.name()
        if e.device_type() == DeviceType.CUDA:
            if (getattr(e, "is_user_annotation", lambda: False)() or name in skip
                    or name.startswith(("ProfilerStep", "[memory]", "[OutOfMemory]")) or e.end_ns() <= e.start_ns()):
                continue
            device.append((e.start_ns(), e.end_ns(), name, e.linked_correlation_id(), e.correlation_id()))
        elif e.device_type() == DeviceType.CPU:
            if getattr(e, "is_hidden_event", lambda: False)() or name.startswith("["):
                continue
            # (host events linked to an op are its device calls: runtime / driver API)
            if e.linked_correlation_id() > 0 or RUNTIME.match(name):
                runtime.append((e.start_ns(), e.end_ns(), name, e.correlation_id(), thread(e)))
            else:
                ops.append((e.start_ns(), e.end_ns(), name, thread(e), e.correlation_id()))
    op_threads = {o[3] for o in ops}
    runtime = [r for r in runtime if r[4] in op_threads]
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
                     f"(launched by {g['launched_by'] or '?'} in {g['range'] or '?'}); host calls (ms): "
                     f"{calls}; ops started: {ops}")
    return lines
