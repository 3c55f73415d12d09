"""Token balance of dynamic CP assignments (CPU, no process group needed).

For random micro-batches with log-normal sequence lengths, reports the tokens of the busiest CP
group relative to the mean (max/mean; 1.00 is perfect balance) for verl's contiguous assignment
and for the token-balanced (LPT) one, plus the same ratio for attention work (sum of len^2 per
group), which balanced-by-tokens does not target but usually improves too.

    python3 benchmarks/dcp/dynamic_cp_balance.py [--trials 200] [--out table.md]
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: common.py
import common  # noqa: E402,F401  (puts the checkout on the path when verl_ops is not installed)
import verl_ops  # noqa: E402

# (name, dp_size, sequences per micro-batch, median length, sigma, max length, max_seqlen_per_dp_cp_rank)
CONFIGS = [
    ("RL responses, short", 8, 64, 1500, 1.0, 16384, 8192),
    ("RL responses, short", 16, 128, 1500, 1.0, 16384, 8192),
    ("RL responses, long tail", 8, 64, 3000, 1.2, 32768, 8192),
    ("RL responses, long tail", 16, 256, 3000, 1.2, 32768, 8192),
    ("SFT, long context", 32, 128, 8000, 0.8, 131072, 16384),
    ("few sequences per group", 16, 20, 2000, 1.0, 16384, 8192),
]


def ratios(plan):
    tokens = plan.group_tokens()
    work = [sum(plan.lengths[i] ** 2 for i in g) for g in plan.groups]
    mean_t, mean_w = statistics.fmean(tokens), statistics.fmean(work)
    return (max(tokens) / mean_t if mean_t else 1.0, max(work) / mean_w if mean_w else 1.0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    lines = [
        f"Dynamic CP token balance, {args.trials} random micro-batches per row, log-normal lengths "
        "(median, sigma), clipped to [1, max]. Mean over micro-batches of max/mean per CP group.",
        "",
        "| workload | dp | seqs | median len | sigma | max_seqlen_per_dp_cp_rank | mean local_cp_size | groups "
        "| tokens max/mean contiguous | tokens max/mean balanced | attn work max/mean contiguous | attn work max/mean balanced |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, dp, B, median, sigma, cap, per_rank in CONFIGS:
        acc = {"c": [], "b": [], "cw": [], "bw": [], "lcs": [], "g": []}
        for _ in range(args.trials):
            lengths = [min(cap, max(1, int(rng.lognormvariate(math.log(median), sigma)))) for _ in range(B)]
            c = verl_ops.plan_dynamic_cp(lengths, dp, per_rank)
            b = verl_ops.plan_dynamic_cp(lengths, dp, per_rank, assignment="balanced")
            (ct, cw), (bt, bw) = ratios(c), ratios(b)
            acc["c"].append(ct)
            acc["b"].append(bt)
            acc["cw"].append(cw)
            acc["bw"].append(bw)
            acc["lcs"].append(c.local_cp_size)
            acc["g"].append(c.num_groups)
        m = {k: statistics.fmean(v) for k, v in acc.items()}
        lines.append(
            f"| {name} | {dp} | {B} | {median} | {sigma} | {per_rank} | {m['lcs']:.2f} | {m['g']:.2f} "
            f"| {m['c']:.2f} | {m['b']:.2f} | {m['cw']:.2f} | {m['bw']:.2f} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
