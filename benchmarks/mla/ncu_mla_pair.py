"""Nsight Compute, side by side: verl_ops' varlen MLA kernels and FlashAttention-4's on the same
batch and data (bf16, causal, 192 / 128), one forward and one backward each.

    ncu --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section ComputeWorkloadAnalysis --section WarpStateStats --section LaunchStats \
        -o pair python benchmarks/mla/ncu_mla_pair.py --batches "RL-ragged H128"
    python benchmarks/mla/ncu_mla_pair.py --summary pair.ncu-rep

The profiled range (cudaProfilerStart / Stop) holds, per batch and method, one forward and one
backward, after warm-up calls outside it (FlashAttention-4 compiles its kernels on the first call).
--summary prints, per kernel of the report, the few numbers that tell a tensor-bound kernel from one
held by shared memory, L2 or latency.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import os
import subprocess
import sys

# Rows of `ncu --page details --csv` kept by --summary: (section, metric name), label.
SUMMARY = [
    (("GPU Speed Of Light Throughput", "Duration"), "duration"),
    (("GPU Speed Of Light Throughput", "SM Frequency"), "SM clock"),
    (("GPU Speed Of Light Throughput", "Compute (SM) Throughput"), "SM %"),
    (("GPU Speed Of Light Throughput", "L1/TEX Cache Throughput"), "L1/TEX %"),
    (("GPU Speed Of Light Throughput", "DRAM Throughput"), "DRAM %"),
    (("Memory Workload Analysis", "L2 Hit Rate"), "L2 hit %"),
    (("Compute Workload Analysis", "Issue Slots Busy"), "issue %"),
    (("Warp State Statistics", "Warp Cycles Per Issued Instruction"), "cyc/issue"),
    (("Launch Statistics", "Grid Size"), "grid"),
    (("Launch Statistics", "Registers Per Thread"), "regs"),
]


def summary(report):
    out = subprocess.run(["ncu", "--import", report, "--page", "details", "--csv"], check=True,
                         capture_output=True, text=True).stdout
    rows = list(csv.DictReader(io.StringIO(out)))
    kernels = {}
    for r in rows:
        key = (r["ID"], r["Kernel Name"][:60])
        kernels.setdefault(key, {})[(r["Section Name"], r["Metric Name"])] = (r["Metric Value"], r["Metric Unit"])
    # The tensor pipe: the Compute Workload Analysis's pipe table is not in the details page; the
    # raw page has it.
    raw = subprocess.run(["ncu", "--import", report, "--page", "raw", "--csv"], check=True,
                         capture_output=True, text=True).stdout
    raw_rows = list(csv.reader(io.StringIO(raw)))
    header = raw_rows[0]
    tensor_cols = [i for i, h in enumerate(header)
                   if "pipe_tensor" in h and h.endswith("pct_of_peak_sustained_active")]
    tensor = {}
    for r in raw_rows[2:]:
        vals = []
        for i in tensor_cols:
            try:
                vals.append((header[i], float(r[i])))
            except (ValueError, IndexError):
                pass
        if vals:
            tensor[r[header.index("ID")]] = max(vals, key=lambda x: x[1])
    print("| kernel | " + " | ".join(label for _, label in SUMMARY) + " | tensor pipe % (active) |")
    print("|---" * (len(SUMMARY) + 2) + "|")
    for (kid, name), m in kernels.items():
        cells = []
        for key, _ in SUMMARY:
            v = m.get(key)
            cells.append(f"{v[0]} {v[1]}".strip() if v else "-")
        t = tensor.get(kid)
        cells.append(f"{t[1]:.1f} ({t[0].split('__')[-1][:40]})" if t else "-")
        print(f"| {kid} {name} | " + " | ".join(cells) + " |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="RL-ragged H128")
    p.add_argument("--methods", default="ours varlen,fa4 varlen")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--summary", default=None, help="print the summary of this .ncu-rep and exit")
    a = p.parse_args(argv)
    if a.summary:
        summary(a.summary)
        return
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_mla  # noqa: E402
    from prof_mla_ops import named_batches  # noqa: E402

    batches = named_batches(a.seed)
    gen = torch.Generator(device="cuda").manual_seed(a.seed)
    work = []
    for label in [b.strip() for b in a.batches.split(",")]:
        lengths, heads = batches[label]
        t = sum(lengths)
        q, k = (torch.randn(t, heads, bench_mla.DQK, device="cuda", dtype=torch.bfloat16, generator=gen)
                for _ in range(2))
        v, g = (torch.randn(t, heads, bench_mla.DV, device="cuda", dtype=torch.bfloat16, generator=gen)
                for _ in range(2))
        cu = torch.tensor([0] + [sum(lengths[: i + 1]) for i in range(len(lengths))], device="cuda",
                          dtype=torch.int32)
        methods = bench_mla.make_methods(lengths, heads, cu, 1.0 / math.sqrt(bench_mla.DQK))
        for name in [m.strip() for m in a.methods.split(",")]:
            fn = methods[name][0]
            qq, kk, vv = (x.detach().clone().requires_grad_(True) for x in (q, k, v))

            def step(fn=fn, qq=qq, kk=kk, vv=vv, g=g):
                out = fn(qq, kk, vv)
                out.backward(g)

            try:
                step()
                step()
            except Exception as e:  # noqa: BLE001 (a missing peer is reported, not fatal)
                print(f"{label} {name}: skipped ({type(e).__name__}: {e})")
                continue
            work.append((label, name, step))
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for label, name, step in work:
        torch.cuda.nvtx.range_push(f"{label} | {name}")
        step()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    torch.cuda.profiler.stop()
    for label, name, _ in work:
        print("profiled:", label, "|", name)


if __name__ == "__main__":
    main()
