"""Router replay over real process groups: gloo, 2 and 4 processes, tp x cp in {2x1, 1x2, 2x2, 1x4,
4x1}, Megatron's rank order (TP fastest: rank = cp_rank * tp + tp_rank).

Every rank checks, for FP8 on and off and both CP layouts:
* merge_router_topk (and the verl drop-in merge_router_topk_indices) == every token's truth, and
  == the composition verl uses: per-layer int16 + stack + permute, all-gather over the TP group,
  then verl's model-engine unpack with its CP all-gather (verl_ops.integrations.verl, checked
  against verl itself in test_verl_integration.py);
* scatter_router_topk (and set_router_replay_data) == verl's composition: model-engine pack,
  sequence-parallel split, permute, int64; and record -> merge -> replay gives every rank back
  what it recorded on its valid rows;
* ranks holding different layouts, or one rank's bad input, give an error on every rank, not a hang;
* the gathered merge compiles with torch.compile(fullgraph=True) (2 ranks).

Each world runs in spawned processes under a timeout, so a hang fails the test.
"""

from __future__ import annotations

import os
import random
import socket
import sys
import traceback
import types

import pytest
import torch
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT_S = 240

CONFIGS = {2: [(2, 1), (1, 2)], 4: [(2, 2), (1, 4), (4, 1)]}


class _SysModules:
    """The one method of pytest's monkeypatch that verl_stubs.install_megatron_stub uses."""

    def setitem(self, mapping, key, value):
        mapping[key] = value


def _check_config(rank, tp, cp, vi, vr, stub, verl_ops, RouterCase, verl_stack):
    import torch.distributed as dist

    tp_groups = [dist.new_group([c * tp + p for p in range(tp)]) for c in range(cp)]
    cp_groups = [dist.new_group([c * tp + p for c in range(cp)]) for p in range(tp)]
    tp_rank, cp_rank = rank % tp, rank // tp
    tp_group, cp_group = tp_groups[cp_rank], cp_groups[tp_rank]
    stub.tp, stub.cp, stub.cp_rank, stub.tp_rank = tp, cp, cp_rank, tp_rank
    stub.cp_group, stub.tp_group = cp_group, tp_group
    layouts = ["zigzag", "contiguous"] if cp > 1 else ["zigzag"]
    for cp_layout in layouts:
        for fp8 in (False, True):
            for trial in range(2):
                rng = random.Random(f"{tp}x{cp}-{cp_layout}-{fp8}-{trial}")  # the same batch on every rank
                factor = 2 if (cp_layout == "zigzag" and cp > 1) else 1
                align = tp * cp * factor
                lengths = [rng.choice([0, 1, align - 1, align + 1, rng.randint(1, 50)]) for _ in range(rng.randint(1, 5))]
                lengths[-1] = max(lengths[-1], 1)
                case = RouterCase(rng, lengths, 3, 4, tp=tp, cp=cp, cp_layout=cp_layout, fp8=fp8)
                ctx = f"rank {rank} tp={tp} cp={cp} {cp_layout} fp8={fp8} lengths={lengths}"
                truth = case.routes.to(torch.int16)
                rec = case.recorded(tp_rank, cp_rank, "strided")

                # Record side: our API.
                out = verl_ops.merge_router_topk(rec, case.layout, tp_group=tp_group, cp_group=cp_group)
                assert torch.equal(out.values(), truth), ctx
                _, mask, _ = case.padded(rng)
                padded = verl_ops.merge_router_topk(
                    case.recorded(tp_rank, cp_rank, "stacked"), case.layout, tp_group=tp_group, cp_group=cp_group,
                    attention_mask=mask,
                )
                assert torch.equal(padded, case.padded_expected(mask)), ctx

                # Record side: verl's composition.
                local = verl_stack(rec).view(torch.uint8)
                if tp > 1:
                    parts = [torch.empty_like(local) for _ in range(tp)]
                    dist.all_gather(parts, local, group=tp_group)
                    local = torch.cat(parts)
                input_ids = torch.nested.nested_tensor_from_jagged(
                    torch.zeros(case.layout.total_tokens, dtype=torch.long), case.layout.cu_seqlens_cpu.to(torch.int64)
                )
                _, psp, _ = vi.preprocess_thd_engine(input_ids, pre_process=False, use_fp8_padding=fp8, cp_layout=cp_layout)
                verl_out = vi.postprocess_thd_engine(local.unsqueeze(0), psp, input_ids, len(lengths), cp_layout=cp_layout)
                assert torch.equal(verl_out.values().view(torch.int16), out.values()), ctx

                # The drop-ins (parallel state from the megatron stub, real groups).
                cfg = types.SimpleNamespace(fp8="e4m3" if fp8 else None)
                if cp_layout == "contiguous":
                    cfg.experimental_attention_variant, cfg.csa_window_size = "dsv4_hybrid", None
                merged = vr.merge_router_topk_indices(None, input_ids, rec, cfg)
                assert torch.equal(merged.values(), truth), ctx

                # Replay side.
                targets, packed_mask = vr.set_router_replay_data(merged, None, cfg, replay_mask=case.nested_replay())
                assert torch.equal(targets, case.expected_targets(tp_rank, cp_rank)), ctx
                assert torch.equal(packed_mask, case.expected_replay(tp_rank, cp_rank)), ctx
                packed, _, _ = vi.preprocess_thd_engine(merged, use_fp8_padding=fp8, cp_layout=cp_layout)
                rows = packed[0].chunk(tp)[tp_rank]
                assert torch.equal(targets, rows.permute(1, 0, 2).to(torch.int64)), ctx
                valid = case._chunk(case.valid[cp_rank], tp_rank)
                recorded = case.recorded_rows(tp_rank, cp_rank)
                assert torch.equal(targets.permute(1, 0, 2)[valid], recorded[valid]), ctx

    # Ranks that disagree on the layout: an error on every rank, never a hang.
    lengths = [5, 3 + rank]
    bad = RouterCase(random.Random(0), lengths, 2, 2, tp=tp, cp=cp)
    try:
        verl_ops.merge_router_topk(bad.recorded(tp_rank, cp_rank), bad.layout, tp_group=tp_group, cp_group=cp_group)
    except RuntimeError as e:
        assert "ranks disagree on the THD layout" in str(e), str(e)
    else:
        raise AssertionError(f"rank {rank}: mismatched layouts across ranks did not raise")

    # A bad input on one rank raises on every rank (never a hang in the gathers): an id outside
    # int16 on rank 0, too few rows on the last rank, a layout the TP split cannot cut on all.
    world = tp * cp
    case = RouterCase(random.Random(1), [5, 7], 2, 2, tp=tp, cp=cp)
    for bad_rank, what in ((0, "outside the int16 range"), (world - 1, "rows per layer but the layout gives")):
        rec = case.recorded(tp_rank, cp_rank, "list")
        if rank == bad_rank:
            if bad_rank == 0:
                rec[1][0, 1] = 40000
            else:
                rec = [t[:-1] for t in rec]
        try:
            verl_ops.merge_router_topk(rec, case.layout, tp_group=tp_group, cp_group=cp_group)
        except (RuntimeError, ValueError) as e:
            want = what if rank == bad_rank else "another rank's input failed its checks"
            assert want in str(e), (rank, bad_rank, str(e))
        else:
            raise AssertionError(f"rank {rank}: a bad input on rank {bad_rank} did not raise here")
    if tp > 1:
        odd = verl_ops.ThdLayout.from_lengths([3], tp_size=tp, cp_size=cp, cp_layout="contiguous", min_local_rows=7)
        try:
            verl_ops.merge_router_topk([torch.zeros(3, 2, dtype=torch.long)], odd, tp_group=tp_group, cp_group=cp_group)
        except ValueError as e:
            assert f"local_rows=7 is not divisible by tp_size={tp}" in str(e), str(e)
        else:
            raise AssertionError(f"rank {rank}: a layout the TP split cannot cut did not raise")


