"""verl_ops inside a real megatron-core model: training steps of a tiny DeepSeek-V3-like GPTModel
(MLA + MoE + MTP, megatron-core's local layer specs, no TransformerEngine) on verl's THD path,
verl_ops' path against verl's.

* verl_ops' path: ``MLACoreAttention`` in every MLA core attention (``megatron_mla.install``), the
  batch packed / unpacked by verl_ops' drop-ins, router replay through verl_ops' drop-ins.
* The reference ("verl's path"): a plain per-sequence torch attention with V zero-padded to the
  query head dim (tests/megatron_model_lib.py), the batch packed / unpacked by the installed verl's
  own ``preprocess_thd_engine`` / ``postprocess_thd_engine``, and megatron-core as shipped (what
  ``install()`` replaces process-wide, e.g. the THD RoPE, is put back around its steps).

Both models start from the same weights. Each step records the reference's routing with Megatron's
``RouterReplay`` (RECORD), carries it through ``merge_router_topk_indices`` (record: layers' top-k ->
per-sequence routes) and ``set_router_replay_data`` (replay: routes -> packed targets), and replays
it in verl_ops' path (REPLAY_FORWARD), so both route every token identically; then the per-token
loss (cross entropy of the next token, unpacked per sequence) and every parameter's gradient are
compared, and both models take an SGD step.

Context parallel: the same model with ``context_parallel_size=2`` on 2 ranks (gloo on the CPU, NCCL
when 2 GPUs are visible), the batch packed for cp=2 zigzag by the drop-ins and the single-process
routes scattered to each rank, against the single-process result.

Also: verl's BSHD path (a right-padded ``[B, S]`` batch) in the same models, and
``megatron_compat.patch_megatron_core`` (on the real megatron-core: exactly the fixes whose defect
the process has; on stand-in modules: each fix only where its defect is).

Everything runs in a pool of 2 worker processes (tests/_dist.py); the single-process checks run
on both ranks with different batches (megatron-core's model-parallel state with TP = CP = 1).
Needs megatron-core and verl (``pip install --no-deps verl==0.9.1 megatron-core==0.16.1``); the
module is skipped without them.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import types

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import megatron_model_lib as lib  # noqa: E402
from _dist import shared_pool


def _requirements_missing():
    if not lib.megatron_available():
        return "needs megatron-core (pip install --no-deps megatron-core==0.16.1)"
    import importlib.util

    if importlib.util.find_spec("verl") is None:
        return "needs verl for its THD functions (pip install --no-deps verl==0.9.1)"
    return None


_MISSING = _requirements_missing()
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")

MODULE = "test_megatron_model"
STEPS = 3

# (device, dtype) -> tolerances: "max" = max |a - b| / max |b| per tensor; "norm" = ||a - b|| / ||b||.
# float32 on the CPU: both paths are float32 end to end (attention accumulates in float32 on both).
# bf16 on a GPU (verl_ops' CUDA attention takes float16 / bfloat16): two attention implementations
# rounding to bf16 in different places, 3 SGD steps.
# SGD step sizes: the objective sums over tokens, so the real-size model's gradients are large; at
# 0.05 its third step saturates MLA's attention (query-projection gradients ~1e-8 of their
# earlier size in float32), where any bf16 path is far from the reference.
LEARNING_RATE = {"tiny": 0.05, "real": 2e-4}

# In bf16 a gradient may differ from the float32-softmax reference by up to this many times what
# the accepted path (verl's own kernels: FlashAttention on V padded) shows on the same weights and
# routes: "within bf16 tolerance" of attention numerics, for gradients whose conditioning makes
# any bf16 attention path far from the reference.
ACCEPTED_FACTOR = 2.0

TOLERANCES = {
    ("cpu", "float32"): {"metric": "max", "loss": 2e-5, "grad": 2e-5, "param": 2e-5},
    ("cuda", "bfloat16"): {"metric": "norm", "loss": 2e-2, "grad": 5e-2, "param": 1e-2},
}

CASES = [
    pytest.param(("cpu", "float32", "tiny"), id="cpu-float32-tiny"),
    pytest.param(("cuda", "bfloat16", "real"), id="cuda-bfloat16-real", marks=pytest.mark.gpu),
]

# --------------------------------------------------------------------------------------------
# Pools (tests/_dist.py).


def _run(backend: str, name: str, *args, timeout_s: float = 240.0):
    return shared_pool(2, backend, pg_timeout_s=60.0).run(f"{MODULE}:{name}", *args, timeout_s=timeout_s)


# --------------------------------------------------------------------------------------------
# Comparison helpers (used on the ranks; they return numbers, the test asserts).


_err = lib.rel_err
_grad_report = lib.grad_report


_COMPAT = {}


def _compat_report() -> dict:
    """megatron-core's defects without TransformerEngine as this process found them before
    ``patch_megatron_core`` (first call in the process, before any model is built), what it
    applied, and the state after."""
    if _COMPAT:
        return _COMPAT
    import importlib

    from verl_ops.integrations import megatron_compat

    mla = importlib.import_module("megatron.core.transformer.multi_latent_attention")
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")

    def state():
        return {
            "mla_have_te": bool(mla.HAVE_TE),
            "mla_telinear_is_class": isinstance(getattr(mla, "TELinear", None), type),
            "moe_have_te": bool(moe_utils.HAVE_TE),
            "moe_te_general_gemm": "unbound" if not hasattr(moe_utils, "te_general_gemm")
            else ("None" if moe_utils.te_general_gemm is None else "bound"),
            "permute_keeps_out_tokens": megatron_compat._permute_needs_exact_out_tokens(moe_utils),
            "alltoall_replay_patched": bool(getattr(dispatcher.MoEAlltoAllTokenDispatcher,
                                                    "_verl_ops_replay_out_tokens", False)),
        }

    _COMPAT["before"] = state()
    _COMPAT["applied"] = megatron_compat.patch_megatron_core()
    _COMPAT["again"] = megatron_compat.patch_megatron_core()
    _COMPAT["after"] = state()
    return _COMPAT


def _setup_rank(rank: int, device_kind: str):
    _compat_report()
    torch.set_num_threads(1)
    # megatron-core's small fusions run eagerly in these processes (both paths alike): compiling
    # them would cost each process far more than the steps themselves.
    lib.eager_megatron_fusions()
    if device_kind == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return device


def _megatron_version() -> str:
    import megatron.core

    return f"megatron-core {getattr(megatron.core, '__version__', '?')}"


_mla_core_attention_types = lib.mla_core_attention_types
_route_pairs = lib.route_pairs
_routes_values = lib.routes_values


def _first_route_mismatch(got, want) -> str:
    """Where two per-sequence route tensors first differ (sequence, position, layer), for failure
    messages; '' when equal."""
    a, b = _routes_values(got), _routes_values(want)
    if a.shape != b.shape:
        return f"shapes {tuple(a.shape)} vs {tuple(b.shape)}"
    bad = (a.long() != b.long()).flatten(1).any(dim=1).nonzero().flatten()
    if not bad.numel():
        return ""
    row = int(bad[0])
    offsets = want.offsets().cpu().tolist() if want.is_nested else None
    seq = next(i for i in range(len(offsets) - 1) if offsets[i + 1] > row) if offsets else None
    where = f"sequence {seq} position {row - offsets[seq]}" if offsets else f"row {row}"
    return f"{bad.numel()} rows differ, first at {where}: {a[row].tolist()} vs {b[row].tolist()}"


# --------------------------------------------------------------------------------------------
# Rank tasks.


def _one_process_models(rank, device_kind, dtype_name, size_name, seed):
    """One process (CP = 1): the reference model (expert biases randomised), verl_ops' model with
    its weights and, in bf16, the accepted path (verl's kernels: FlashAttention on V padded), which
    measures how far an accepted bf16 attention path lies from the reference on the same weights
    and routes. Returns (device, dtype, metric, size, config, reference, verl_ops, accepted or None)."""
    device = _setup_rank(rank, device_kind)
    dtype = getattr(torch, dtype_name)
    metric = TOLERANCES[(device_kind, dtype_name)]["metric"]
    size = lib.SIZES[size_name]
    lib.init_distributed(1, device)
    cfg = lib.make_config(size, dtype=dtype, device=device)
    ref = lib.build_model(cfg, "reference", size=size, device=device, seed=seed)
    lib.randomize_expert_bias(ref, seed + 1)
    ours = lib.build_model(cfg, "verl_ops", size=size, device=device, seed=seed + 7)
    lib.copy_weights(ours, ref)
    accepted = None
    if dtype != torch.float32:
        accepted = lib.build_model(cfg, "verl_ops_padded", size=size, device=device, seed=seed + 9)
        lib.copy_weights(accepted, ref)
    return device, dtype, metric, size, cfg, ref, ours, accepted


def steps_task(rank, world, device_kind, dtype_name, size_name, seed, steps):
    """``steps`` SGD steps of verl_ops' path and the reference from the same weights on this rank's
    batches (seed + rank); returns per-step errors (see test_training_steps_match_reference)."""
    from verl_ops.integrations.verl_router import merge_router_topk_indices, set_router_replay_data

    device, dtype, metric, size, cfg, ref, ours, accepted = _one_process_models(
        rank, device_kind, dtype_name, size_name, seed
    )
    report = {
        "megatron_core": _megatron_version(),
        "compat": _compat_report(),
        "attention": {"reference": _mla_core_attention_types(ref), "verl_ops": _mla_core_attention_types(ours)},
        "routers": len(lib.routers(ref)),
        "steps": [],
    }
    ref_pack, our_pack = lib.verl_pack(), lib.verl_ops_pack()
    lr = LEARNING_RATE[size_name]
    opt_ref = torch.optim.SGD(ref.parameters(), lr=lr)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=lr)
    opt_accepted = torch.optim.SGD(accepted.parameters(), lr=lr) if accepted is not None else None
    rng = random.Random(seed * 1000 + rank)
    for step in range(steps):
        if device_kind == "cuda":
            lengths = lib.random_lengths(rng, 3, 8, lo=16, hi=2048, mu=6.0, sigma=1.0, with_long=True)
        else:
            lengths = lib.random_lengths(rng, with_long=True)
        batch = lib.make_batch(lengths, size.vocab, seed * 100 + 10 * rank + step, device)
        if step == 0:
            # A log-prob pass under torch.inference_mode on a batch made there: its offsets are
            # inference tensors (no version counter, nothing remembered on them); its per-token loss
            # is compared with no_grad's below.
            with torch.inference_mode():
                inf_batch = lib.make_batch(lengths, size.vocab, seed * 100 + 10 * rank + step, device)
                assert inf_batch.input_ids.offsets().is_inference()
                inf = lib.forward_backward(ours, inf_batch, our_pack, replay="record", device=device, backward=False)
        opt_ref.zero_grad(set_to_none=True)
        opt_ours.zero_grad(set_to_none=True)
        got = lib.forward_backward(ref, batch, ref_pack, replay="record", device=device, as_shipped=True)
        # record: the reference's per-layer top-k -> per-sequence routes [B, j, L, K] (int16)
        routes = merge_router_topk_indices(None, batch.input_ids, got.recorded, cfg)
        # replay: routes -> this rank's packed targets [L, T, K] (int64), the verl_ops model's layout
        targets, _ = set_router_replay_data(routes, None, cfg)
        entry = {
            "lengths": lengths,
            "targets_equal_recorded": [
                bool(torch.equal(t.cpu(), r.long().cpu())) for t, r in zip(targets, got.recorded)
            ],
            "targets_shape": [tuple(t.shape) for t in targets],
            "recorded_shape": [tuple(r.shape) for r in got.recorded],
        }
        if step == 0:
            # verl_ops' path routing on its own (RECORD, no replay), from the same weights
            with torch.no_grad():
                free = lib.forward_backward(ours, batch, our_pack, replay="record", device=device, backward=False)
            free_routes = merge_router_topk_indices(None, batch.input_ids, free.recorded, cfg)
            entry["free_routing_agree"] = _route_pairs(_routes_values(free_routes), _routes_values(routes))
            entry["inference_mode_err"] = _err(inf.loss_per_token, free.loss_per_token, metric)
        mine = lib.forward_backward(ours, batch, our_pack, replay=list(targets), device=device)
        entry["tokens"] = int(got.loss_per_token.numel())
        entry["loss_err"] = _err(mine.loss_per_token, got.loss_per_token, metric)
        entry["objective"] = (mine.objective, got.objective)
        entry["loss_finite"] = bool(torch.isfinite(got.loss_per_token).all() and torch.isfinite(mine.loss_per_token).all())
        entry["grads"] = _grad_report(lib.grads(ours), lib.grads(ref), metric)
        if accepted is not None:
            accepted.zero_grad(set_to_none=True)
            acc = lib.forward_backward(accepted, batch, our_pack, replay=list(targets), device=device)
            entry["accepted_loss_err"] = _err(acc.loss_per_token, got.loss_per_token, metric)
            entry["accepted_grads"] = _grad_report(lib.grads(accepted), lib.grads(ref), metric)
            opt_accepted.step()
        opt_ref.step()
        opt_ours.step()
        report["steps"].append(entry)
    ref_params = dict(ref.named_parameters())
    report["param_errors"] = {n: _err(p.detach().float(), ref_params[n].detach().float(), metric)
                              for n, p in ours.named_parameters()}
    if accepted is not None:
        report["accepted_param_errors"] = {n: _err(p.detach().float(), ref_params[n].detach().float(), metric)
                                           for n, p in accepted.named_parameters()}
    return report


def cp_task(rank, world, device_kind, dtype_name, size_name, seed, steps, dispatcher=None):
    """CP = 2 (this pool's 2 ranks): verl_ops' model with context_parallel_size=2 against the same
    model in one process (run on each rank before), ``steps`` SGD steps from the same weights."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from verl_ops.integrations.verl_router import merge_router_topk_indices, set_router_replay_data

    device = _setup_rank(rank, device_kind)
    dtype = getattr(torch, dtype_name)
    metric = TOLERANCES[(device_kind, dtype_name)]["metric"]
    size = lib.SIZES[size_name]
    cp = world
    rng = random.Random(seed)  # the same batches on every rank
    batches = []
    for step in range(steps):
        if device_kind == "cuda":
            lengths = lib.random_lengths(rng, 3, 8, lo=16, hi=2048, mu=6.0, sigma=1.0, with_long=True)
        else:
            lengths = lib.random_lengths(rng, with_long=True)
        batches.append(lib.make_batch(lengths, size.vocab, seed * 100 + step, device, cp_invariant_mtp=cp))
    lr = LEARNING_RATE[size_name]

    # One process (model-parallel state with CP = 1 on each rank): the reference routes the batch
    # (RECORD), verl_ops' model replays it.
    lib.init_distributed(1, device)
    cfg1 = lib.make_config(size, dtype=dtype, device=device, cp_size=1, dispatcher=dispatcher)
    ref = lib.build_model(cfg1, "reference", size=size, device=device, seed=seed)
    lib.randomize_expert_bias(ref, seed + 1)
    single = lib.build_model(cfg1, "verl_ops", size=size, device=device, seed=seed)
    lib.copy_weights(single, ref)
    initial = lib.snapshot(ref)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=lr)
    opt_single = torch.optim.SGD(single.parameters(), lr=lr)
    ref_pack, our_pack = lib.verl_pack(), lib.verl_ops_pack()
    singles = []
    for batch in batches:
        opt_ref.zero_grad(set_to_none=True)
        opt_single.zero_grad(set_to_none=True)
        got = lib.forward_backward(ref, batch, ref_pack, replay="record", device=device, as_shipped=True)
        routes = merge_router_topk_indices(None, batch.input_ids, got.recorded, cfg1)
        targets, _ = set_router_replay_data(routes, None, cfg1)
        # (Megatron's replay hands the target tensors to the router as they are: copies, so that
        # nothing a forward does to them reaches the routes kept for the CP run)
        one = lib.forward_backward(single, batch, our_pack, replay=[t.clone() for t in targets], device=device)
        singles.append((routes.clone(), one.loss_per_token, lib.grads(single)))
        opt_ref.step()
        opt_single.step()
    # Every rank ran the single process on its own; on GPUs its backward is not bitwise
    # deterministic (atomics in the MoE's unpermute and the embedding), so after the first SGD step
    # the ranks' weights, and a near-tie route, may differ. The CP run is checked against rank 0's.
    own_routes = [r.clone() for r, _, _ in singles]
    lib.broadcast_singles(singles)

    # CP = 2: the same weights; the single-process routes scattered to this rank's rows.
    lib.init_distributed(cp, device)
    assert parallel_state.get_context_parallel_world_size() == cp
    cfg = lib.make_config(size, dtype=dtype, device=device, cp_size=cp, dispatcher=dispatcher)
    model = lib.build_model(cfg, "verl_ops", size=size, device=device, seed=seed + 3)
    lib.copy_weights(model, initial)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    group = parallel_state.get_context_parallel_group()
    report = {
        "megatron_core": _megatron_version(),
        "attention": _mla_core_attention_types(model),
        # how many tokens' single-process routes on this rank equal rank 0's, per step
        "single_routes_vs_rank0": [_route_pairs(_routes_values(o), _routes_values(r))
                                   for o, (r, _, _) in zip(own_routes, singles)],
        "steps": [],
    }
    for batch, (routes, loss_single, grads_single) in zip(batches, singles):
        opt.zero_grad(set_to_none=True)
        targets, _ = set_router_replay_data(routes, None, cfg)
        res = lib.forward_backward(model, batch, our_pack, replay=[t.clone() for t in targets], device=device)
        # the routes this rank replayed, merged back over the CP group: the single-process routes
        merged = merge_router_topk_indices(
            None, batch.input_ids, list(targets), cfg, packed_seq_params=res.packed_seq_params
        )
        # Megatron's data-parallel gradient reduction spans DP x CP: the sum over the CP ranks
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=group)
        entry = {
            "lengths": batch.lengths,
            "local_rows": int(res.packed_seq_params.cu_seqlens_q_padded[-1]) // cp,
            "routes_equal": bool(torch.equal(_routes_values(merged), _routes_values(routes))),
            "routes_mismatch": _first_route_mismatch(merged, routes),
            "targets_rows": [int(t.shape[0]) for t in targets],
            "loss_err": _err(res.loss_per_token, loss_single, metric),
            "loss_finite": bool(torch.isfinite(res.loss_per_token).all()),
            "grads": _grad_report(lib.grads(model), grads_single, metric),
        }
        report["steps"].append(entry)
        opt.step()
    return report


