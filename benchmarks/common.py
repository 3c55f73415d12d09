"""What the benchmark scripts share: timing, the device line, floors, markdown tables, batches.

Every script of an area folder (benchmarks/<area>/<script>.py) imports it the same way:

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
    import common  # noqa: E402

Importing it makes ``verl_ops`` importable from a checkout that is not installed (the repository
root joins ``sys.path`` when ``import verl_ops`` fails).

Timing (seconds, medians):
  device_time(fn, device, n)      fn(i) between CUDA events, a sleep kernel hiding launch overhead
                                  (verl_ops.timing; CPU: wall clock per call)
  wall_time(fn, device, n)        wall clock of fn() up to a synchronisation (verl_ops.timing)
  time_cuda(fn, reps)             device_time of fn() on the current GPU
  ranked_time(fn, device, ...)    every rank starts each repeat together (barrier), CUDA events,
                                  median per rank, the slowest rank's median
  sustain(fn, seconds)            back-to-back calls first: times at the sustained clock
  stepped_wall_time(fn, reps, group, device)
                                  every rank starts each repeat together (barrier), wall clock,
                                  this rank's median
Processes: launch (torchrun or spawned ranks), init_ranks (the process group and this rank's
device), compare_with_verl (a drop-in timed against verl's function on a tests/_dist.py pool).
Floors: copy_bandwidth (bytes read + written per second of a device copy), matmul_tflops (bf16
8192^3). The device line: device_name, gpu_name, device_line, commit, command. Markdown:
md_table. Batches: lognormal_lengths, scaled_lengths, rl_ragged_lengths.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
TESTS = os.path.join(ROOT, "tests")

try:
    import verl_ops  # noqa: F401
except ImportError:  # run from a checkout without installing: the package is two folders up
    sys.path.insert(0, ROOT)
    import verl_ops  # noqa: F401

from verl_ops.timing import device_time, sync, wall_time  # noqa: E402,F401  (re-exported)


def use_tests_dir() -> None:
    """Put tests/ on sys.path (verl_stubs, _dist, megatron_model_lib, the verl loaders)."""
    if TESTS not in sys.path:
        sys.path.insert(0, TESTS)


# --------------------------------------------------------------------------------------------
# Timing


def time_cuda(fn, reps, warmup=3):
    """Median device time of fn() in seconds (verl_ops.timing: CUDA events, launch overhead hidden)."""
    return device_time(lambda i: fn(), torch.device("cuda"), n=reps, warmup=warmup)


def sustain(fn, seconds):
    """Run fn back to back for `seconds` (then wait for it): the GPU reaches the clock it holds under
    sustained load (on an H200 at its 700 W cap ~1.55 GHz instead of 1.98) before a timing starts,
    as in a training step, instead of timing a short burst at boost clocks."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        fn()
        torch.cuda.synchronize()


