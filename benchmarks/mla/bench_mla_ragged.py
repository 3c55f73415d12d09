"""mla_forward_padded on ragged causal self-attention batches: padded vs native backends
(forward and forward+backward, CUDA events, median), outputs cross-checked first.

    python3 benchmarks/mla/bench_mla_ragged.py [--out results.md]
"""

from __future__ import annotations

import argparse
import sys

import torch

import verl_ops
from verl_ops.timing import device_time

BATCHES = {
    "4 seqs ~3.6k (fill 0.89)": [4096, 3500, 3900, 3072],
    "16 seqs 512-2048 (fill 0.62)": [2048, 512, 1024, 1536, 2000, 700, 1900, 1200, 600, 1800, 1000, 2048, 900, 1400, 1700, 800],
    "8 seqs ~8k (fill 0.94)": [8192, 7800, 7500, 8000, 7900, 7300, 8192, 7700],
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    h, dqk, dv = args.heads, 192, 128
    lines = [
        f"## mla_forward_padded, ragged causal self-attention ({torch.cuda.get_device_name()}, {h} heads, 192/128 bf16)",
        "",
        "| batch | backend | fwd ms | fwd+bwd ms | native speedup fwd / fwd+bwd |",
        "|---|---|---|---|---|",
    ]
    g = torch.Generator(device=dev).manual_seed(0)
    for name, lengths in BATCHES.items():
        t, s = sum(lengths), max(lengths)
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=dev)
        q = torch.randn(t, h, dqk, device=dev, dtype=torch.bfloat16, generator=g)
        k = torch.randn(t, h, dqk, device=dev, dtype=torch.bfloat16, generator=g)
        v = torch.randn(t, h, dv, device=dev, dtype=torch.bfloat16, generator=g)
        go = torch.randn(t, h, dv, device=dev, dtype=torch.bfloat16, generator=g)
        res = {}
        outs = {}
        for backend in ("padded", "native"):
            fwd = lambda i, b=backend: verl_ops.mla_forward_padded(q, k, v, cu, cu, s, s, backend=b)  # noqa: E731
            outs[backend] = fwd(0).float()
            qg, kg, vg = (x.detach().requires_grad_(True) for x in (q, k, v))

            def both(i, b=backend):
                o = verl_ops.mla_forward_padded(qg, kg, vg, cu, cu, s, s, backend=b)
                torch.autograd.backward(o, go)
                qg.grad = kg.grad = vg.grad = None

            with torch.no_grad():
                tf = device_time(fwd, dev, args.reps)
            res[backend] = (tf, device_time(both, dev, args.reps))
        err = float((outs["native"] - outs["padded"]).norm() / outs["padded"].norm())
        if not err < 2e-2:
            print(f"{name}: native and padded disagree (relative difference {err:.3g})")
            return 1
        for backend in ("padded", "native"):
            tf, tb = res[backend]
            sp = "" if backend == "padded" else f"{res['padded'][0] / tf:.2f}x / {res['padded'][1] / tb:.2f}x"
            lines.append(f"| {name} | {backend} | {tf * 1e3:.3f} | {tb * 1e3:.3f} | {sp} |")
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
