"""Benchmark of verl_ops.preprocess_thd (pack) and postprocess_thd (unpack) on docs/performance.md's batches.

    python benchmarks/thd/bench_thd.py --out benchmarks/results_thd.md --plot benchmarks/thd.png
    python benchmarks/thd/bench_thd.py --quick --device cpu          # tiny sizes, a smoke test

Batches (docs/performance.md#thd-pack-and-unpack): (a) 64 seqs / 136k tokens int64 ids, (b) 256 /
528k int64 ids, (c) 256 / 506k bf16 hidden 4096, (d) 512 / 517k router top-k int16 [48, 8]; each at
cp=1 and at cp=4 zigzag (pack = rank 0's shard; unpack = all 4 shards gathered), plus cp=4
contiguous for (a) and (c). Lengths are log-normal (sigma 1, as RL response lengths spread; fixed seed), scaled to the
exact total: in (a) they run from a few hundred to ~15k tokens.

For every configuration, after checking the outputs (ours == verl loop == TE-style gather on every
row, unpack(pack(x)) == x):
  verl_ops      device time of the op (CUDA events, median; validate=False; inputs rotated through
                several buffers when small, so L2 does not hold them)
  floor         bytes / measured copy bandwidth; pack bytes = valid tokens this rank reads + output
                rows written (values + int64 position ids); unpack bytes = 2 x valid tokens
  TE-style      build a row-index tensor on the device, then index_select (alone, and build+select)
  e2e           wall clock of the Python call, synchronised: ThdLayout.from_lengths(device lengths)
                + preprocess_thd(nested tensor) with default validation; unpack: postprocess_thd
                -> nested tensor
  verl loop     verl's per-sequence Python algorithm (zeros buffer; per sequence, per CP chunk, slice
                copies + position aranges), indexing the nested tensor per sequence as verl does
  slice loop    the same loop over slices of the values tensor (no nested-tensor indexing)
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import shlex
import sys
import time
from dataclasses import dataclass, field

import warnings

import torch

warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
warnings.filterwarnings("ignore", message=".*Synchronization debug mode is a prototype.*")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: common.py
import common  # noqa: E402  (puts the checkout on the path when verl_ops is not installed)
import verl_ops  # noqa: E402
from common import copy_bandwidth, device_name, device_time, fmt_b, fmt_t, gpu_ops_and_syncs, md_table, wall_time  # noqa: E402,F401
from common import scaled_lengths as make_lengths  # noqa: E402
from verl_ops.demo import loop_pack, loop_unpack  # noqa: E402

MB = 1e6
L2_BYTES = 60e6  # H100 50 MB, H200 60 MB (upper bound)


# --------------------------------------------------------------------------------------------
# Cases


@dataclass
class Case:
    key: str
    name: str
    batch: int
    total: int
    feat: tuple
    dtype: torch.dtype
    configs: list = field(default_factory=list)  # (cp, cp_layout)


def make_cases(quick: bool):
    z1, z4, c4 = (1, "zigzag"), (4, "zigzag"), (4, "contiguous")
    if not quick:
        return [
            Case("a", "ids int64", 64, 136_000, (), torch.int64, [z1, z4, c4]),
            Case("b", "ids int64", 256, 528_000, (), torch.int64, [z1, z4]),
            Case("c", "hidden 4096 bf16", 256, 506_000, (4096,), torch.bfloat16, [z1, z4, c4]),
            Case("d", "router int16 [48,8]", 512, 517_000, (48, 8), torch.int16, [z1, z4]),
        ]
    return [
        Case("a", "ids int64", 8, 4_000, (), torch.int64, [z1, z4, c4]),
        Case("b", "ids int64", 16, 8_000, (), torch.int64, [z1, z4]),
        Case("c", "hidden 64 bf16", 16, 6_000, (64,), torch.bfloat16, [z1, z4, c4]),
        Case("d", "router int16 [48,8]", 32, 6_000, (48, 8), torch.int16, [z1, z4]),
    ]


LENGTH_STATS: dict = {}


def random_values(n, feat, dtype, device, gen):
    shape = (n, *feat)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
    hi = 256 if dtype == torch.int16 else 151_000  # expert ids / vocabulary ids
    return torch.randint(0, hi, shape, generator=gen, device=device, dtype=dtype)


# --------------------------------------------------------------------------------------------
# Timing


def repeats_for(est_s, budget_s, lo, hi):
    return int(max(lo, min(hi, budget_s / max(est_s, 1e-7))))


# --------------------------------------------------------------------------------------------
# Baselines


def verl_layout(offsets, tp, cp, cp_layout):
    """verl's preprocess_thd_engine layout computation (on the device, then .tolist())."""
    seqlens = offsets.diff()
    factor = 2 if cp_layout == "zigzag" and cp > 1 else 1
    align = tp * cp * factor
    padded = seqlens + (align - seqlens % align) % align
    cu_p = torch.zeros(seqlens.numel() + 1, dtype=torch.int32, device=offsets.device)
    cu_p[1:] = torch.cumsum(padded, dim=0)
    return seqlens.tolist(), padded.tolist(), cu_p.tolist()


