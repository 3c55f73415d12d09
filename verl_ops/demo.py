"""verl_ops demo: pack a random batch into THD rows, shard it for context parallelism, unpack it,
check the roundtrip exactly, and time it against a plain per-sequence PyTorch loop.

    python -m verl_ops                      # CUDA when available, else CPU
    python -m verl_ops --device cpu --batch 64 --hidden 512

Exits with status 1 when any output differs from the expected one.

The loop baseline (:func:`loop_pack` / :func:`loop_unpack`) is verl's algorithm
(``preprocess_thd_engine`` / ``postprocess_thd_engine``): a zeros buffer, then a Python loop over
the sequences that copies each sequence's slice (or its two zigzag chunks) into place. It is also
the reference that ``benchmarks/thd/bench_thd.py`` checks the ops against.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

import verl_ops
from verl_ops.timing import format_seconds, wall_time

# --------------------------------------------------------------------------------------------
# The per-sequence loop (verl's algorithm, written from docs/layout.md#pack).


def loop_pack(get_seq, lengths, cu_padded, local_rows, cp_size, cp_rank, cp_layout, feat, dtype, device):
    """Pack one CP rank's THD rows with a Python loop over sequences.

    ``get_seq(i)`` returns sequence i's valid tokens ``[len_i, *feat]``; ``lengths`` and
    ``cu_padded`` are Python int lists (valid lengths, padded prefix sums). Returns
    ``(packed [local_rows, *feat], position_ids [local_rows])``; padding rows are zero and their
    position ids are left at 0 (as verl does).
    """
    out = torch.zeros((local_rows, *feat), dtype=dtype, device=device)
    pos = torch.zeros(local_rows, dtype=torch.long, device=device)
    if cp_size == 1 or cp_layout == "contiguous":
        lo, hi = cp_rank * local_rows, (cp_rank + 1) * local_rows
        for i, n in enumerate(lengths):
            s = cu_padded[i]
            a, b = max(lo, s), min(hi, s + n)
            if a >= b:
                continue
            d = get_seq(i)
            out[a - lo : b - lo] = d[a - s : b - s]
            pos[a - lo : b - lo] = torch.arange(a - s, b - s, dtype=torch.long, device=device)
        return out, pos
    for i, n in enumerate(lengths):  # zigzag: chunks r and 2*cp-1-r of 2*cp equal chunks
        chunk = (cu_padded[i + 1] - cu_padded[i]) // (2 * cp_size)
        base = cu_padded[i] // cp_size
        d = None
        for k, c in enumerate((cp_rank, 2 * cp_size - 1 - cp_rank)):
            src0, src1 = c * chunk, min((c + 1) * chunk, n)
            if src1 <= src0:
                continue
            if d is None:
                d = get_seq(i)
            dst = base + k * chunk
            out[dst : dst + src1 - src0] = d[src0:src1]
            pos[dst : dst + src1 - src0] = torch.arange(src0, src1, dtype=torch.long, device=device)
    return out, pos


def loop_unpack(shards, lengths, cu_padded, cp_size, cp_layout):
    """verl's unpack: all ranks' shards (a list of ``[local_rows, *F]``) -> jagged nested tensor."""
    out = []
    if cp_size == 1 or cp_layout == "contiguous":
        packed = shards[0] if cp_size == 1 else torch.cat(list(shards), dim=0)
        for i, n in enumerate(lengths):
            out.append(packed[cu_padded[i] : cu_padded[i] + n])
        return torch.nested.as_nested_tensor(out, layout=torch.jagged)
    for i, n in enumerate(lengths):
        padded = cu_padded[i + 1] - cu_padded[i]
        local = padded // cp_size
        half = local // 2
        start = cu_padded[i] // cp_size
        tmp = torch.empty((padded, *shards[0].shape[1:]), dtype=shards[0].dtype, device=shards[0].device)
        for j in range(cp_size):
            o = shards[j]
            tmp[j * half : (j + 1) * half] = o[start : start + half]
            tmp[padded - (j + 1) * half : padded - j * half] = o[start + half : start + local]
        out.append(tmp[:n])
    return torch.nested.as_nested_tensor(out, layout=torch.jagged)


# --------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m verl_ops", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="cuda / cpu (default: cuda when available)")
    p.add_argument("--batch", type=int, default=32, help="sequences (default 32)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size (default 256)")
    p.add_argument("--max-len", type=int, default=2048, help="longest sequence (default 2048)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats, median (default 50)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.repeats is None:
        # 50: on a small shared machine a median of 10 CPU calls of ~1 ms still swung 2-3x between
        # runs; the whole demo stays under a few seconds.
        args.repeats = 50
    if device.type == "cuda" and not verl_ops.cuda_available():
        print("verl_ops was built without CUDA kernels; use --device cpu", file=sys.stderr)
        return 2
    g = torch.Generator().manual_seed(args.seed)
    # log-uniform lengths in [1, max_len]
    u = torch.rand(args.batch, generator=g, dtype=torch.float64)
    lengths = torch.exp(u * math.log(args.max_len)).round().clamp(1, args.max_len).long().tolist()
    total = sum(lengths)
    values = torch.randn(total, args.hidden, generator=g).to(device)
    nbytes = values.numel() * values.element_size()

    print(
        f"verl_ops {verl_ops.__version__} demo on {device} (torch {torch.__version__}): "
        f"{args.batch} sequences, lengths {min(lengths)}..{max(lengths)}, {total:,} tokens, "
        f"hidden {args.hidden} float32 ({nbytes / 2**20:.1f} MiB)"
    )

    failures = []

    def check(name, ok):
        if not ok:
            failures.append(name)

    rows = []
    for cp in (1, 2):
        layout = verl_ops.ThdLayout.from_lengths(lengths, cp_size=cp, cp_layout="zigzag", device=device)
        cu_p = layout.cu_seqlens_padded_cpu.tolist()
        cu = layout.cu_seqlens_cpu.tolist()

        def ours_pack(layout=layout, cp=cp):
            return [verl_ops.preprocess_thd(values, layout, r, validate=False) for r in range(cp)]

        def ref_pack(layout=layout, cp=cp, cu=cu, cu_p=cu_p):
            return [
                loop_pack(
                    lambda i: values[cu[i] : cu[i + 1]], lengths, cu_p, layout.local_rows, cp, r,
                    "zigzag", values.shape[1:], values.dtype, device,
                )
                for r in range(cp)
            ]

        shards = ours_pack()
        ref_shards = ref_pack()
        # valid rows of each rank: where the loop wrote a token (the loop leaves padding at 0)
        for r, ((pk, pos), (rpk, rpos)) in enumerate(zip(shards, ref_shards)):
            check(f"pack cp={cp} rank {r}: values", torch.equal(pk, rpk))
            valid = rpk.ne(0).any(dim=1)  # randn rows are never all-zero
            check(f"pack cp={cp} rank {r}: position ids", torch.equal(pos[valid], rpos[valid]))
        packed_all = shards[0][0] if cp == 1 else torch.stack([s[0] for s in shards])
        shard_list = [s[0] for s in shards]

        def ours_unpack(layout=layout, packed_all=packed_all):
            return verl_ops.postprocess_thd(packed_all, layout)

        def ref_unpack(cp=cp, cu_p=cu_p, shard_list=shard_list):
            return loop_unpack(shard_list, lengths, cu_p, cp, "zigzag")

        out = ours_unpack()
        check(f"unpack cp={cp}: roundtrip", torch.equal(out.values(), values))
        check(f"unpack cp={cp}: offsets", torch.equal(out.offsets().cpu(), layout.cu_seqlens_cpu.long()))
        check(f"unpack cp={cp}: vs loop", torch.equal(ref_unpack().values(), values))

        what = "1 rank" if cp == 1 else f"{cp} ranks"
        rows.append((f"pack   cp={cp} ({what})", wall_time(ours_pack, device, args.repeats, warmup=2),
                     wall_time(ref_pack, device, args.repeats, warmup=2)))
        rows.append((f"unpack cp={cp} ({what})", wall_time(ours_unpack, device, args.repeats, warmup=2),
                     wall_time(ref_unpack, device, args.repeats, warmup=2)))
        print(
            f"  cp={cp}: {layout.local_rows:,} rows per rank (align {layout.align}, "
            f"{layout.total_padded - layout.total_tokens:,} padding rows in total)"
        )

    print()
    print(f"  {'op':<24}{'verl_ops':>12}{'python loop':>14}{'speedup':>10}")
    print(f"  {'-' * 24}{'-' * 12}{'-' * 14}{'-' * 10}")
    for name, ours, ref in rows:
        print(f"  {name:<24}{format_seconds(ours):>12}{format_seconds(ref):>14}{ref / ours:>9.1f}x")
    print(f"  (median of {args.repeats} repeats, wall clock per call incl. Python; synchronised on GPU)")
    print()
    if failures:
        print("MISMATCH: " + "; ".join(failures), file=sys.stderr)
        return 1
    print("roundtrip exact: unpack(pack(x)) == x for cp=1 and cp=2; packing matches the loop: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
