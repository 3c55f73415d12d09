"""mla_cp_attention: causal MLA attention under context parallelism (K / V all-gathered over the CP
group), against single-process attention over the whole padded sequences.

Every check runs on all ranks of a pooled process group (tests/_dist.py): gloo on the CPU at 2 and 4
ranks (float64 / float32, where ``mla_forward_padded`` on the CPU is the exact reference), NCCL when
2 / 4 GPUs are visible (bf16, 192/128, 16 heads, against the single-GPU result). Each rank builds
the same full padded batch from a seed, cuts its own rows out with :func:`rank_rows` (checked
against ``preprocess_thd``, the project's layout), and compares the op's output and q / k / v
gradients with the rows of the full attention's output and gradients.
"""

from __future__ import annotations

import math
import random
import re

import pytest
import torch
from _dist import dist_params, dist_runner

import verl_ops
from verl_ops import ThdLayout

OP = "mla_cp_attention"

# --------------------------------------------------------------------------------------------
# Pools (one per backend and world size, shared by the tests of this module).


def _runner(request):
    run = dist_runner(request, "test_mla_cp")
    if run.backend == "nccl" and not verl_ops.cuda_available():
        pytest.skip("verl_ops was built without its CUDA kernels")
    return run


@pytest.fixture(params=dist_params(("gloo", "nccl"), (2, 4)))
def dist_run(request):
    """run(check_name, *args) on every rank of a (backend, world size) pool."""
    return _runner(request)


@pytest.fixture(params=dist_params(("gloo", "nccl"), (4,)))
def dist_run4(request):
    return _runner(request)


# --------------------------------------------------------------------------------------------
# Reference pieces (used on the ranks).


def rank_rows(cu_padded, cp: int, r: int, cp_layout: str) -> torch.Tensor:
    """Global padded rows that CP rank r holds, in its local order (docs/cp.md#cp-layouts): zigzag:
    chunks r and 2cp-1-r of each sequence cut in 2cp chunks; contiguous: rows
    [r * total / cp, (r + 1) * total / cp) of the global buffer."""
    cu = [int(x) for x in cu_padded]
    total = cu[-1]
    if cp == 1:
        return torch.arange(total)
    if cp_layout == "contiguous":
        n = total // cp
        return torch.arange(r * n, (r + 1) * n)
    rows = []
    for a, b in zip(cu[:-1], cu[1:]):
        c = (b - a) // (2 * cp)
        rows += [torch.arange(a + r * c, a + (r + 1) * c), torch.arange(a + (2 * cp - 1 - r) * c, a + (2 * cp - r) * c)]
    return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)


def _check_rows_are_the_pack(layout: ThdLayout, r: int, rows: torch.Tensor):
    """rank_rows agrees with preprocess_thd: packing each valid token's global padded row number
    gives rank_rows at valid rows and 0 at padding rows."""
    cu_p = layout.cu_seqlens_padded_cpu.tolist()
    gid = torch.cat([torch.arange(a, a + n) for a, n in zip(cu_p[:-1], layout.lengths)] or [torch.zeros(0)]).long()
    packed, _ = verl_ops.preprocess_thd(gid, layout, r)
    valid = torch.zeros(layout.total_padded, dtype=torch.bool)
    valid[gid] = True
    assert torch.equal(packed, torch.where(valid[rows], rows, 0)), (layout, r)


def ragged_lengths(rng: random.Random, n: int, median: float = 10.0, cap: int = 60) -> list:
    """Log-normal lengths with a 0 and a 1 among them, shuffled."""
    out = [0, 1] + [min(cap, int(rng.lognormvariate(math.log(median), 1.0))) for _ in range(max(n - 2, 0))]
    rng.shuffle(out)
    return out