def bshd_task(rank, world, device_kind, dtype_name, size_name, seed):
    """One forward / backward of a right-padded [B, S] batch (verl's BSHD path: no packed
    params, causal, MTP on), verl_ops' model against the reference from the same weights."""
    device, dtype, metric, size, cfg, ref, ours, accepted = _one_process_models(
        rank, device_kind, dtype_name, size_name, seed
    )
    g = torch.Generator().manual_seed(seed + rank)
    b, s = 3, 64 if device_kind == "cpu" else 512
    ids = torch.randint(0, size.vocab, (b, s), generator=g).to(device)
    mask = (torch.rand(b, s, generator=g) < 0.8).float().to(device)
    for i, n in enumerate((s, s - 7, 1)[:b]):  # valid lengths; the rest is right padding (id 0)
        ids[i, n:] = 0
        mask[i, n - 1 :] = 0  # no next token at the last valid position nor in the padding
    labels = torch.roll(ids, -1, dims=1)
    weights = (torch.rand(b, s, generator=g) * 2 - 0.5).to(device)
    position_ids = torch.arange(s, device=device).expand(b, s)
    models = [("reference", ref), ("verl_ops", ours)] + ([("accepted", accepted)] if accepted is not None else [])
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    out, recorded = {}, None
    for name, model in models:
        shipped = lib.megatron_as_shipped() if name == "reference" else contextlib.nullcontext()
        # Routing recorded on the reference and replayed (same token order in BSHD): the paths
        # differ by their attention only.
        for i, r in enumerate(lib.routers(model)):
            r.clear_indices()
            if recorded is None:
                r.set_router_replay_action(RouterReplayAction.RECORD)
            else:
                r.set_target_indices(recorded[i])
                r.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        with lib.megatron_device(device), shipped:
            lib.clear_mtp_tracker()
            loss = model(input_ids=ids, position_ids=position_ids, attention_mask=None, labels=labels, loss_mask=mask)
            (loss * weights * mask).sum().backward()
        if recorded is None:
            recorded = [r.get_recorded_indices().detach().clone() for r in lib.routers(model)]
        for r in lib.routers(model):
            r.clear_indices()
            r.clear_router_replay_action()
        out[name] = (loss.detach().float(), lib.grads(model))
    report = {
        "megatron_core": _megatron_version(),
        "attention": _mla_core_attention_types(ours),
        "loss_err": _err(out["verl_ops"][0], out["reference"][0], metric),
        "grads": _grad_report(out["verl_ops"][1], out["reference"][1], metric),
    }
    if "accepted" in out:
        report["accepted_loss_err"] = _err(out["accepted"][0], out["reference"][0], metric)
        report["accepted_grads"] = _grad_report(out["accepted"][1], out["reference"][1], metric)
    return report


