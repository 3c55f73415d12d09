"""verl drop-ins (verl_ops.integrations.verl / verl_bshd) against verl's own functions.

    python benchmarks/dropins/bench_dropins.py [--batch 256] [--out results_dropins.md]

Loads the installed verl's ``verl/models/mcore/util.py`` on its own (as the tests do; point
``--verl-site`` at a ``pip install --no-deps --target DIR verl==0.9.1`` directory if verl is not
installed). With megatron-core missing, its two modules are stubbed (tests/verl_stubs.py), with
tp = 1 and cp = 1 (rank 0). The batch is RL-like: ``--batch`` sequences with log-normal lengths
(sigma 1, median ``--median`` tokens, at most ``--max-len``), token ids int64 in, one fp32 value
per token out (log-probs). For every function, the two outputs are compared (every element,
padding included) before timing; each time is the wall clock of one synchronised call, median.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: common.py
import common  # noqa: E402  (puts the checkout on the path when verl_ops is not installed)

common.use_tests_dir()
import verl_stubs  # noqa: E402
from common import lognormal_lengths, wall_time  # noqa: E402

from verl_ops.integrations import verl as vi  # noqa: E402
from verl_ops.integrations import verl_bshd as vb  # noqa: E402


def flat(x):
    """Comparable form: nested -> (offsets, values); tuples / dicts / PackedSeqParams recursively."""
    if isinstance(x, torch.Tensor):
        return [x.offsets(), x.values()] if x.is_nested else [x]
    if isinstance(x, (tuple, list)):
        return [t for e in x for t in flat(e)]
    if isinstance(x, dict):
        return [t for k in sorted(x) for t in flat(x[k])]
    if dataclasses.is_dataclass(x):  # PackedSeqParams: its declared fields
        return [t for f in dataclasses.fields(x) for t in flat(getattr(x, f.name))]
    return [x]


def same(a, b):
    """True, or the first difference as a short string."""
    fa, fb = flat(a), flat(b)
    if len(fa) != len(fb):
        return f"{len(fa)} vs {len(fb)} parts"
    for i, (x, y) in enumerate(zip(fa, fb)):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return f"part {i}: {type(x).__name__} vs {type(y).__name__}"
        if isinstance(x, torch.Tensor):
            if x.dtype != y.dtype or x.shape != y.shape:
                return f"part {i}: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}"
            if not torch.equal(x, y.to(x.device)):
                return f"part {i}: values differ"
        elif x != y:
            return f"part {i}: {x!r} vs {y!r}"
    return True


def cases(lengths, device):
    """(name, verl's function name, args builder) for every drop-in; args from verl's own outputs."""
    B, S = len(lengths), max(lengths)
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = [torch.randint(1, 32000, (n,), generator=g) for n in lengths]
    nested = torch.nested.as_nested_tensor([t.to(device) for t in ids], layout=torch.jagged)
    right = torch.zeros(B, S, dtype=torch.long)
    mask_r = torch.zeros(B, S, dtype=torch.bool)
    left = torch.zeros(B, S, dtype=torch.long)
    mask_l = torch.zeros(B, S, dtype=torch.bool)
    for i, t in enumerate(ids):
        right[i, : t.numel()], mask_r[i, : t.numel()] = t, True
        left[i, S - t.numel() :], mask_l[i, S - t.numel() :] = t, True
    right, mask_r, left, mask_l = (t.to(device) for t in (right, mask_r, left, mask_l))
    pos_l = (mask_l.long().cumsum(1) - 1).clamp(min=0)
    return nested, right, mask_r, left, mask_l, pos_l, B, S


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--median", type=int, default=600)
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--verl-site", default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)

    mp = pytest.MonkeyPatch()
    if args.verl_site:
        mp.syspath_prepend(args.verl_site)
    try:
        from megatron.core import parallel_state  # noqa: F401

        megatron = "megatron-core"
        for name, value in (("get_tensor_model_parallel_world_size", 1), ("get_context_parallel_world_size", 1),
                            ("get_context_parallel_rank", 0), ("get_context_parallel_group", None)):
            mp.setattr(parallel_state, name, lambda v=value: v)
    except Exception:  # noqa: BLE001
        verl_stubs.install_megatron_stub(mp)
        megatron = "stub"
    util = verl_stubs.load_verl_util(mp)
    import logging

    mp.setattr(logging.Logger, "warning_once", logging.Logger.warning, raising=False)

    lengths = lognormal_lengths(args.batch, args.median, seed=1, max_len=args.max_len)
    nested, right, mask_r, left, mask_l, pos_l, B, S = cases(lengths, device)
    T = sum(lengths)

    # Inputs of the unpack side come from verl's own pack.
    packed, psp = util.preprocess_packed_seqs(right, mask_r)
    out_packed = torch.randn(packed.shape, device=device) if packed.dtype != torch.float32 else packed
    thd_ids, thd_psp = util.preprocess_thd_engine(nested)[:2]
    out_thd = torch.randn((1, thd_ids.shape[-1], 1), device=device)
    bshd_x, bshd_mask, _ = util.preprocess_bshd_engine(nested)
    out_bshd = torch.randn((*bshd_x.shape, 1), device=device)
    rm_x, rm_mask, rm_pos = util.preprocess_bshd(left, mask_l, pos_l)
    out_rm = torch.randn(rm_x.shape, device=device)
    labels = packed % 3 != 0

    def dict_out():
        return types.SimpleNamespace(entropy=torch.rand(packed.shape[1], device=device),
                                     log_probs=-torch.rand(packed.shape[1], device=device))

    fixed_dict = dict_out()
    jobs = [
        ("preprocess_packed_seqs", lambda m: m.preprocess_packed_seqs(right, mask_r)),
        ("postprocess_packed_seqs", lambda m: m.postprocess_packed_seqs(out_packed, psp, mask_r, B, S)),
        ("preprocess_thd_engine", lambda m: m.preprocess_thd_engine(nested)),
        ("postprocess_thd_engine", lambda m: m.postprocess_thd_engine(out_thd, thd_psp, nested, B)),
        ("preprocess_bshd_engine", lambda m: m.preprocess_bshd_engine(nested)),
        ("postprocess_bshd_engine", lambda m: m.postprocess_bshd_engine(out_bshd, bshd_mask)),
        ("preprocess_bshd", lambda m: m.preprocess_bshd(left, mask_l, pos_l)),
        ("postprocess_bshd", lambda m: m.postprocess_bshd(out_rm, rm_mask, mask_l, S)),
        ("postprocess_packed_seqs_for_dict_output",
         lambda m: m.postprocess_packed_seqs_for_dict_output(labels, fixed_dict, psp, mask_r, B, S)),
        ("build_vlm_attn_mask_thd", lambda m: m.build_vlm_attn_mask_thd(nested, 0)),
        ("build_vlm_attn_mask_bshd", lambda m: m.build_vlm_attn_mask_bshd(nested, B, 0)),
    ]
    # verl's R3 / router padding-mask helpers (read from the installed verl's files; see verl_r3).
    from verl_ops.integrations import verl_r3

    r3_theirs = {}
    try:
        r3_theirs.update(verl_stubs.load_verl_functions("utils/dynamic_cp_scheduler.py", ["_local_padding_mask"]))
        r3_theirs.update(verl_stubs.load_verl_functions(
            "utils/megatron/router_replay_utils.py", ["build_r3_replay_mask", "align_r3_router_replay_data"]))
    except LookupError as e:
        print(f"# verl's R3 helpers not found: {e}", flush=True)
    if r3_theirs:
        for name, fn in r3_theirs.items():
            setattr(util, name, fn)
        response = (torch.arange(64, device=device)[None, :] < torch.randint(0, 64, (B, 1), device=device))
        g = torch.Generator(device="cpu").manual_seed(3)
        routes = torch.nested.as_nested_tensor(
            [torch.randint(0, 128, (n - (i % 2), 48, 8), generator=g).to(device, torch.int16)
             for i, n in enumerate(lengths)], layout=torch.jagged)
        jobs += [
            ("_local_padding_mask (cp=4 rank 1, tp=2)",
             lambda m: m._local_padding_mask(lengths, cp_size=4, cp_rank=1, tp_size=2)),
            ("build_r3_replay_mask", lambda m: m.build_r3_replay_mask(nested, response)),
            ("align_r3_router_replay_data ([48, 8] int16 routes)",
             lambda m: m.align_r3_router_replay_data(routes, nested)),
        ]
    # verl's pipeline-parallel router-map helpers (see verl_pp). Router maps are CPU tensors there
    # (recorded with .cpu()): 256 sequences in 8 micro-batches, [len, 48, 8] int16; with virtual
    # pipeline stages, 2 model chunks of 24 layers each, micro-batch groups of 4.
    from verl_ops.integrations import verl_pp

    try:
        from megatron.core.pipeline_parallel.schedules import get_schedule_table

        pp_theirs = verl_stubs.load_verl_functions(
            "utils/megatron/router_replay_utils.py", ["reorder_and_merge_vpp_layers", "merge_nested_router_maps"],
            {"get_schedule_table": get_schedule_table})
    except (ImportError, LookupError) as e:
        pp_theirs = {}
        print(f"# verl's pipeline-parallel router-map helpers not loaded: {e}", flush=True)
    print("# pp_gather: a collective over the pipeline group, not timed here (one process)", flush=True)
    if pp_theirs:
        for name, fn in pp_theirs.items():
            setattr(util, name, fn)
        g = torch.Generator(device="cpu").manual_seed(4)
        n_mb, per_mb = 8, B // 8
        mb_lengths = [lengths[i * per_mb : (i + 1) * per_mb] for i in range(n_mb)]

        def mb_maps(layers):
            return [torch.nested.as_nested_tensor(
                [torch.randint(0, 128, (n, layers, 8), generator=g, dtype=torch.int16) for n in ls],
                layout=torch.jagged) for ls in mb_lengths]

        full_maps = mb_maps(48)
        chunk_maps = {c: mb_maps(24) for c in range(2)}
        vpp_list = [chunk_maps[c][mb] for mb, c in get_schedule_table(n_mb, 2, 4)]
        jobs += [
            ("merge_nested_router_maps (8 micro-batches, [48, 8] int16, CPU)",
             lambda m: m.merge_nested_router_maps(full_maps)),
            ("reorder_and_merge_vpp_layers (8 micro-batches x 2 chunks, [24, 8] int16, CPU)",
             lambda m: m.reorder_and_merge_vpp_layers(vpp_list, n_mb, 2, 4)),
        ]
    # verl's DynamicCPScheduler over Megatron-Core's DefaultDynamicCPScheduler (see verl_dcp): this
    # batch on a DPxCP group of 8 ranks (dp 4, cp 2), rank 3's micro-batches, tp 2. Megatron's class
    # comes from megatron-core when it has it, else from a Megatron-LM checkout (MEGATRON_LM_GIT_DIR
    # or MEGATRON_LM_SRC, as in tests/test_verl_dcp.py); verl's from the installed verl's file.
    from verl_ops.integrations import verl_dcp

    dcp_theirs = None
    try:
        import test_verl_dcp as tdcp

        dcp_theirs = tdcp.load_verl_dcp_module()
        try:
            from megatron.core.datasets.data_schedule import DefaultDynamicCPScheduler  # noqa: F401
        except ImportError:
            sources = tdcp._megatron_sources()
            if not sources:
                raise LookupError("megatron-core lacks DefaultDynamicCPScheduler and no Megatron-LM checkout was found")
            sched, sched_utils = tdcp.load_megatron_scheduler(*next(iter(sources.values())))
            mp.setitem(sys.modules, tdcp.MCORE, sched)
            mp.setitem(sys.modules, tdcp.MCORE_UTILS, sched_utils)
        mp.setitem(sys.modules, tdcp.OWNER, dcp_theirs)
    except (ImportError, LookupError) as e:
        dcp_theirs = None
        print(f"# verl's DynamicCPScheduler not loaded: {e}", flush=True)
    if dcp_theirs is not None:
        import tensordict

        util.DynamicCPScheduler = dcp_theirs.DynamicCPScheduler
        dcp_batch = tensordict.TensorDict({"input_ids": nested, "score": torch.randn(B, device=device)}, batch_size=[B])
        dcp_mslpr = max(1024, -(-max(lengths) // 8))

        def dcp_flat(micro_batches):
            return [{k: (v.data if hasattr(v, "data") and not isinstance(v, torch.Tensor) else v)
                     for k, v in mb.items()} for mb in micro_batches]

        jobs.append((f"DynamicCPScheduler.schedule (8 ranks: dp 4 x cp 2, rank 3, {dcp_mslpr} tokens/rank)",
                     lambda m: dcp_flat(m.DynamicCPScheduler(dcp_mslpr, 4, 2).schedule(
                         dcp_batch, tdcp.FakeGroup(8, 3), tp_size=2))))
    ours_fns = {n: getattr(vi, n, None) or getattr(vb, n, None) for n in dir(vb) if not n.startswith("__")}
    ours_fns.update({n: getattr(verl_pp, n) for n in verl_pp.__all__})
    ours_fns["DynamicCPScheduler"] = verl_dcp.DynamicCPScheduler
    ours_fns.update({n: getattr(vi, n) for n in ("preprocess_packed_seqs", "postprocess_packed_seqs",
                                                 "preprocess_thd_engine", "postprocess_thd_engine")})
    ours_fns.update(_local_padding_mask=verl_r3.local_padding_mask, build_r3_replay_mask=verl_r3.build_r3_replay_mask,
                    align_r3_router_replay_data=verl_r3.align_r3_router_replay_data)
    ours_mod = types.SimpleNamespace(**ours_fns)

    gpu = common.gpu_name(device)
    head = [
        f"### verl drop-ins vs verl {getattr(util, '__version__', '')}(verl/models/mcore/util.py), {gpu}",
        "",
        f"- torch {torch.__version__}; megatron: {megatron}; tp=1, cp=1",
        f"- batch: {B} sequences, log-normal lengths (sigma 1, median {args.median}, max {args.max_len}): "
        f"min / median / max {min(lengths)} / {sorted(lengths)[B // 2]} / {max(lengths)}, {T} tokens, "
        f"padded to S={S} where verl pads; ids int64 in, fp32 [.., 1] (or verl's own output shape) out",
        "- wall clock of one synchronised call, median of "
        f"{args.iters}; outputs compared element by element (padding included) before timing",
        "",
        "| function | verl | verl_ops | speedup | outputs equal |",
        "|---|---|---|---|---|",
    ]
    print("\n".join(head), flush=True)
    rows = []
    for name, call in jobs:
        try:
            theirs = call(util)
            ours = call(ours_mod)
            eq = same(ours, theirs)
            t_verl = wall_time(lambda: call(util), device, args.iters)
            t_ours = wall_time(lambda: call(ours_mod), device, args.iters)
            row = f"| {name} | {t_verl * 1e6:.0f} µs | {t_ours * 1e6:.0f} µs | {t_verl / t_ours:.1f}x | {'yes' if eq is True else 'NO: ' + eq} |"
        except Exception as e:  # noqa: BLE001
            row = f"| {name} | error: {type(e).__name__}: {str(e)[:120]} | | | |"
        rows.append(row)
        print(row, flush=True)
    mp.undo()
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(head + rows) + "\n")
    return 0 if all("| yes |" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