def _check_compiled(rank, verl_ops, RouterCase):
    """torch.compile(fullgraph=True) of the gathered merge (functional collectives) over tp=2."""
    import torch.distributed as dist

    group = dist.new_group([0, 1])
    merge = torch.compile(
        lambda rec, layout: verl_ops.merge_router_topk(rec, layout, tp_group=group, as_nested=False),
        fullgraph=True,
        dynamic=True,
    )
    for trial in range(2):
        case = RouterCase(random.Random(f"compile-{trial}"), [3 + trial, 9, 4], 2, 8, tp=2)
        out = merge(case.recorded(rank, 0, "list"), case.layout)
        assert torch.equal(out, case.routes.to(torch.int16)), f"rank {rank}: compiled merge"


def _worker(rank, world, port, queue):
    try:
        sys.path.insert(0, HERE)
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        torch.set_num_threads(1)
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=world)
        import verl_stubs
        from router_reference import RouterCase, verl_stack

        import verl_ops
        from verl_ops.integrations import verl as vi
        from verl_ops.integrations import verl_router as vr

        stub = verl_stubs.install_megatron_stub(_SysModules())
        ps = sys.modules["megatron.core.parallel_state"]
        ps.get_tensor_model_parallel_rank = lambda: stub.tp_rank
        ps.get_tensor_model_parallel_group = lambda: stub.tp_group
        for tp, cp in CONFIGS[world]:
            _check_config(rank, tp, cp, vi, vr, stub, verl_ops, RouterCase, verl_stack)
        if world == 2:
            _check_compiled(rank, verl_ops, RouterCase)
        dist.barrier()
        dist.destroy_process_group()
        queue.put((rank, None))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        queue.put((rank, traceback.format_exc()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world", sorted(CONFIGS))
def test_router_over_gloo(world):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, queue), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world):
            rank, err = queue.get(timeout=TIMEOUT_S)
            results[rank] = err
    except Exception as e:  # queue.Empty: a rank hung (or died without reporting)
        raise AssertionError(f"world={world}: only ranks {sorted(results)} finished within {TIMEOUT_S}s") from e
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    failures = {r: e for r, e in results.items() if e is not None}
    assert not failures, "\n".join(f"rank {r}:\n{e}" for r, e in sorted(failures.items()))