# --------------------------------------------------------------------------------------------
# Assertions (in the test process).


def _bound(tol: float, accepted_err: float | None) -> float:
    """The error allowed: ``tol``, or, in bf16, twice what the accepted path (verl's kernels) shows
    against the same reference when that is larger (ill-conditioned gradients)."""
    return tol if accepted_err is None else max(tol, ACCEPTED_FACTOR * accepted_err)


def _check_grads(what: str, grads: dict, tol: float, metric: str, accepted: dict | None = None):
    assert not grads["one_sided"], f"{what}: parameters with a gradient on one side only: {grads['one_sided']}"
    errors = grads["errors"]
    assert errors, f"{what}: no gradient was compared"
    attention = [n for n in errors if ".self_attention." in n]
    assert attention, f"{what}: no attention parameter got a gradient"
    # (a routed expert that received no token may have none; attention and MTP's own layers must)
    assert not [n for n in grads["no_grad"] if ".self_attention." in n or ("mtp" in n and ".experts." not in n)], (
        f"{what}: attention / MTP parameters without a gradient: {grads['no_grad']}"
    )
    acc = accepted["errors"] if accepted is not None else {}
    bounds = {n: _bound(tol, acc.get(n)) for n in errors}
    bad = {n: e for n, e in errors.items() if not e <= bounds[n]}
    worst = sorted(bad.items(), key=lambda kv: -kv[1] / bounds[kv[0]])[:5]
    detail = [(n, f"err {e:.3g}", f"accepted path {acc.get(n, float('nan')):.3g}",
               f"|ref| {grads.get('norms', {}).get(n, float('nan')):.3g}") for n, e in worst]
    assert not bad, (f"{what}: {len(bad)} of {len(errors)} gradients differ beyond {metric} {tol:g} "
                     f"(or {ACCEPTED_FACTOR}x the accepted path's error); worst {detail}")