def _full_batch(seed, total, heads, dqk, dv, dtype):
    """q, k [T, n, Dqk], v [T, n, Dv] and an upstream gradient [T, n, Dv] from a seed (CPU)."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(total, heads, dqk, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    v, grad = (torch.randn(total, heads, dv, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    return q, k, v, grad


def _attend(q, k, v, grad, cu, max_seqlen, scale):
    """Single-process attention over the whole padded sequences, with its q / k / v gradients."""
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    out = verl_ops.mla_forward_padded(q, k, v, cu, cu, max_seqlen, max_seqlen, causal=True, softmax_scale=scale)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def _assert_close(what, got, want, tol):
    """max |got - want| <= tol * max(|want|, 1) (shapes and dtypes of got checked by the caller)."""
    assert got.shape == want.shape, (what, tuple(got.shape), tuple(want.shape))
    if want.numel() == 0:
        return
    err = float((got.double() - want.double()).abs().max())
    scale = max(float(want.double().abs().max()), 1.0)
    assert err <= tol * scale, f"{what}: max abs error {err:.3g} > {tol:g} * {scale:.3g}"


TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 3e-2}


def run_case(group, cp, r, device, lengths, cp_layout, dtype, heads, dqk, dv, seed, **kw):
    """run_case_comm with each communication the layout takes: the all-gather, and for zigzag the
    ring (cp_comm_type "p2p") too."""
    for comm in ("all_gather", "p2p") if cp_layout == "zigzag" else ("all_gather",):
        rows = run_case_comm(group, cp, r, device, lengths, cp_layout, dtype, heads, dqk, dv, seed, comm=comm, **kw)
    return rows


def run_case_comm(group, cp, r, device, lengths, cp_layout, dtype, heads, dqk, dv, seed, *, comm, scale=None,
                  cu_on_device=False, bucket=None):
    """One mla_cp_attention call on this rank (forward and backward) checked against the full attention.

    CPU: the full attention in float64 from the same (dtype-rounded) inputs; CUDA: the single-GPU
    result in the same dtype. Returns this rank's rows count.
    """
    layout = ThdLayout.from_lengths(lengths, cp_size=cp, cp_layout=cp_layout, pad_to_length_bucket=bucket)
    cu_cpu = layout.cu_seqlens_padded_cpu
    total = layout.total_padded
    rows = rank_rows(cu_cpu.tolist(), cp, r, cp_layout)
    assert rows.numel() == layout.local_rows
    _check_rows_are_the_pack(layout, r, rows)

    q, k, v, grad = _full_batch(seed, total, heads, dqk, dv, dtype)
    if device.type == "cpu":
        want = _attend(*(x.double() for x in (q, k, v, grad)), cu_cpu, layout.max_seqlen, scale)
    else:
        cu_dev = cu_cpu.to(device)
        want = _attend(*(x.to(device) for x in (q, k, v, grad)), cu_dev, layout.max_seqlen, scale)
    want = [w[rows.to(w.device)] for w in want]

    ql, kl, vl = (x[rows].to(device).requires_grad_(True) for x in (q, k, v))
    cu_arg = cu_cpu.to(device) if cu_on_device else cu_cpu
    out = verl_ops.mla_cp_attention(ql, kl, vl, cu_arg, layout.max_seqlen, cp_group=group, cp_layout=cp_layout,
                                    softmax_scale=scale, cp_comm_type=comm)
    assert out.dtype == dtype and out.device == ql.device, (out.dtype, out.device)
    assert tuple(out.shape) == (layout.local_rows, heads, dv), tuple(out.shape)
    assert out.requires_grad
    out.backward(grad[rows].to(device))
    what = f"{cp_layout} {comm} cp={cp} rank={r} {dtype} n={heads} {dqk}/{dv} lengths={lengths}"
    for name, got, w in zip(("out", "dq", "dk", "dv"), (out.detach(), ql.grad, kl.grad, vl.grad), want):
        assert got is not None and got.dtype == dtype, (what, name)
        _assert_close(f"{what}: {name}", got.cpu(), w.cpu(), TOL[dtype])
    return layout.local_rows


def _kind(device):
    """(dtype, Dqk, Dv) of the small checks: float64 24/16 on the CPU, bf16 192/128 (MLA's) on CUDA."""
    return (torch.float64, 24, 16) if device.type == "cpu" else (torch.bfloat16, 192, 128)


def _setup(rank, backend):
    import torch.distributed as dist

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    return dist, device


def _expect_error(pattern, fn):
    """fn() raises an exception whose message names the op and matches pattern; returns the message."""
    try:
        fn()
    except (ValueError, TypeError, RuntimeError) as e:
        msg = str(e)
        assert OP in msg, f"message does not name {OP}: {msg}"
        assert re.search(pattern, msg), f"message does not match {pattern!r}: {msg}"
        return msg
    raise AssertionError(f"expected an error matching {pattern!r}")


# --------------------------------------------------------------------------------------------
# Checks (run on every rank).


def check_matches_full_attention(rank, world, backend, seed):
    """The whole world is the CP group: out and q / k / v gradients equal the full attention's rows."""
    dist, device = _setup(rank, backend)
    group = dist.group.WORLD
    rng = random.Random(seed)  # the same on every rank: every rank holds the same batch
    if device.type == "cpu":
        cases = [  # (cp_layout, dtype, heads, dqk, dv, batch size)
            ("zigzag", torch.float64, 3, 24, 16, 7),
            ("contiguous", torch.float64, 3, 24, 16, 7),
            ("zigzag", torch.float32, 2, 24, 16, 6),
            ("contiguous", torch.float32, 2, 24, 16, 6),
            ("zigzag", torch.float64, 2, 192, 128, 4),
            ("contiguous", torch.float32, 2, 192, 128, 4),
        ]
        for cp_layout, dtype, heads, dqk, dv, b in cases:
            lengths = ragged_lengths(rng, b)
            run_case(group, world, rank, device, lengths, cp_layout, dtype, heads, dqk, dv, rng.randrange(2**31))
        # A single sequence; the default softmax scale; a bucket-padded last sequence.
        run_case(group, world, rank, device, [37], "zigzag", torch.float64, 2, 24, 16, rng.randrange(2**31),
                 scale=0.3)
        run_case(group, world, rank, device, [5, 0, 9], "zigzag", torch.float64, 2, 24, 24, rng.randrange(2**31),
                 bucket=6 * world)
    else:  # a few thousand tokens, bf16, MLA head dims, against the single-GPU result
        for cp_layout, cu_on_device in (("zigzag", False), ("zigzag", True), ("contiguous", True)):
            lengths = ragged_lengths(rng, 24, median=150.0, cap=1500)
            run_case(group, world, rank, device, lengths, cp_layout, torch.bfloat16, 16, 192, 128,
                     rng.randrange(2**31), cu_on_device=cu_on_device)
    return True


def check_no_group_is_plain_attention(rank, world, backend):
    """cp_group=None and a group of one rank: the plain attention of the rank's whole batch."""
    dist, device = _setup(rank, backend)
    own = [dist.new_group([i]) for i in range(world)]  # every rank creates every group, in order
    rng = random.Random(100 + rank)  # each rank its own batch
    dtype, dqk, dv = _kind(device)
    for group in (None, own[rank]):
        for cp_layout in ("zigzag", "contiguous"):
            run_case(group, 1, 0, device, ragged_lengths(rng, 5), cp_layout, dtype, 2, dqk, dv, rng.randrange(2**31))
    return True


def check_dynamic_cp(rank, world, backend, seed):
    """Dynamic CP at 4 ranks: pairs of ranks with their own batches in one call, all 4 ranks in the
    next, pairs again (other batches, other layouts), a pair where one group's batch is empty."""
    dist, device = _setup(rank, backend)
    assert world == 4
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both, in order
    pair = pairs[rank // 2]
    assert dist.get_rank(pair) == rank % 2
    dtype = torch.float64 if device.type == "cpu" else torch.bfloat16
    dqk, dv, heads, median, cap = (24, 16, 2, 10.0, 60) if device.type == "cpu" else (192, 128, 16, 150.0, 1500)
    n_seq = 6 if device.type == "cpu" else 16

    def batch(key):  # the same batch on the ranks of one group, another one on the other group
        rng = random.Random(f"{seed}-{key}")
        return ragged_lengths(rng, n_seq, median, cap), rng.randrange(2**31)

    lengths, s = batch(f"pair{rank // 2}")
    run_case(pair, 2, rank % 2, device, lengths, "zigzag", dtype, heads, dqk, dv, s)
    lengths, s = batch("world")
    run_case(dist.group.WORLD, 4, rank, device, lengths, "zigzag", dtype, heads, dqk, dv, s)
    lengths, s = batch(f"again{rank // 2}")
    run_case(pair, 2, rank % 2, device, lengths, ("contiguous", "zigzag")[rank // 2], dtype, heads, dqk, dv, s)
    lengths, s = batch("world-contiguous")
    run_case(dist.group.WORLD, 4, rank, device, lengths, "contiguous", dtype, heads, dqk, dv, s)
    # One pair attends an empty batch while the other attends a real one.
    lengths, s = batch("half-empty")
    run_case(pair, 2, rank % 2, device, lengths if rank < 2 else [0, 0], "zigzag", dtype, heads, dqk, dv, s)
    return True


def check_core_attention_dynamic_cp(rank, world, backend, seed):
    """MLACoreAttention (the Megatron core-attention module) under dynamic CP: the group of each
    micro-batch comes from ``packed_seq_params.cp_group`` with ``local_cp_size``, pairs of ranks
    in one micro-batch, the whole world in the next, no CP at all (local_cp_size 1) in the last;
    each rank's [t, n * Dv] rows equal the single-process attention's, and its gradients too."""
    from types import SimpleNamespace

    from verl_ops.integrations.megatron_mla import MLACoreAttention

    dist, device = _setup(rank, backend)
    assert world == 4
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dtype, dqk, dv = _kind(device)
    heads = 2
    config = SimpleNamespace(attention_dropout=0.0, kv_channels=dqk, softmax_type="vanilla", window_size=None)
    core = MLACoreAttention(config, 1, "causal", "self", cp_comm_type="p2p")
    core_ag = MLACoreAttention(config, 1, "causal", "self", cp_comm_type="all_gather")
    rng = random.Random(seed)
    for key, group, cp, r in (
        (f"pair{rank // 2}", pairs[rank // 2], 2, rank % 2),
        ("world", dist.group.WORLD, 4, rank),
        (f"alone{rank}", None, 1, 0),
    ):
        lengths = ragged_lengths(random.Random(f"{seed}-{key}"), 5, 10.0, 40)
        layout = ThdLayout.from_lengths(lengths, cp_size=cp, cp_layout="zigzag")
        cu_real, cu_padded = layout.cu_seqlens_cpu, layout.cu_seqlens_padded_cpu
        rows = rank_rows(cu_padded.tolist(), cp, r, "zigzag")
        q, k, v, grad = _full_batch(rng.randrange(2**31), layout.total_padded,
                                    heads, dqk, dv, dtype)
        want = _attend(*(x.double() if device.type == "cpu" else x.to(device) for x in (q, k, v, grad)),
                       cu_padded if device.type == "cpu" else cu_padded.to(device), layout.max_seqlen, None)
        want = [w[rows.to(w.device)] for w in want]
        psp = SimpleNamespace(
            qkv_format="thd", cu_seqlens_q=cu_real.to(device), cu_seqlens_kv=cu_real.to(device),
            cu_seqlens_q_padded=cu_padded.to(device), cu_seqlens_kv_padded=cu_padded.to(device),
            max_seqlen_q=layout.max_seqlen, max_seqlen_kv=layout.max_seqlen,
            local_cp_size=cp, cp_group=group,
        )
        for module in (core, core_ag):
            ql, kl, vl = (x[rows].to(device).requires_grad_(True) for x in (q, k, v))
            out = module(ql, kl, vl, None, packed_seq_params=psp)
            assert tuple(out.shape) == (rows.numel(), heads * dv), tuple(out.shape)
            out.backward(grad[rows].to(device).reshape(rows.numel(), heads * dv))
            what = f"MLACoreAttention {module.cp_comm_type} {key} cp={cp} rank={r}"
            for name, got, w in zip(("out", "dq", "dk", "dv"),
                                    (out.detach().reshape(-1, heads, dv), ql.grad, kl.grad, vl.grad), want):
                _assert_close(f"{what}: {name}", got.cpu(), w.cpu(), TOL[dtype])
    return True


def check_empty(rank, world, backend):
    """An empty batch and a batch of empty sequences: [0, n, Dv] out, zero-size gradients, no hang;
    the group is in step afterwards."""
    dist, device = _setup(rank, backend)
    group = dist.group.WORLD
    dtype, dqk, dv = _kind(device)
    for cp_layout in ("zigzag", "contiguous"):
        for lengths in ([], [0], [0, 0, 0]):
            assert run_case(group, world, rank, device, lengths, cp_layout, dtype, 2, dqk, dv, 1) == 0
    # Explicit: the shapes of the result and of the gradients.
    q = torch.zeros(0, 3, dqk, dtype=dtype, device=device, requires_grad=True)
    k = torch.zeros(0, 3, dqk, dtype=dtype, device=device, requires_grad=True)
    v = torch.zeros(0, 3, dv, dtype=dtype, device=device, requires_grad=True)
    out = verl_ops.mla_cp_attention(q, k, v, torch.zeros(1, dtype=torch.int32), 0, cp_group=group)
    assert tuple(out.shape) == (0, 3, dv)
    out.sum().backward()
    assert tuple(q.grad.shape) == (0, 3, dqk) and tuple(k.grad.shape) == (0, 3, dqk) and tuple(v.grad.shape) == (0, 3, dv)
    run_case(group, world, rank, device, [3, 0, 8], "zigzag", dtype, 2, dqk, dv, 2)
    return True


def _valid_shard(world, rank, device, lengths=(5, 9), heads=2, cp_layout="zigzag"):
    dtype, dqk, dv = _kind(device)
    layout = ThdLayout.from_lengths(list(lengths), cp_size=world, cp_layout=cp_layout)
    t = layout.local_rows
    g = torch.Generator().manual_seed(rank)
    q, k = (torch.randn(t, heads, dqk, generator=g, dtype=dtype).to(device) for _ in range(2))
    v = torch.randn(t, heads, dv, generator=g, dtype=dtype).to(device)
    return q, k, v, layout.cu_seqlens_padded_cpu, layout.max_seqlen


def check_bad_input(rank, world, backend):
    """The same bad argument on every rank: a clear error on every rank naming the op and the
    argument, no hang, and the group still in step afterwards."""
    dist, device = _setup(rank, backend)
    group = dist.group.WORLD
    dtype, dqk, dv = _kind(device)
    q, k, v, cu, max_seqlen = _valid_shard(world, rank, device)

    def call(q=q, k=k, v=v, cu=cu, max_seqlen=max_seqlen, **kw):
        # A fresh offsets tensor each call: what is checked here is the first call's validation.
        return verl_ops.mla_cp_attention(q, k, v, cu.clone(), max_seqlen, cp_group=group, **kw)

    call()  # the valid call works
    # Zigzag: a padded length that is not a multiple of 2 * cp (the total still splits in cp).
    bad_cu = torch.tensor([0, 2 * world, 3 * world], dtype=torch.int32)
    t = 3
    q3, k3 = (torch.ones(t, 2, dqk, dtype=dtype, device=device) for _ in range(2))
    v3 = torch.ones(t, 2, dv, dtype=dtype, device=device)
    _expect_error(r"cu_seqlens_padded.*multiple", lambda: call(q3, k3, v3, bad_cu, 2 * world))
    # Contiguous: a padded length that is not a multiple of cp.
    bad_cu = torch.tensor([0, world + 1, 2 * world], dtype=torch.int32)
    q2, k2 = (torch.ones(2, 2, dqk, dtype=dtype, device=device) for _ in range(2))
    v2 = torch.ones(2, 2, dv, dtype=dtype, device=device)
    _expect_error(r"cu_seqlens_padded", lambda: call(q2, k2, v2, bad_cu, world + 1, cp_layout="contiguous"))
    # Offsets that do not start at 0 / decrease.
    _expect_error(r"cu_seqlens_padded", lambda: call(cu=cu + 2 * world))
    _expect_error(r"cu_seqlens_padded", lambda: call(cu=cu.flip(0)))
    # The value head dim above the query head dim.
    _expect_error(r"\bv\b", lambda: call(v=torch.ones(q.shape[0], 2, dqk + 8, dtype=dtype, device=device)))
    # Mismatched dtypes.
    other = torch.float32 if dtype != torch.float32 else torch.float64
    _expect_error(r"dtype", lambda: call(k=k.to(other)))
    # Rows that do not match the offsets.
    _expect_error(r"rows", lambda: call(q=q[1:], k=k[1:], v=v[1:]))
    # A layout name the op does not know.
    _expect_error(r"cp_layout", lambda: call(cp_layout="ring"))
    # Every rank is still in step: a valid call gives the right answer.
    run_case(group, world, rank, device, [4, 11, 1], "zigzag", dtype, 2, dqk, dv, 3)
    return True


def check_bad_input_one_rank(rank, world, backend):
    """A bad argument on one rank only: that rank raises its own error and the others raise too
    (no rank waits in a collective the bad rank never joins); the group is in step afterwards."""
    dist, device = _setup(rank, backend)
    group = dist.group.WORLD
    dtype, dqk, dv = _kind(device)
    q, k, v, cu, max_seqlen = _valid_shard(world, rank, device)
    if rank == 1:
        q, k, v = q[1:], k[1:], v[1:]  # one row short
    _expect_error(r"\S", lambda: verl_ops.mla_cp_attention(q, k, v, cu, max_seqlen, cp_group=group))
    run_case(group, world, rank, device, [4, 11, 1], "zigzag", dtype, 2, dqk, dv, 4)
    return True


def check_bad_input_one_rank_after_a_valid_call(rank, world, backend):
    """As check_bad_input_one_rank, with the offsets tensor of an earlier valid call (whatever the
    op remembers about it): every rank raises, none hangs, the group is in step afterwards."""
    dist, device = _setup(rank, backend)
    group = dist.group.WORLD
    dtype, dqk, dv = _kind(device)
    q, k, v, cu, max_seqlen = _valid_shard(world, rank, device)
    verl_ops.mla_cp_attention(q, k, v, cu, max_seqlen, cp_group=group)
    if rank == 1:
        q, k, v = q[1:], k[1:], v[1:]  # one row short
    _expect_error(r"\S", lambda: verl_ops.mla_cp_attention(q, k, v, cu, max_seqlen, cp_group=group))
    run_case(group, world, rank, device, [4, 11, 1], "zigzag", dtype, 2, dqk, dv, 4)
    return True


def check_cached_offsets_do_not_change_collectives(rank, world, backend):
    """Reusing one offsets tensor across calls on some ranks while others pass a fresh copy each
    call (any rank may build its offsets anew) gives the right answer on every rank: the
    collectives a rank issues do not depend on what it remembers from earlier calls."""
    dist, device = _setup(rank, backend)
    group = dist.group.WORLD
    dtype, dqk, dv = _kind(device)
    lengths = [6, 13, 0, 2]
    layout = ThdLayout.from_lengths(lengths, cp_size=world, cp_layout="zigzag")
    shared = layout.cu_seqlens_padded_cpu.clone()
    rows = rank_rows(shared.tolist(), world, rank, "zigzag")
    q, k, v, grad = _full_batch(5, layout.total_padded, 2, dqk, dv, dtype)
    if device.type == "cpu":
        want = _attend(q, k, v, grad, shared, layout.max_seqlen, None)[0][rows]
    else:
        cu_dev = shared.to(device)
        want = _attend(q.to(device), k.to(device), v.to(device), grad.to(device), cu_dev, layout.max_seqlen, None)[0]
        want = want[rows.to(device)]
    for _ in range(3):
        cu = shared if rank % 2 == 0 else shared.clone()
        out = verl_ops.mla_cp_attention(q[rows].to(device), k[rows].to(device), v[rows].to(device), cu,
                                        layout.max_seqlen, cp_group=group)
        _assert_close(f"rank {rank}", out.cpu(), want.cpu(), TOL[dtype])
    return True


def check_under_inference_mode(rank, world, backend):
    """A forward under torch.inference_mode, its offsets made there (a tensor without a version
    counter): the right rows on every rank, call after call, the offsets changed in place between
    calls included (nothing may be remembered on such a tensor)."""
    dist, device = _setup(rank, backend)
    group = dist.group.WORLD
    dtype, dqk, dv = _kind(device)
    for lengths in ([6, 13, 0, 2], [9, 4, 8, 3]):  # as many sequences: one offsets tensor for both
        layout = ThdLayout.from_lengths(lengths, cp_size=world, cp_layout="zigzag")
        rows = rank_rows(layout.cu_seqlens_padded_cpu.tolist(), world, rank, "zigzag")
        q, k, v, grad = _full_batch(11, layout.total_padded, 2, dqk, dv, dtype)
        want = _attend(q, k, v, grad, layout.cu_seqlens_padded_cpu, layout.max_seqlen, None)[0][rows]
        with torch.inference_mode():
            if lengths[0] == 6:
                cu = layout.cu_seqlens_padded_cpu.clone()
            else:
                cu.copy_(layout.cu_seqlens_padded_cpu)  # in place: the same tensor, other offsets
            assert cu.is_inference()
            for _ in range(2):
                out = verl_ops.mla_cp_attention(q[rows].to(device), k[rows].to(device), v[rows].to(device), cu,
                                                layout.max_seqlen, cp_group=group)
                _assert_close(f"rank {rank} {lengths}", out.cpu(), want.cpu(), TOL[dtype])
    # Ordinary offsets used under inference mode first, then with grad: the plan the first call
    # built (inference tensors, which autograd cannot save) must not reach the second.
    cu = layout.cu_seqlens_padded_cpu.clone()
    with torch.inference_mode():
        verl_ops.mla_cp_attention(q[rows].to(device), k[rows].to(device), v[rows].to(device), cu,
                                  layout.max_seqlen, cp_group=group)
    ql, kl, vl = (x[rows].to(device).requires_grad_(True) for x in (q, k, v))
    out = verl_ops.mla_cp_attention(ql, kl, vl, cu, layout.max_seqlen, cp_group=group)
    _assert_close(f"rank {rank} grad", out.detach().cpu(), want.cpu(), TOL[dtype])
    out.backward(grad[rows].to(device))
    assert ql.grad is not None and kl.grad is not None and vl.grad is not None
    return True


# --------------------------------------------------------------------------------------------
# Tests.


def test_matches_full_attention(dist_run):
    dist_run("check_matches_full_attention", 1234 + dist_run.world, timeout_s=240.0)


def test_no_group_or_group_of_one_is_plain_attention(dist_run):
    dist_run("check_no_group_is_plain_attention")


def test_dynamic_cp_groups(dist_run4):
    dist_run4("check_dynamic_cp", 77, timeout_s=240.0)


def test_core_attention_dynamic_cp(dist_run4):
    dist_run4("check_core_attention_dynamic_cp", 5, timeout_s=240.0)


def test_empty_batches(dist_run):
    dist_run("check_empty")


def test_bad_input_raises_on_every_rank(dist_run):
    dist_run("check_bad_input", timeout_s=60.0)


def test_bad_input_on_one_rank_raises_everywhere(dist_run):
    # Less than the pool's 30 s collective timeout: a rank left waiting in a collective is a hang.
    dist_run("check_bad_input_one_rank", timeout_s=25.0)


def test_bad_input_on_one_rank_after_a_valid_call(dist_run):
    dist_run("check_bad_input_one_rank_after_a_valid_call", timeout_s=25.0)


def test_offsets_cache_does_not_change_collectives(dist_run):
    dist_run("check_cached_offsets_do_not_change_collectives", timeout_s=25.0)


def test_rank_rows_is_the_pack():
    """rank_rows (the tests' index function) is preprocess_thd's layout, for both layouts."""
    rng = random.Random(3)
    for cp in (1, 2, 4):
        for cp_layout in ("zigzag", "contiguous"):
            for _ in range(5):
                layout = ThdLayout.from_lengths(ragged_lengths(rng, 6), cp_size=cp, cp_layout=cp_layout)
                seen = torch.cat([rank_rows(layout.cu_seqlens_padded_cpu.tolist(), cp, r, cp_layout) for r in range(cp)])
                assert torch.equal(seen.sort().values, torch.arange(layout.total_padded))  # a partition
                for r in range(cp):
                    _check_rows_are_the_pack(layout, r, rank_rows(layout.cu_seqlens_padded_cpu.tolist(), cp, r, cp_layout))


def test_without_distributed():
    """No process group at all (cp_group=None): the plain attention."""
    rng = random.Random(9)
    for cp_layout in ("zigzag", "contiguous"):
        run_case(None, 1, 0, torch.device("cpu"), ragged_lengths(rng, 6), cp_layout, torch.float64, 3, 24, 16,
                 rng.randrange(2**31))
    with pytest.raises(ValueError, match=f"{OP}.*cp_layout"):
        verl_ops.mla_cp_attention(*(torch.zeros(0, 1, 8, dtype=torch.float64) for _ in range(3)),
                                  torch.zeros(1, dtype=torch.int32), 0, cp_layout="ring")


def test_under_inference_mode(dist_run):
    dist_run("check_under_inference_mode", timeout_s=60.0)