def ranked_time(fn, device, repeats, warmup):
    """Per-rank time of fn() under torch.distributed: ``warmup`` calls, then ``repeats`` calls, the
    ranks released together by a barrier before each; CUDA events around each call (CPU: wall
    clock); the median per rank, and the slowest rank's median returned (seconds)."""
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def stepped_wall_time(fn, reps, group=None, device=None):
    """This rank's median wall time of fn() over ``reps`` calls (seconds), the ranks of ``group``
    released together by a barrier before each; a CUDA ``device`` is synchronised around each call."""
    import torch.distributed as dist

    cuda = device is not None and device.type == "cuda"
    ts = []
    for _ in range(reps):
        dist.barrier(group)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def gpu_ops_and_syncs(fn, device):
    """(number of GPU activities of one call, whether it host-synchronises) on CUDA; ('n/a', 'n/a') on CPU."""
    if device.type != "cuda":
        return "n/a", "n/a"
    n_ops = "?"
    try:
        from torch.profiler import ProfilerActivity, profile

        sync(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            sync(device)
        n_ops = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    except Exception as e:  # profiler unavailable (CUPTI) or API change: not fatal
        n_ops = f"? ({type(e).__name__})"
    syncs = "?"
    try:
        torch.cuda.set_sync_debug_mode("error")
        try:
            fn()
            syncs = "no"
        except RuntimeError:
            syncs = "YES"
        finally:
            torch.cuda.set_sync_debug_mode(0)
    except Exception:
        pass
    sync(device)
    return n_ops, syncs


def profile_calls(fn, reps, warmup=3):
    """torch.profiler (CUDA activity) over ``reps`` calls of fn, after ``warmup`` calls outside it."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return prof


# --------------------------------------------------------------------------------------------
# Processes


def launch(run, args, nproc, too_few):
    """Call ``run(rank, world, args[, init_file])`` on every rank: in this process under torchrun
    (RANK and WORLD_SIZE set), else on ``nproc`` spawned processes that join through a file (fewer
    than 2: exit with ``too_few``)."""
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return
    if nproc < 2:
        raise SystemExit(too_few)
    with tempfile.TemporaryDirectory() as d:
        torch.multiprocessing.spawn(_spawned, args=(run, nproc, args, os.path.join(d, "init")), nprocs=nproc,
                                    join=True)


def _spawned(rank, run, world, args, init_file):
    run(rank, world, args, init_file)


def init_ranks(rank, world, backend, init_file=None, timeout_s=300):
    """Join the process group (through ``init_file`` when spawned by :func:`launch`, from the
    environment under torchrun); NCCL: one GPU per local rank. Returns this rank's device."""
    import torch.distributed as dist

    kwargs = {"init_method": f"file://{init_file}", "rank": rank, "world_size": world} if init_file else {}
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
        kwargs["device_id"] = device
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return device


def compare_with_verl(args, name, columns, tasks, missing):
    """verl_ops' ``name`` against verl's on a pool of ``args.world`` ``args.backend`` ranks
    (tests/_dist.py): one markdown row per task, printed as it comes, the table written to
    ``args.out``. Returns the exit status.

    columns: the table's leading column names (then verl, verl_ops, speedup, ``columns[-1]``:
    whether the results are equal). tasks: ``(ref, task_args, lead)``: ``ref`` runs on every rank
    and returns ``(equal, {"verl": s, "verl_ops": s}, extra)``, or None where verl's function cannot
    be loaded (``missing`` printed, status 1); ``lead(extra)`` of rank 0 gives the row's leading
    cells."""
    use_tests_dir()
    from _dist import DistPool

    pool = DistPool(args.world, args.backend, pg_timeout_s=120.0)
    where = "on the CPU" if args.backend == "gloo" else f"({torch.cuda.get_device_name(0)} each)"
    head = [*columns[:-1], "verl", "verl_ops", "speedup", columns[-1]]
    lines = [f"### {name} vs verl's, {args.world} {args.backend} ranks {where} (torch {torch.__version__})", "",
             *md_table(head, [])]
    print("\n".join(lines), flush=True)
    try:
        for ref, task_args, lead in tasks:
            res = pool.run(ref, *task_args, timeout_s=900)
            if res[0] is None:
                print(missing)
                return 1
            _, t, extra = res[0]
            ok = all(r[0] for r in res)
            row = (f"| {lead(extra)} | {t['verl'] * 1e3:.1f} ms | {t['verl_ops'] * 1e3:.1f} ms | "
                   f"{t['verl'] / t['verl_ops']:.1f}x | {'yes' if ok else 'NO'} |")
            lines.append(row)
            print(row, flush=True)
    finally:
        pool.close()
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


def dist_arguments(description):
    """The argument parser of a :func:`compare_with_verl` script: --world, --backend, --reps, --out."""
    import argparse

    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"], help="nccl: one GPU per rank")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None)
    return ap


# --------------------------------------------------------------------------------------------
# Floors


def copy_bandwidth(device, nbytes, gen):
    """Bytes read + written per second of a device-to-device copy_ of ``nbytes`` (median)."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=gen)
    dst = torch.empty_like(src)
    t = device_time(lambda i: dst.copy_(src), device, n=10 if device.type == "cuda" else 3, warmup=2)
    del src, dst
    return 2 * nbytes / t


def matmul_tflops(reps, sustain_s=0.0):
    """bf16 8192^3 matmul rate on the current GPU, TFLOP/s (after ``sustain_s`` s of back-to-back calls)."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    if sustain_s:
        sustain(lambda: a @ b, sustain_s)
    t = time_cuda(lambda: a @ b, reps)
    return 2 * n**3 / t / 1e12


# --------------------------------------------------------------------------------------------
# The device line


def gpu_name(device):
    """The GPU's name, or "CPU"."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def device_name(device):
    """The GPU's name, or the CPU's (processor, cores)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def device_line(device):
    """The GPU's name, memory and SM count, or "CPU"."""
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return f"{p.name} ({p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs)"
    return "CPU"


def commit():
    """The checkout's commit (short hash, "+" when the tree has changes), or "?" outside git."""
    try:
        run = lambda *a: subprocess.run(["git", "-C", ROOT, *a], capture_output=True, text=True, timeout=10)  # noqa: E731
        head = run("rev-parse", "--short", "HEAD")
        if head.returncode != 0:
            return "?"
        dirty = run("status", "--porcelain", "--untracked-files=no").stdout.strip()
        return head.stdout.strip() + ("+" if dirty else "")
    except Exception:  # noqa: BLE001  (no git)
        return "?"


def command(argv=None):
    """The command line as typed (shell-quoted): sys.argv, or ``argv``."""
    return " ".join(shlex.quote(a) for a in (sys.argv if argv is None else argv))


# --------------------------------------------------------------------------------------------
# Markdown


def md_table(head, rows, align=None):
    """Lines of a markdown table: the header, the rule ("---" per column, or ``align``'s cells, e.g.
    "---:"), then each row (a list of cells, or a line already written)."""
    rule = align or ["---"] * len(head)
    out = ["| " + " | ".join(head) + " |", "|" + "".join(f"{r}|" for r in rule)]
    for r in rows:
        out.append(r if isinstance(r, str) else "| " + " | ".join(str(c) for c in r) + " |")
    return out


def fmt_t(s):
    """A time in seconds as µs / ms / s ("-" for None)."""
    if s is None:
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.1f} µs"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