def _device_kind_or_skip(device_kind, dtype_name):
    if device_kind == "cuda":
        import verl_ops

        if not torch.cuda.is_available():
            pytest.skip("needs CUDA")
        if not verl_ops.cuda_available():
            pytest.skip("verl_ops was built without its CUDA kernels")


def _check_compat(rep):
    """patch_megatron_core on the real megatron-core: it applied exactly the fixes whose defect the
    process had, the defects are gone, and a second call does nothing."""
    c, v = rep["compat"], rep["megatron_core"]
    before, after = c["before"], c["after"]
    te_missing = not before["moe_have_te"]
    want = []
    if before["mla_have_te"] and not before["mla_telinear_is_class"]:
        want.append("fix_mla_have_te")
    if te_missing and before["moe_te_general_gemm"] == "unbound":
        want.append("fix_moe_utils_te_names")
    if before["permute_keeps_out_tokens"] and not before["alltoall_replay_patched"]:
        want.append("fix_alltoall_replay_out_tokens")
    assert c["applied"] == want, f"{v}: patch_megatron_core applied {c['applied']}, the defects found call for {want}"
    assert c["again"] == [], f"{v}: a second patch_megatron_core call applied {c['again']}"
    if te_missing:
        assert not after["mla_have_te"] or after["mla_telinear_is_class"], (
            f"{v}: MLA still believes TransformerEngine is there: {after}"
        )
        assert after["moe_te_general_gemm"] == "None", f"{v}: moe_utils.te_general_gemm is {after['moe_te_general_gemm']}"
    assert not after["permute_keeps_out_tokens"] or after["alltoall_replay_patched"], (
        f"{v}: the all-to-all dispatcher still sizes a replayed permutation as tokens * topk: {after}"
    )


