"""Benchmark of router replay: merge_router_topk (record) and scatter_router_topk (replay).

    python benchmarks/router/bench_router.py --out benchmarks/results_router.md
    python benchmarks/router/bench_router.py --quick --device cpu        # tiny sizes, a smoke test

Batch (docs/performance.md#router-replay): 512 sequences, 517k tokens (lengths uniform in [mean/4,
7*mean/4], fixed seed), L = 48 MoE layers, top-k K = 8, FP8 padding on (the layout where the
router and the model once disagreed). One GPU: tp = cp = 1 for the end-to-end calls (no collective), plus the local
steps of a tp = 2 / cp = 4 rank (the record kernel alone, the replay of rank (1, 3)).

Rows (each checked against the truth and the verl-style path before timing):
  record fused      merge_router_topk(L layer tensors [T, K]) -> values [total, L, K] int16: one launch
                    from the layer tensors to the per-sequence result (recorded ids int64, as
                    torch.topk gives them, and int16)
  record local      the record kernel alone ([T_sp, L, K] int16, before the TP / CP gathers)
  replay            scatter_router_topk(values [total, L, K] int16) -> targets [L, T_sp, K] int64 +
                    packed replay mask [T_sp]
Columns: device time (CUDA events, median), floor = bytes read + written / copy bandwidth
measured in the same run, the ratio, the verl-style path (per-layer .to(int16), torch.stack,
permute, then verl's per-sequence unpack loop; replay: verl's per-sequence pack loop, the
sequence-parallel chunk, permute and one .to(int64) per layer; wall clock, synchronised, median of
3), our end-to-end wall clock and the speedup.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)  # benchmarks/: common.py
ROOT = os.path.dirname(BENCH)
# Prefer the checkout this script belongs to (built in place); fall back to an installed package.
sys.path.insert(0, ROOT)
try:
    import verl_ops
except ImportError:
    sys.path.remove(ROOT)
    for name in [m for m in sys.modules if m == "verl_ops" or m.startswith("verl_ops.")]:
        del sys.modules[name]
    import verl_ops
sys.path.insert(0, BENCH)
import common  # noqa: E402
from common import copy_bandwidth, device_time, gpu_ops_and_syncs, wall_time  # noqa: E402
from common import scaled_lengths as make_lengths  # noqa: E402

from verl_ops import merge_router_topk, scatter_router_topk  # noqa: E402
from verl_ops.demo import loop_pack, loop_unpack  # noqa: E402

OPS = torch.ops.verl_ops


def fmt_t(s):
    return f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} µs"


def fmt_b(b):
    return f"{b / 1e9:.2f} GB" if b >= 1e9 else f"{b / 1e6:.1f} MB"


# --------------------------------------------------------------------------------------------
# verl-style paths (verl/utils/megatron/router_replay_utils.py data path, tp = cp = 1)


def verl_record(layers, lengths, cu_padded):
    local = torch.stack([t.to(torch.int16) for t in layers]).permute(1, 0, 2).contiguous().view(torch.uint8)
    nested = loop_unpack([local], lengths, cu_padded, 1, "zigzag")
    return nested.values().view(torch.int16)


def verl_replay(routes_nested, replay_nested, lengths, cu_padded, local_rows, tp, tp_rank, cp, cp_rank):
    def pack(x):
        v = x.values()
        return loop_pack(lambda i: x[i], lengths, cu_padded, local_rows, cp, cp_rank, "zigzag",
                         v.shape[1:], v.dtype, v.device)[0]

    rows = pack(routes_nested).chunk(tp)[tp_rank]
    mask = pack(replay_nested).chunk(tp)[tp_rank]
    per_layer = rows.permute(1, 0, 2)
    return [per_layer[l].to(torch.int64) for l in range(per_layer.shape[0])], mask


# --------------------------------------------------------------------------------------------


def run(args):
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gen = torch.Generator(device=device).manual_seed(0)
    if args.quick:
        B, total, L, K = 32, 8_000, 6, 8
    else:
        B, total, L, K = 512, 517_000, 48, 8
    lengths = make_lengths(B, total, seed=1)
    layout = verl_ops.ThdLayout.from_lengths(lengths, fp8_padding=True, device=device)
    T = layout.local_rows
    cu_padded = layout.cu_seqlens_padded_cpu.tolist()
    bw = copy_bandwidth(device, 1 << 30 if device.type == "cuda" and not args.quick else 1 << 24, gen)
    rows = []
    lines = []

    # Truth: every token's routes, packed into the model's rows (garbage in padding rows).
    routes = torch.randint(0, 256, (layout.total_tokens, L, K), device=device, generator=gen, dtype=torch.int16)
    packed, _ = verl_ops.preprocess_thd(routes, layout)
    valid, _ = verl_ops.preprocess_thd(torch.ones(layout.total_tokens, dtype=torch.bool, device=device), layout)
    packed[~valid] = torch.randint(0, 256, packed[~valid].shape, device=device, generator=gen, dtype=torch.int16)
    n_out = layout.total_tokens * L * K

    def case_record(in_dtype):
        per_layer = packed.permute(1, 0, 2).to(in_dtype).contiguous()
        layers = list(per_layer.unbind(0))  # L contiguous [T, K], as the routers record them
        out = merge_router_topk(layers, layout, as_nested=False)
        assert torch.equal(out, routes), "record: merge_router_topk != truth"
        ref = verl_record(layers, list(lengths), cu_padded)
        assert torch.equal(ref, routes), "record: verl-style path != truth"
        fn = lambda i: merge_router_topk(layers, layout, as_nested=False, validate=False)  # noqa: E731
        t = device_time(fn, device, n=args.repeats)
        e2e = wall_time(lambda: merge_router_topk(layers, layout), device, n=args.repeats)
        verl_t = wall_time(lambda: verl_record(layers, list(lengths), cu_padded), device, n=3)
        nbytes = layout.total_tokens * L * K * per_layer.element_size() + n_out * 2
        ops, syncs = gpu_ops_and_syncs(lambda: fn(0), device)
        rows.append((f"record fused (ids {str(in_dtype).replace('torch.', '')})", nbytes, t, verl_t, e2e, ops, syncs))
        del per_layer, layers

    case_record(torch.int64)
    case_record(torch.int16)

    # The record kernel alone (what a tp > 1 or cp > 1 rank runs before its gathers).
    tp, cp = 2, 4
    lay_tc = verl_ops.ThdLayout.from_lengths(lengths, tp_size=tp, cp_size=cp, fp8_padding=True, device=device)
    t_sp = lay_tc.local_rows // tp
    layers = list(packed[:t_sp].permute(1, 0, 2).to(torch.int64).contiguous().unbind(0))
    local, _ = OPS.router_topk_record_layers(layers)
    assert torch.equal(local, packed[:t_sp]), "record local != input rows"
    t = device_time(lambda i: OPS.router_topk_record_layers(layers), device, n=args.repeats)
    ops, syncs = gpu_ops_and_syncs(lambda: OPS.router_topk_record_layers(layers), device)
    local_verl = wall_time(lambda: torch.stack([x.to(torch.int16) for x in layers]).permute(1, 0, 2).contiguous(), device, n=3)
    rows.append((f"record local (tp={tp}, cp={cp} rank, ids int64)", t_sp * L * K * 10, t, local_verl, None, ops, syncs))
    del layers, local

    # Replay.
    replay = torch.rand(layout.total_tokens, device=device, generator=gen) < 0.9
    offsets = layout.cu_seqlens.to(torch.int64)
    routes_nested = torch.nested.nested_tensor_from_jagged(routes, offsets)
    replay_nested = torch.nested.nested_tensor_from_jagged(replay, offsets)
    for lay, tp_rank, cp_rank in ((layout, 0, 0), (lay_tc, 1, 3)):
        targets, mask = scatter_router_topk(routes_nested, lay, tp_rank=tp_rank, cp_rank=cp_rank, replay_mask=replay_nested)
        ref_targets, ref_mask = verl_replay(
            routes_nested, replay_nested, list(lengths), lay.cu_seqlens_padded_cpu.tolist(), lay.local_rows,
            lay.tp_size, tp_rank, lay.cp_size, cp_rank,
        )
        assert all(torch.equal(targets[l], ref_targets[l]) for l in range(L)), "replay targets != verl-style"
        assert torch.equal(mask, ref_mask), "replay mask != verl-style"
        vals = routes_nested.values()
        fn = lambda i, lay=lay, tr=tp_rank, cr=cp_rank: scatter_router_topk(  # noqa: E731
            vals, lay, tp_rank=tr, cp_rank=cr, replay_mask=replay, validate=False
        )
        t = device_time(fn, device, n=args.repeats)
        e2e = wall_time(lambda lay=lay, tr=tp_rank, cr=cp_rank: scatter_router_topk(
            routes_nested, lay, tp_rank=tr, cp_rank=cr, replay_mask=replay_nested), device, n=args.repeats)
        verl_t = wall_time(lambda lay=lay, tr=tp_rank, cr=cp_rank: verl_replay(
            routes_nested, replay_nested, list(lengths), lay.cu_seqlens_padded_cpu.tolist(), lay.local_rows,
            lay.tp_size, tr, lay.cp_size, cr), device, n=3)
        t_rows = lay.local_rows // lay.tp_size
        # bytes: the int16 routes this rank reads (its share of the valid tokens) + int64 targets + mask
        share = layout.total_tokens / (lay.tp_size * lay.cp_size)
        nbytes = int(share * (L * K * 2 + 1)) + t_rows * (L * K * 8 + 1)
        ops, syncs = gpu_ops_and_syncs(lambda: fn(0), device)
        name = "replay" if lay is layout else f"replay (tp={lay.tp_size}, cp={lay.cp_size}, rank ({tp_rank}, {cp_rank}))"
        rows.append((name, nbytes, t, verl_t, e2e, ops, syncs))
        del targets, ref_targets

    hdr = ("| step | bytes | floor | verl_ops | × floor | verl-style | verl_ops e2e | speedup | GPU ops / sync | target ≤1.3x |\n"
           "|---|---|---|---|---|---|---|---|---|---|")
    lines.append(hdr)
    for name, nbytes, t, verl_t, e2e, ops, syncs in rows:
        floor = nbytes / bw
        ratio = t / floor
        speed = f"{verl_t / e2e:.0f}x" if e2e else f"{verl_t / t:.0f}x (device)"
        ok = "✅" if ratio <= 1.3 else "❌"
        lines.append(
            f"| {name} | {fmt_b(nbytes)} | {fmt_t(floor)} | {fmt_t(t)} | {ratio:.2f}x | {fmt_t(verl_t)} | "
            f"{fmt_t(e2e) if e2e else '—'} | {speed} | {ops} / {syncs} | {ok} |"
        )
    dev_name = common.gpu_name(device)
    head = [
        "## Router replay (merge_router_topk / scatter_router_topk)",
        "",
        f"- device: {dev_name}; torch {torch.__version__}; verl_ops {verl_ops.__version__}; commit {common.commit()}",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; command: "
        f"`python {common.command()}`",
        f"- batch: {B} sequences, {layout.total_tokens} tokens ({T} rows with FP8 padding), L={L}, K={K}",
        f"- copy bandwidth (device-to-device copy_, read+write): {bw / 1e12:.2f} TB/s",
        "- verl_ops: device time, CUDA events, median (validate=False); e2e: wall clock of the call with default "
        "validation, synchronised, median; verl-style: wall clock, synchronised, median of 3; speedup = verl-style / e2e",
        "- floor = (bytes read + bytes written) / copy bandwidth; outputs checked against the truth and the verl-style "
        "path before timing",
        "",
    ]
    return "\n".join(head + lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--quick", action="store_true", help="tiny sizes (smoke test, runs on CPU)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats of our ops (default 50; quick 3)")
    p.add_argument("--out", default=None, help="write the markdown section here")
    args = p.parse_args(argv)
    if args.repeats is None:
        args.repeats = 3 if args.quick else 50
    t0 = time.perf_counter()
    text = run(args)
    print(text)
    print(f"run time {time.perf_counter() - t0:.0f} s")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