def verl_pack(x_nested, cp, rank, cp_layout):
    """verl-style pack: layout lists from the nested offsets, then the per-sequence loop on x[i]."""
    lens, padded, cu_p = verl_layout(x_nested.offsets(), 1, cp, cp_layout)
    v = x_nested.values()
    return loop_pack(lambda i: x_nested[i], lens, cu_p, sum(padded) // cp, cp, rank, cp_layout,
                     v.shape[1:], v.dtype, v.device)


def verl_unpack(shards, offsets, cu_padded, cp, cp_layout):
    return loop_unpack(shards, offsets.diff().tolist(), cu_padded.tolist(), cp, cp_layout)


def te_pack_index(layout, cp_rank):
    """TransformerEngine-style row indices for one rank, built on the device without host syncs.

    Returns (idx, pos): idx[row] = index of the token in values, or total_tokens for padding rows
    (a zero row appended to values); pos = position of the row inside its padded sequence."""
    cu = layout.cu_seqlens.long()
    cup = layout.cu_seqlens_padded.long()
    lens = cu[1:] - cu[:-1]
    cp, rows_n = layout.cp_size, layout.local_rows
    rows = torch.arange(rows_n, device=cu.device)
    if cp == 1 or layout.cp_layout == "contiguous":
        g = rows + cp_rank * rows_n
        seq = torch.searchsorted(cup[1:], g, right=True)
        pos = g - cup[seq]
    else:
        cup_local = cup // cp
        seq = torch.searchsorted(cup_local[1:], rows, right=True)
        off = rows - cup_local[seq]
        chunk = (cup[seq + 1] - cup[seq]) // (2 * cp)
        pos = torch.where(off < chunk, cp_rank * chunk + off, (2 * cp - 1 - cp_rank) * chunk + off - chunk)
    idx = torch.where(pos < lens[seq], cu[seq] + pos, layout.total_tokens)
    return idx, pos


def te_unpack_index(layout):
    """Row in the flattened gathered shards [cp * local_rows] of every valid token (closed form)."""
    cu = layout.cu_seqlens.long()
    cup = layout.cu_seqlens_padded.long()
    cp, rows_n = layout.cp_size, layout.local_rows
    tok = torch.arange(layout.total_tokens, device=cu.device)
    seq = torch.searchsorted(cu[1:], tok, right=True)
    p = tok - cu[seq]
    if cp == 1 or layout.cp_layout == "contiguous":
        return cup[seq] + p  # the global padded row is rank * local_rows + local row
    chunk = (cup[seq + 1] - cup[seq]) // (2 * cp)
    k = p // chunk
    first = k < cp
    rank = torch.where(first, k, 2 * cp - 1 - k)
    local = cup[seq] // cp + torch.where(first, 0, chunk) + p - k * chunk
    return rank * rows_n + local


# --------------------------------------------------------------------------------------------


class Mismatch(RuntimeError):
    pass


def expect(ok, what):
    if not ok:
        raise Mismatch(what)