def fmt_b(b):
    """A size in bytes as kB / MB / GB."""
    if b >= 1e9:
        return f"{b / 1e9:.2f} GB"
    if b >= 1e6:
        return f"{b / 1e6:.1f} MB"
    return f"{b / 1e3:.1f} kB"


# --------------------------------------------------------------------------------------------
# Batches: RL-shaped sequence lengths


def lognormal_lengths(n: int, median: float, seed: int, sigma: float = 1.0, max_len: int | None = None) -> list:
    """``n`` lengths ``round(median * exp(N(0, sigma)))``, at least 1 and at most ``max_len``; the
    same list for the same arguments (``random.Random(seed)``): the way response lengths of an RL
    micro-batch spread (tens to thousands of tokens)."""
    rng = random.Random(seed)
    out = [max(1, int(round(median * math.exp(rng.gauss(0.0, sigma))))) for _ in range(n)]
    return out if max_len is None else [min(max_len, x) for x in out]


def scaled_lengths(batch: int, total: int, seed: int) -> list:
    """``batch`` log-normal (sigma 1) lengths scaled to sum to exactly ``total``."""
    rng = random.Random(seed)
    w = [rng.lognormvariate(0.0, 1.0) for _ in range(batch)]
    s = sum(w)
    lengths = [max(1, int(x / s * total)) for x in w]
    diff = total - sum(lengths)
    i = 0
    while diff != 0:  # spread the rounding remainder
        step = 1 if diff > 0 else -1
        if lengths[i % batch] + step >= 1:
            lengths[i % batch] += step
            diff -= step
        i += 1
    return lengths


def rl_ragged_lengths(seed=0, tokens=32 * 1024, median=1500, sigma=0.9, lo=64, hi=8192):
    """RL-like response lengths: log-normal (median, sigma) clipped to [lo, hi], drawn until the
    batch holds `tokens` (the last one cut to fit; dropped if that leaves it under lo)."""
    r = random.Random(seed)
    out, total = [], 0
    while total < tokens:
        n = min(hi, max(lo, int(round(r.lognormvariate(math.log(median), sigma)))))
        n = min(n, tokens - total)
        if n < lo:
            break
        out.append(n)
        total += n
    return out