def backend_task(rank, world, seed):
    """The model built with install(spec, backend="padded") (the spec slot then holds a ModuleSpec
    with the module's keyword arguments): every MLA runs MLACoreAttention with that backend, and on
    the CPU (where every backend is the same exact attention) its loss equals the default's."""
    device = _setup_rank(rank, "cpu")
    lib.init_distributed(1, device)
    size = lib.SIZES["tiny"]
    cfg = lib.make_config(size, dtype=torch.float32, device=device)
    default = lib.build_model(cfg, "verl_ops", size=size, device=device, seed=seed)
    padded = lib.build_model(cfg, "verl_ops_padded", size=size, device=device, seed=seed + 1)
    lib.copy_weights(padded, default)
    from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

    backends = [m.core_attention.backend for m in padded.modules() if isinstance(m, MultiLatentAttention)]
    batch = lib.make_batch([5, 1, 17], size.vocab, seed, device)
    pack = lib.verl_ops_pack()
    a = lib.forward_backward(default, batch, pack, device=device, backward=False)
    b = lib.forward_backward(padded, batch, pack, device=device, backward=False)
    return {"types": _mla_core_attention_types(padded), "backends": backends,
            "err": lib.max_rel_err(b.loss_per_token, a.loss_per_token)}


def test_install_with_a_backend_builds_through_a_module_spec():
    for rep in _run("gloo", "backend_task", 3):
        assert rep["types"] == ["MLACoreAttention"] * 3, rep
        assert rep["backends"] == ["padded"] * 3, rep
        assert rep["err"] <= 1e-5, rep