def run_config(case, lengths, cp, cp_layout, buf, device, bw, args):
    """Benchmark pack and unpack of one (case, cp, layout). Returns two result dicts."""
    total = case.total
    values = buf[:total]
    row_bytes = values[0].numel() * values.element_size()
    payload = total * row_bytes
    lengths_dev = torch.tensor(lengths, dtype=torch.int64, device=device)
    layout = verl_ops.ThdLayout.from_lengths(lengths_dev, cp_size=cp, cp_layout=cp_layout, device=device)
    offsets = layout.cu_seqlens.long()
    x_nested = torch.nested.nested_tensor_from_jagged(values, offsets=offsets)
    lr = layout.local_rows
    quick = args.quick
    cfg = f"cp={cp}" + ("" if cp == 1 else f" {cp_layout}")
    label = f"({case.key}) {case.batch}×{total // 1000}k {case.name}"

    # ---- check before timing -------------------------------------------------------------
    shards = [verl_ops.preprocess_thd(values, layout, r, validate=False) for r in range(cp)]
    ours, ours_pos = shards[0]
    ref, ref_pos = verl_pack(x_nested, cp, 0, cp_layout)  # also the loop's warm-up
    idx0, pos0 = te_pack_index(layout, 0)
    valid = idx0 < total
    expect(torch.equal(ours, ref), f"{label} {cfg}: packed rows differ from the verl loop")
    expect(torch.equal(ours_pos[valid], ref_pos[valid]), f"{label} {cfg}: position ids differ from the verl loop")
    # Padding rows carry verl's position ids (0 outside the first zigzag chunk); the TE-style index
    # numbers them by slot, so the two are compared on valid rows.
    expect(torch.equal(ours_pos[valid], pos0[valid]), f"{label} {cfg}: position ids differ from the TE-style index")
    for r in range(cp):
        idx_r, _ = te_pack_index(layout, r)
        te_r = buf.index_select(0, idx_r)  # buf[total] is the zero row
        expect(torch.equal(shards[r][0], te_r), f"{label} {cfg}: rank {r} differs from the TE-style gather")
    ours_nested, _ = verl_ops.preprocess_thd(x_nested, layout, 0)
    expect(torch.equal(ours_nested, ours), f"{label} {cfg}: nested-tensor input differs from values input")
    n_valid_local = int(valid.sum())
    del ref, ref_pos, idx0, pos0, valid, ours_nested, te_r

    packed_all = shards[0][0] if cp == 1 else torch.stack([s[0] for s in shards])
    shard_list = [s[0] for s in shards]
    del shards, ours, ours_pos
    out = verl_ops.postprocess_thd(packed_all, layout, as_nested=False, validate=False)
    expect(torch.equal(out, values), f"{label} {cfg}: unpack(pack(x)) != x")
    out_nested = verl_ops.postprocess_thd(packed_all, layout)
    expect(torch.equal(out_nested.values(), values), f"{label} {cfg}: unpack to a nested tensor != x")
    ref_un = verl_unpack(shard_list, offsets, layout.cu_seqlens_padded, cp, cp_layout)
    expect(torch.equal(ref_un.values(), values), f"{label} {cfg}: verl unpack loop != x (baseline bug)")
    inv = te_unpack_index(layout)
    flat_all = packed_all.reshape(cp * lr, *values.shape[1:])
    expect(torch.equal(flat_all.index_select(0, inv), values), f"{label} {cfg}: TE-style unpack != x")
    del out, out_nested, ref_un

    # ---- pack timings ---------------------------------------------------------------------
    in_bytes = payload
    n_buf = 1 if in_bytes >= 2 * L2_BYTES else min(64, math.ceil(4 * L2_BYTES / max(in_bytes, 1)))
    if quick:
        n_buf = min(n_buf, 2)
    bufs = [buf] + [buf.clone() for _ in range(n_buf - 1)]
    vals = [b[:total] for b in bufs]

    def ours_fn(i):
        return verl_ops.preprocess_thd(vals[i % n_buf], layout, 0, validate=False)

    est = device_time(ours_fn, device, n=2, warmup=1)
    n_rep = repeats_for(est, 0.05 if quick else 0.3, 3 if quick else 20, 30 if quick else 500)
    t_ours = device_time(ours_fn, device, n_rep)

    idx0, _ = te_pack_index(layout, 0)
    t_te_sel = device_time(lambda i: bufs[i % n_buf].index_select(0, idx0), device, n_rep)
    t_te_all = device_time(lambda i: bufs[i % n_buf].index_select(0, te_pack_index(layout, 0)[0]), device, n_rep)
    del idx0

    def e2e():
        lay = verl_ops.ThdLayout.from_lengths(lengths_dev, cp_size=cp, cp_layout=cp_layout, device=device)
        return verl_ops.preprocess_thd(x_nested, lay, 0)

    est = wall_time(e2e, device, n=1)
    t_e2e = wall_time(e2e, device, repeats_for(est, 0.1 if quick else 0.3, 3, 50))
    n_loop = args.loop_repeats
    t_verl = wall_time(lambda: verl_pack(x_nested, cp, 0, cp_layout), device, n_loop, warmup=0)
    cu_l = layout.cu_seqlens_cpu.tolist()
    cup_l = layout.cu_seqlens_padded_cpu.tolist()
    t_slice = wall_time(
        lambda: loop_pack(lambda i: values[cu_l[i] : cu_l[i + 1]], lengths, cup_l, lr, cp, 0, cp_layout,
                          values.shape[1:], values.dtype, device),
        device, n_loop, warmup=1,
    )
    n_ops, syncs = gpu_ops_and_syncs(lambda: ours_fn(0), device) if not args.no_profile else ("-", "-")
    n_h = 5 if quick else 30
    host = dict(
        layout_dev=wall_time(lambda: verl_ops.ThdLayout.from_lengths(
            lengths_dev, cp_size=cp, cp_layout=cp_layout, device=device), device, n_h),
        layout_list=wall_time(lambda: verl_ops.ThdLayout.from_lengths(
            lengths, cp_size=cp, cp_layout=cp_layout, device=device), device, n_h),
        pack_nested=wall_time(lambda: verl_ops.preprocess_thd(x_nested, layout, 0), device, n_h),
        pack_values=wall_time(lambda: verl_ops.preprocess_thd(values, layout, 0, validate=False), device, n_h),
    )
    pack_bytes = n_valid_local * row_bytes + lr * (row_bytes + 8)
    pack = dict(
        kind="pack", label=label, cfg=cfg, case=case.key, cp=cp, feat=case.feat, payload=payload,
        row_bytes=row_bytes, bytes=pack_bytes, floor=pack_bytes / bw, ours=t_ours, te_sel=t_te_sel,
        te_all=t_te_all, e2e=t_e2e, verl=t_verl, slice=t_slice, n_ops=n_ops, syncs=syncs, n_rep=n_rep,
        n_buf=n_buf, host=host,
    )
    del bufs, vals

    # ---- unpack timings -------------------------------------------------------------------
    pk_bytes = packed_all.numel() * packed_all.element_size()
    n_buf_u = 1 if pk_bytes >= 2 * L2_BYTES else min(64, math.ceil(4 * L2_BYTES / max(pk_bytes, 1)))
    if quick:
        n_buf_u = min(n_buf_u, 2)
    pks = [packed_all] + [packed_all.clone() for _ in range(n_buf_u - 1)]

    def ours_un(i):
        return verl_ops.postprocess_thd(pks[i % n_buf_u], layout, as_nested=False, validate=False)

    est = device_time(ours_un, device, n=2, warmup=1)
    n_rep_u = repeats_for(est, 0.05 if quick else 0.3, 3 if quick else 20, 30 if quick else 500)
    t_un = device_time(ours_un, device, n_rep_u)
    flats = [p.reshape(cp * lr, *values.shape[1:]) for p in pks]
    t_un_te_sel = device_time(lambda i: flats[i % n_buf_u].index_select(0, inv), device, n_rep_u)
    t_un_te_all = device_time(lambda i: flats[i % n_buf_u].index_select(0, te_unpack_index(layout)),
                              device, n_rep_u)
    est = wall_time(lambda: verl_ops.postprocess_thd(packed_all, layout), device, n=1)
    t_un_e2e = wall_time(lambda: verl_ops.postprocess_thd(packed_all, layout), device,
                         repeats_for(est, 0.1 if quick else 0.3, 3, 50))
    t_un_verl = wall_time(
        lambda: verl_unpack(shard_list, offsets, layout.cu_seqlens_padded, cp, cp_layout), device, n_loop, warmup=0
    )
    n_ops_u, syncs_u = gpu_ops_and_syncs(lambda: ours_un(0), device) if not args.no_profile else ("-", "-")
    host["unpack_values"] = wall_time(
        lambda: verl_ops.postprocess_thd(packed_all, layout, as_nested=False, validate=False), device, n_h)
    host["unpack_nested"] = t_un_e2e
    un_bytes = 2 * payload
    unpack = dict(
        kind="unpack", label=label, cfg=cfg, case=case.key, cp=cp, feat=case.feat, payload=payload,
        row_bytes=row_bytes, bytes=un_bytes, floor=un_bytes / bw, ours=t_un, te_sel=t_un_te_sel,
        te_all=t_un_te_all, e2e=t_un_e2e, verl=t_un_verl, slice=None, n_ops=n_ops_u, syncs=syncs_u,
        n_rep=n_rep_u, n_buf=n_buf_u,
    )
    del pks, flats, packed_all, shard_list, inv, x_nested
    return pack, unpack