def test_compat_fixes_are_feature_detected(monkeypatch):
    """Each fix of megatron_compat acts only where its defect is (on stand-in modules): the MLA
    module's HAVE_TE with a TELinear that is not a class, moe_utils' names left unbound without
    TransformerEngine; it leaves real classes, bound names and TransformerEngine installs alone,
    and a second call does nothing."""
    import types
    from unittest.mock import MagicMock

    from verl_ops.integrations import megatron_compat as mc

    mla = types.ModuleType("megatron.core.transformer.multi_latent_attention")
    monkeypatch.setitem(sys.modules, mla.__name__, mla)
    mla.HAVE_TE, mla.TELinear = True, MagicMock()  # what megatron-core 0.16 binds without TE
    assert mc.fix_mla_have_te() is True and mla.HAVE_TE is False
    assert mc.fix_mla_have_te() is False
    real = type("TELinear", (torch.nn.Module,), {})
    mla.HAVE_TE, mla.TELinear = True, real  # TransformerEngine installed
    assert mc.fix_mla_have_te() is False and mla.HAVE_TE is True and mla.TELinear is real
    mla.HAVE_TE, mla.TELinear = False, None  # a release that reads HAVE_TE from the extension
    assert mc.fix_mla_have_te() is False and mla.HAVE_TE is False

    moe = types.ModuleType("megatron.core.transformer.moe.moe_utils")
    monkeypatch.setitem(sys.modules, moe.__name__, moe)
    moe.HAVE_TE = False  # the except branch ran and bound nothing else
    assert mc.fix_moe_utils_te_names() is True
    assert moe.te_general_gemm is None and moe.fused_topk_with_score_function is None
    assert mc.fix_moe_utils_te_names() is False
    gemm = object()
    moe2 = types.ModuleType(moe.__name__)
    monkeypatch.setitem(sys.modules, moe.__name__, moe2)
    moe2.HAVE_TE, moe2.te_general_gemm = False, gemm  # bound by the module itself: kept
    assert mc.fix_moe_utils_te_names() is True and moe2.te_general_gemm is gemm and moe2.fused_permute is None
    moe3 = types.ModuleType(moe.__name__)
    monkeypatch.setitem(sys.modules, moe.__name__, moe3)
    moe3.HAVE_TE = True  # TransformerEngine installed: nothing to do
    assert mc.fix_moe_utils_te_names() is False and not hasattr(moe3, "te_general_gemm")


def _argsort_permute(tokens, routing_map, probs=None, num_out_tokens=None, **_):
    """megatron-core 0.19's unfused dropless permute: an argsort cut at num_out_tokens."""
    flat = routing_map.T.contiguous().reshape(-1).int().argsort(descending=True, stable=True)[:num_out_tokens]
    return tokens.index_select(0, flat % tokens.shape[0]), None, flat


def _masked_permute(tokens, routing_map, probs=None, num_out_tokens=None, **_):
    """megatron-core 0.16's: the map's entries, whatever num_out_tokens says."""
    idx = torch.arange(tokens.shape[0]).expand(routing_map.shape[1], -1).masked_select(routing_map.T)
    return tokens.index_select(0, idx), None, idx


def _stand_in_dispatcher():
    class Dispatcher:
        def __init__(self, **config):
            self.config = types.SimpleNamespace(moe_router_topk=2, **config)
            self.drop_and_pad = False
            self.sync_points = []

        def preprocess(self, routing_map):
            self.num_out_tokens = routing_map.size(0) * self.config.moe_router_topk
            return routing_map.sum(dim=0)

        def _maybe_update_cuda_sync_point(self, point):
            self.sync_points.append(point)

    return Dispatcher