def targets(r):
    """Target checks of docs/performance.md#targets for one result row (GPU runs only)."""
    if not r["device"].startswith("cuda"):
        return "n/a (not a GPU)"
    marks = []
    ratio = r["ours"] / r["floor"]
    if r["payload"] >= 64 * MB:
        lim = 1.1 if r["row_bytes"] >= 1024 else 1.3
        marks.append(f"≤{lim}x floor {'✅' if ratio <= lim else '❌'}")
    if r["feat"] == ():
        marks.append(f"<20 µs {'✅' if r['ours'] < 20e-6 else '❌'}")
    if r["kind"] == "pack":  # docs/performance.md's 100x is against verl's pack times
        sp = r["verl"] / r["e2e"]
        marks.append(f"≥100x e2e {'✅' if sp >= 100 else '❌'}")
    if isinstance(r["n_ops"], int):
        marks.append(f"1 launch {'✅' if r['n_ops'] == 1 else '❌'}")
    if r["syncs"] in ("no", "YES"):
        marks.append(f"no sync {'✅' if r['syncs'] == 'no' else '❌'}")
    return ", ".join(marks)


def markdown_tables(results):
    out = []
    for kind, title in (("pack", "Pack (`preprocess_thd`, rank 0's shard)"),
                        ("unpack", "Unpack (`postprocess_thd`, all shards gathered)")):
        rows = [r for r in results if r["kind"] == kind]
        if not rows:
            continue
        out.append(f"### {title}\n")
        head = ["batch", "cp", "payload", "floor", "verl_ops", "× floor", "TE index_select",
                "TE build+select", "verl_ops e2e", "verl loop"]
        if kind == "pack":
            head.append("slice loop")
        head += ["e2e speedup", "GPU ops / sync", "targets"]
        body = []
        for r in rows:
            cells = [r["label"], r["cfg"], fmt_b(r["payload"]), fmt_t(r["floor"]), fmt_t(r["ours"]),
                     f"{r['ours'] / r['floor']:.2f}x", fmt_t(r["te_sel"]), fmt_t(r["te_all"]), fmt_t(r["e2e"]),
                     fmt_t(r["verl"])]
            if kind == "pack":
                cells.append(fmt_t(r["slice"]))
            cells += [f"{r['verl'] / r['e2e']:.0f}x", f"{r['n_ops']} / {r['syncs']}", targets(r)]
            body.append(cells)
        out += md_table(head, body)
        out.append("")
    rows = [r for r in results if r["kind"] == "pack" and "host" in r]
    if rows:
        out.append("### Where the end-to-end time goes (wall clock per call, synchronised, median)\n")
        head = ["batch", "cp", "from_lengths(device tensor)", "from_lengths(list)", "pack(nested, validate)",
                "pack(values, validate=False)", "pack device time", "unpack → values", "unpack → nested",
                "unpack device time"]
        un = {(r["case"], r["cfg"]): r for r in results if r["kind"] == "unpack"}
        body = []
        for r in rows:
            h = r["host"]
            u = un.get((r["case"], r["cfg"]))
            body.append([
                r["label"], r["cfg"], fmt_t(h["layout_dev"]), fmt_t(h["layout_list"]), fmt_t(h["pack_nested"]),
                fmt_t(h["pack_values"]), fmt_t(r["ours"]), fmt_t(h.get("unpack_values")),
                fmt_t(h.get("unpack_nested")), fmt_t(u["ours"] if u else None)])
        out += md_table(head, body)
        out.append("")
    return "\n".join(out)