@pytest.mark.parametrize("verl_patched", [False, True])
def test_alltoall_replay_fix_is_feature_detected(monkeypatch, verl_patched):
    """fix_alltoall_replay_out_tokens on stand-ins: applied only where permute keeps num_out_tokens
    rows whatever the map holds (megatron-core 0.19's argsort) and verl's own patch is absent;
    then, with replay on, a map whose padding rows name expert 0 twice permutes exactly its
    entries, and without replay (or with a capacity factor) Megatron's count stays."""
    from verl_ops.integrations import megatron_compat as mc

    moe = types.ModuleType("megatron.core.transformer.moe.moe_utils")
    disp = types.ModuleType("megatron.core.transformer.moe.token_dispatcher")
    monkeypatch.setitem(sys.modules, moe.__name__, moe)
    monkeypatch.setitem(sys.modules, disp.__name__, disp)
    disp.MoEAlltoAllTokenDispatcher = cls = _stand_in_dispatcher()
    if verl_patched:
        cls._preprocess_patched = True  # verl's router_replay_patch marker
    moe.permute = _masked_permute
    assert mc.fix_alltoall_replay_out_tokens() is False and "_verl_ops_replay_out_tokens" not in vars(cls)
    moe.permute = _argsort_permute
    assert mc.fix_alltoall_replay_out_tokens() is (not verl_patched)
    assert mc.fix_alltoall_replay_out_tokens() is False  # idempotent
    if verl_patched:
        return
    # 3 tokens, 4 experts, top-2; the last row is a padding row replayed as [0, 0]
    routes = torch.tensor([[1, 2], [3, 0], [0, 0]])
    routing_map = torch.zeros(3, 4, dtype=torch.bool).scatter(1, routes, True)
    tokens = torch.arange(3.0).unsqueeze(1)
    on = cls(moe_enable_routing_replay=True, moe_expert_capacity_factor=None)
    counts = on.preprocess(routing_map)
    assert int(on.num_out_tokens) == 5 and on.sync_points == ["before_permutation_1"]
    permuted = moe.permute(tokens, routing_map, num_out_tokens=on.num_out_tokens)[0]
    assert permuted.shape[0] == int(counts.sum())  # the expert splits add up
    assert sorted(permuted.flatten().tolist()) == [0.0, 0.0, 1.0, 1.0, 2.0]
    for config in ({"moe_enable_routing_replay": False}, {"moe_enable_routing_replay": True,
                                                          "moe_expert_capacity_factor": 1.0}):
        off = cls(**config)
        off.preprocess(routing_map)
        assert off.num_out_tokens == 6 and off.sync_points == []


@pytest.mark.parametrize("case", CASES)
def test_training_steps_match_reference(case):
    """3 SGD steps on ragged batches (3-8 sequences, one of length 1): the per-token loss and every
    parameter's gradient of verl_ops' path equal the reference's, with the routing recorded on the
    reference and replayed through verl_ops' merge / scatter; on each of the pool's 2 ranks with
    its own batches."""
    device_kind, dtype_name, size_name = case
    _device_kind_or_skip(device_kind, dtype_name)
    tol = TOLERANCES[(device_kind, dtype_name)]
    reports = _run("gloo", "steps_task", device_kind, dtype_name, size_name, 11, STEPS)
    for rank, rep in enumerate(reports):
        _check_compat(rep)
        assert rep["attention"]["reference"] == ["ReferenceMLACoreAttention"] * 3, rep["attention"]
        assert rep["attention"]["verl_ops"] == ["MLACoreAttention"] * 3, (
            f"verl_ops' model must run MLACoreAttention in its 2 decoder layers and its MTP layer: {rep['attention']}"
        )
        assert rep["routers"] == 2, f"one MoE layer in the decoder and one in MTP, got {rep['routers']} routers"
        assert len(rep["steps"]) == STEPS
        for step, e in enumerate(rep["steps"]):
            what = f"{rep['megatron_core']} rank {rank} step {step} lengths {e['lengths']}"
            assert 1 in e["lengths"], f"{what}: the batch must hold a length-1 sequence"
            assert e["tokens"] == sum(n - 1 for n in e["lengths"] if n > 0), f"{what}: {e['tokens']} per-token losses"
            assert e["recorded_shape"] == e["targets_shape"] == [(sum(e["lengths"]), lib.SIZES[size_name].topk)] * 2, (
                f"{what}: recorded {e['recorded_shape']} vs replayed {e['targets_shape']}"
            )
            assert all(e["targets_equal_recorded"]), (
                f"{what}: the replayed routes (merge_router_topk -> scatter_router_topk) differ from the "
                f"recorded ones per layer: {e['targets_equal_recorded']}"
            )
            if step == 0:
                assert e["inference_mode_err"] <= tol["loss"], (
                    f"{what}: under torch.inference_mode the per-token loss differs from no_grad's: "
                    f"{tol['metric']} error {e['inference_mode_err']:.3g} > {tol['loss']:g}"
                )
                same, n = e["free_routing_agree"]
                need = n if dtype_name == "float32" else int(0.95 * n)
                assert same >= need, (
                    f"{what}: without replay, verl_ops' path routes {n - same} of {n} tokens differently from "
                    "the reference on the same weights"
                )
            assert e["loss_finite"], f"{what}: non-finite loss"
            loss_bound = _bound(tol["loss"], e.get("accepted_loss_err"))
            assert e["loss_err"] <= loss_bound, (
                f"{what}: per-token loss differs: {tol['metric']} error {e['loss_err']:.3g} > {loss_bound:g} "
                f"(objective {e['objective'][0]:.6g} vs reference {e['objective'][1]:.6g})"
            )
            _check_grads(what, e["grads"], tol["grad"], tol["metric"], e.get("accepted_grads"))
        acc = rep.get("accepted_param_errors", {})
        bad = {n: (v, acc.get(n)) for n, v in rep["param_errors"].items() if not v <= _bound(tol["param"], acc.get(n))}
        assert not bad, f"rank {rank}: parameters after {STEPS} steps differ: {bad}"