def plot(results, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib not available: no plot written to {path}")
        return
    names = [f"{r['kind']} {r['case']} {r['cfg'].replace(' zigzag', 'z').replace(' contiguous', 'c')}"
             for r in results]
    ratio = [r["ours"] / r["floor"] for r in results]
    te = [r["te_sel"] / r["floor"] for r in results]
    speed = [r["verl"] / r["e2e"] for r in results]
    x = range(len(results))
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(max(8, 0.6 * len(results)), 8), sharex=True)
    w = 0.4
    a1.bar([i - w / 2 for i in x], ratio, w, label="verl_ops")
    a1.bar([i + w / 2 for i in x], te, w, label="TE-style index_select (index prebuilt)")
    a1.axhline(1.1, color="g", ls="--", lw=1, label="1.1x / 1.3x targets")
    a1.axhline(1.3, color="g", ls="--", lw=1)
    a1.set_yscale("log")
    a1.set_ylabel("device time / copy floor")
    a1.legend(fontsize=8)
    a2.bar(list(x), speed, color="tab:orange")
    a2.axhline(100, color="r", ls="--", lw=1, label="100x target")
    a2.set_yscale("log")
    a2.set_ylabel("e2e speedup vs verl loop")
    a2.legend(fontsize=8)
    a2.set_xticks(list(x))
    a2.set_xticklabels(names, rotation=60, ha="right", fontsize=8)
    fig.suptitle(f"verl_ops THD pack/unpack — {device_name(torch.device(results[0]['device']))}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot written to {path}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--quick", action="store_true", help="tiny sizes and few repeats (smoke test, runs on CPU)")
    p.add_argument("--cases", default="a,b,c,d", help="comma-separated subset of a,b,c,d")
    p.add_argument("--loop-repeats", type=int, default=None, help="timed repeats of the loops (default 3; quick 2)")
    p.add_argument("--out", default=None, help="write a markdown section (device, torch, date, command, tables) here")
    p.add_argument("--append", action="store_true", help="append the section to --out instead of overwriting it")
    p.add_argument("--plot", default=None, help="write a PNG bar chart here (needs matplotlib)")
    p.add_argument("--no-profile", action="store_true", help="skip the GPU-ops / host-sync check")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        if not verl_ops.cuda_available():
            sys.exit("verl_ops was built without CUDA kernels")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    elif not args.quick:
        print("note: full-size run on CPU is slow and not a performance number; use --quick", file=sys.stderr)
    if args.loop_repeats is None:
        args.loop_repeats = 2 if args.quick else 3
    t_start = time.perf_counter()
    gen = torch.Generator(device=device).manual_seed(args.seed)

    bw_bytes = (64 << 20) if args.quick else (1 << 30)
    bw = copy_bandwidth(device, bw_bytes, gen)
    print(f"device: {device_name(device)}; torch {torch.__version__}; copy bandwidth "
          f"{bw / 1e12:.2f} TB/s (read+write, {fmt_b(bw_bytes)} copy_)", flush=True)

    wanted = set(args.cases.split(","))
    results = []
    for case in make_cases(args.quick):
        if case.key not in wanted:
            continue
        lengths = make_lengths(case.batch, case.total, args.seed + ord(case.key))
        srt = sorted(lengths)
        LENGTH_STATS[case.key] = f"{srt[0]} / {srt[len(srt) // 2]} / {srt[-1]}"
        print(f"lengths ({case.key}): min / median / max {LENGTH_STATS[case.key]}", flush=True)
        buf = random_values(case.total + 1, case.feat, case.dtype, device, gen)
        buf[case.total].zero_()  # the zero row the TE-style gather points padding rows at
        for cp, cp_layout in case.configs:
            t0 = time.perf_counter()
            try:
                pack, unpack = run_config(case, lengths, cp, cp_layout, buf, device, bw, args)
            except Mismatch as e:
                print(f"\nFAILED CHECK: {e}", file=sys.stderr)
                sys.exit(1)
            for r in (pack, unpack):
                r["device"] = str(device)
                results.append(r)
                print(f"  {r['kind']:<6} {r['label']:<34} {r['cfg']:<15} verl_ops {fmt_t(r['ours']):>10} "
                      f"({r['ours'] / r['floor']:6.2f}x floor)  TE {fmt_t(r['te_sel']):>10}  "
                      f"e2e {fmt_t(r['e2e']):>10}  verl loop {fmt_t(r['verl']):>10}  "
                      f"{r['verl'] / r['e2e']:7.0f}x", flush=True)
            print(f"    [{time.perf_counter() - t0:.1f} s]", flush=True)
        del buf
        if device.type == "cuda":
            torch.cuda.empty_cache()

    tables = markdown_tables(results)
    elapsed = time.perf_counter() - t_start
    cmd = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + (argv or sys.argv[1:]))
    cuda_v = torch.version.cuda or "-"
    section = "\n".join([
        f"## THD pack / unpack{' (quick smoke test, not performance numbers)' if args.quick else ''}",
        "",
        f"- device: {device_name(device)}; torch {torch.__version__} (CUDA {cuda_v}); verl_ops {verl_ops.__version__}; "
        f"commit {common.commit()}",
        f"- date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}; "
        f"command: `{cmd}`; run time {elapsed:.0f} s",
        f"- copy bandwidth (device-to-device `copy_` of {fmt_b(bw_bytes)}, read+write): {bw / 1e12:.2f} TB/s",
        "- verl_ops, TE: device time (CUDA events, median after warm-up; validate=False; inputs rotated "
        f"over up to 64 buffers when smaller than {2 * L2_BYTES / MB:.0f} MB). floor = bytes / copy bandwidth; "
        "pack bytes = valid tokens read by this rank + output rows written (values + int64 position ids); "
        "unpack bytes = 2 × payload.",
        "- TE-style: row-index tensor built on the device (searchsorted/where), then `index_select` "
        "(padding rows gather an appended zero row); 'index_select' excludes building the index.",
        "- lengths: log-normal (sigma 1), scaled to the batch's total; min / median / max: "
        + "; ".join(f"({k}) {v}" for k, v in LENGTH_STATS.items()) + ".\n"
        "- e2e: wall clock of the Python call, synchronised, median: `ThdLayout.from_lengths(device lengths)` + "
        "`preprocess_thd(nested tensor)` with default validation; unpack: `postprocess_thd(...) -> nested`.",
        f"- verl loop: verl's per-sequence Python algorithm indexing the nested tensor per sequence "
        f"(`x[i]`), median of {args.loop_repeats}; slice loop: the same over slices of the values tensor. "
        "e2e speedup = verl loop / verl_ops e2e.",
        "- GPU ops / sync: GPU activities (kernels, memsets, copies) of one op call from torch.profiler; "
        "whether the call host-synchronises (`torch.cuda.set_sync_debug_mode('error')`).",
        "- targets (docs/performance.md): ≤1.1x floor for rows ≥1 KB and ≤1.3x for narrower rows when the payload "
        "is ≥64 MB; <20 µs device time for id-only batches; pack e2e ≥100x faster than verl's loop (docs/performance.md "
        "sets it against verl's pack times; unpack speedups are shown without a target).",
        "- outputs checked before timing: pack == verl loop (every row; position ids on valid rows), == TE-style "
        "gather for every rank; unpack(pack(x)) == x; verl unpack loop == x.",
        "",
        tables,
    ])
    print()
    print(tables)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "a" if args.append else "w") as f:
            f.write(section + "\n")
        print(f"markdown section written to {args.out}")
    if args.plot and results:
        plot(results, args.plot)
    print(f"total {elapsed:.1f} s")


if __name__ == "__main__":
    main()