@pytest.mark.parametrize("case", CASES)
def test_bshd_matches_reference(case):
    """verl's BSHD path (a right-padded [B, S] batch, no packed params): MLACoreAttention's BSHD
    branch inside the model, per-token loss and every gradient against the reference."""
    device_kind, dtype_name, size_name = case
    _device_kind_or_skip(device_kind, dtype_name)
    tol = TOLERANCES[(device_kind, dtype_name)]
    for rank, rep in enumerate(_run("gloo", "bshd_task", device_kind, dtype_name, size_name, 23)):
        what = f"{rep['megatron_core']} BSHD rank {rank}"
        assert rep["attention"] == ["MLACoreAttention"] * 3, rep["attention"]
        loss_bound = _bound(tol["loss"], rep.get("accepted_loss_err"))
        assert rep["loss_err"] <= loss_bound, (
            f"{what}: per-token loss differs: {tol['metric']} error {rep['loss_err']:.3g} > {loss_bound:g}"
        )
        _check_grads(what, rep["grads"], tol["grad"], tol["metric"], rep.get("accepted_grads"))


CP_CASES = [
    pytest.param(("gloo", "cpu", "float32", "tiny", None), id="gloo-cpu-float32-tiny"),
    pytest.param(("nccl", "cuda", "bfloat16", "real", None), id="nccl-cuda-bfloat16-real", marks=pytest.mark.gpu),
    # The all-gather MoE dispatcher (the CPU case's) on GPUs: separates megatron-core's all-to-all
    # dispatcher under CP from the rest of the path.
    pytest.param(("nccl", "cuda", "bfloat16", "real", "allgather"), id="nccl-cuda-bfloat16-real-allgather",
                 marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("case", CP_CASES)
def test_context_parallel_matches_single_process(case):
    """context_parallel_size=2 on 2 ranks (zigzag THD from the drop-ins, MLACoreAttention under
    CP, Megatron's CP rope and MTP roll): per-token loss and every gradient (summed over
    the CP ranks) equal the single-process model's, 2 SGD steps, routing replayed from the
    single-process record; the routes each rank replayed merge back to the recorded ones."""
    backend, device_kind, dtype_name, size_name, dispatcher = case
    _device_kind_or_skip(device_kind, dtype_name)
    if backend == "nccl":
        import torch.distributed as dist

        if torch.cuda.device_count() < 2:
            pytest.skip(f"CP = 2 over NCCL needs 2 GPUs, found {torch.cuda.device_count()}")
        if not dist.is_nccl_available():
            pytest.skip("torch was built without NCCL")
    tol = TOLERANCES[(device_kind, dtype_name)]
    reports = _run(backend, "cp_task", device_kind, dtype_name, size_name, 5, 2, dispatcher)
    for rank, rep in enumerate(reports):
        assert rep["attention"] == ["MLACoreAttention"] * 3, rep["attention"]
        for step, e in enumerate(rep["steps"]):
            what = f"{rep['megatron_core']} cp=2 rank {rank} step {step} lengths {e['lengths']}"
            assert e["routes_equal"], (
                f"{what}: the routes replayed on the CP ranks do not merge back to the recorded ones: "
                f"{e['routes_mismatch']} (targets rows {e['targets_rows']}, local rows {e['local_rows']})"
            )
            assert e["loss_finite"], f"{what}: non-finite loss"
            assert e["loss_err"] <= tol["loss"], (
                f"{what}: per-token loss differs from the single process: {tol['metric']} error "
                f"{e['loss_err']:.3g} > {tol['loss']:g}"
            )
            _check_grads(what, e["grads"], tol["grad"], tol["metric"])
    # both ranks hold the whole (gathered) result: the same numbers
    assert [e["loss_err"] for e in reports[0]["steps"]] == [e["loss_err"] for e in reports[1]["steps"]]
