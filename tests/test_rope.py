"""mla_rope (MLA's RoPE of THD rows in one pass) against the rotate-half RoPE written as plain
elementwise ops (Megatron-Core's formula), bit for bit in every dtype, forward and backward; the THD
position index against Megatron's per-sequence loop (CP zigzag chunks, packed frequency tables);
bad input."""

from __future__ import annotations

import random

import pytest
import torch

import verl_ops
from verl_ops._rope import mla_rope, thd_rope_plan, thd_rope_positions

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def reference(x, freqs, positions, mscale, interleaved):
    """Rotate-half RoPE as chained elementwise ops: x [rows, heads, dim], freqs [S, dim] float32."""
    t = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1) if interleaved else x
    f = freqs[positions][:, None, :]
    cos_ = (torch.cos(f) * mscale).to(x.dtype)
    sin_ = (torch.sin(f) * mscale).to(x.dtype)
    x1, x2 = torch.chunk(t, 2, dim=-1)
    return t * cos_ + torch.cat((-x2, x1), dim=-1) * sin_


def tables(freqs, mscale, dtype):
    return (torch.cos(freqs) * mscale).to(dtype), (torch.sin(freqs) * mscale).to(dtype)


def rope_freqs(rows, dim, base=10000.0):
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    f = torch.outer(torch.arange(rows, dtype=torch.float32), inv)
    return torch.cat((f, f), dim=-1)  # Megatron's [S, dim] layout: the half repeated


def devices():
    out = ["cpu"]
    if torch.cuda.is_available():
        out.append(pytest.param("cuda", marks=pytest.mark.gpu))
    return out


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", [True, False])
def test_forward_and_backward_bitwise(device, dtype, interleaved):
    g = torch.Generator().manual_seed(1)
    rows, heads, dim, table = 37, 3, 16, 50
    # A strided x: the rope dims of a wider projection output, as MLA slices them.
    wide = torch.randn(rows, heads, 40, generator=g).to(dtype)
    x = wide[..., 24:].to(device)
    freqs = rope_freqs(table, dim).to(device)
    positions = torch.randint(0, table, (rows,), generator=g).to(device)
    mscale = 1.3
    cos, sin = tables(freqs, mscale, dtype)
    xr = x.detach().clone().requires_grad_(True)
    xo = x.detach().clone().requires_grad_(True)
    want = reference(xr, freqs, positions, mscale, interleaved)
    got = mla_rope(xo, cos, sin, positions, interleaved=interleaved)
    assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got, want), (got - want).abs().max()
    grad = torch.randn(want.shape, generator=g).to(dtype).to(device)
    want.backward(grad)
    got.backward(grad)
    assert torch.equal(xo.grad, xr.grad), (xo.grad - xr.grad).abs().max()


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("width,offset,dim", [(192, 128, 64), (192, 128, 32), (75, 3, 64), (200, 8, 48)],
                         ids=["mla", "dim32", "unaligned", "dim48"])
def test_in_place_equals_out_of_place(device, dtype, interleaved, width, offset, dim):
    """mla_rope_ (x's dims rotated in place) writes what mla_rope returns, forward and backward, and
    leaves the rest of a wider buffer alone. On a GPU, 16-bit MLA-shaped rows (192-wide, rope at
    column 128) take the vector kernel in place; the unaligned and dim 48 cases take the scalar one
    through a buffer."""
    g = torch.Generator().manual_seed(3)
    rows, heads, table = 301, 5, 64
    freqs = rope_freqs(table, dim).to(device)
    cos, sin = tables(freqs, 0.9, dtype)
    positions = torch.randint(0, table, (rows,), generator=g).to(device)
    for backward in (False, True):
        wide = torch.randn(rows, heads, width, generator=g).to(dtype).to(device)
        x = wide[..., offset:offset + dim]
        want = torch.ops.verl_ops.mla_rope(x, cos, sin, positions, interleaved, backward)
        before = wide.clone()
        version = wide._version
        torch.ops.verl_ops.mla_rope_(x, cos, sin, positions, interleaved, backward)
        assert torch.equal(wide[..., offset:offset + dim], want)
        assert torch.equal(wide[..., :offset], before[..., :offset])
        assert torch.equal(wide[..., offset + dim:], before[..., offset + dim:])
        assert wide._version > version


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("in_place", [False, True])
def test_cuda_positions_outside_the_table_give_zeros(in_place):
    """On a GPU positions are not read on the host: a row outside the table gets zeros (vector kernel)."""
    dim, table = 64, 8
    cos, sin = tables(rope_freqs(table, dim).cuda(), 1.0, torch.bfloat16)
    x = torch.randn(6, 4, 192, device="cuda", dtype=torch.bfloat16)
    positions = torch.tensor([0, -1, 7, 8, 3, 100], device="cuda")
    want = torch.ops.verl_ops.mla_rope(x[..., 128:], cos, sin, positions.clamp(0, table - 1), True, False)
    if in_place:
        torch.ops.verl_ops.mla_rope_(x[..., 128:], cos, sin, positions, True, False)
        got = x[..., 128:]
    else:
        got = torch.ops.verl_ops.mla_rope(x[..., 128:], cos, sin, positions, True, False)
    bad = torch.tensor([False, True, False, True, False, True], device="cuda")
    assert torch.equal(got[~bad], want[~bad])
    assert not got[bad].any()


def test_in_place_refuses_to_record():
    x = torch.randn(4, 2, 8, requires_grad=True)
    cos, sin = tables(rope_freqs(4, 8), 1.0, torch.float32)
    with pytest.raises(RuntimeError, match="mla_rope_: the in-place form is not differentiable"):
        torch.ops.verl_ops.mla_rope_(x, cos, sin, torch.zeros(4, dtype=torch.int64))
    with torch.no_grad():
        torch.ops.verl_ops.mla_rope_(x, cos, sin, torch.zeros(4, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="mla_rope_: positions must be"):
        torch.ops.verl_ops.mla_rope_(x.detach(), cos, sin, torch.zeros(3, dtype=torch.int64))


def test_in_place_refuses_an_overlapping_x():
    """An expanded (or otherwise self-overlapping) x would be written twice: refused, naming x."""
    cos, sin = tables(rope_freqs(4, 8), 1.0, torch.float32)
    pos = torch.zeros(5, dtype=torch.int64)
    for x in (torch.randn(1, 3, 8).expand(5, 3, 8), torch.randn(5, 1, 8).expand(5, 3, 8),
              torch.randn(64).as_strided((5, 3, 8), (4, 8, 1))):
        with pytest.raises(RuntimeError, match=r"mla_rope_: x must not overlap itself"):
            torch.ops.verl_ops.mla_rope_(x, cos, sin, pos)
    ok = torch.randn(5, 3, 16)[..., 4:12]  # strided, not overlapping
    torch.ops.verl_ops.mla_rope_(ok, cos, sin, pos)


def test_in_place_opcheck():
    x = torch.randn(6, 2, 8, dtype=torch.float64)
    cos, sin = tables(rope_freqs(9, 8), 0.7, torch.float64)
    pos = torch.tensor([0, 8, 3, 3, 1, 4])
    torch.library.opcheck(torch.ops.verl_ops.mla_rope_.default, (x, cos, sin, pos, True, True))


def test_non_contiguous_grad_and_zero_rows():
    x = torch.randn(0, 2, 8, requires_grad=True)
    cos, sin = tables(rope_freqs(4, 8), 1.0, torch.float32)
    out = mla_rope(x, cos, sin, torch.zeros(0, dtype=torch.int64))
    assert out.shape == (0, 2, 8)
    x = torch.randn(5, 2, 8, dtype=torch.float64, requires_grad=True)
    freqs = rope_freqs(6, 8)
    cos, sin = tables(freqs, 1.0, torch.float64)
    pos = torch.tensor([0, 5, 2, 2, 1])
    grad = torch.randn(5, 8, 2, dtype=torch.float64).transpose(1, 2)  # not contiguous
    mla_rope(x, cos, sin, pos).backward(grad)
    xr = x.detach().clone().requires_grad_(True)
    reference(xr, freqs, pos, 1.0, True).backward(grad)
    assert torch.equal(x.grad, xr.grad)


def test_opcheck():
    x = torch.randn(6, 2, 8, dtype=torch.float64, requires_grad=True)
    cos, sin = tables(rope_freqs(9, 8), 0.7, torch.float64)
    pos = torch.tensor([0, 8, 3, 3, 1, 4])
    torch.library.opcheck(torch.ops.verl_ops.mla_rope.default, (x, cos, sin, pos, True, False))
    assert torch.autograd.gradcheck(lambda t: mla_rope(t, cos, sin, pos), (x,))


class _Group:
    """What Megatron's THD RoPE reads of its CP group."""

    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def megatron_thd_positions(lengths, cp, rank, packed):
    """Megatron's assignment, written per sequence: local rows of sequence i are its zigzag chunks
    `rank` and `2 cp - 1 - rank` (each half of the local rows), offset by the sequence start when
    the frequency table is per packed token."""
    out, start = [], 0
    for n in lengths:
        local = n // cp
        seg = local // 2
        idx = list(range(local)) if cp == 1 else (
            list(range(rank * seg, (rank + 1) * seg)) + list(range(n - (rank + 1) * seg, n - rank * seg))
        )
        out += [start + i if packed else i for i in idx]
        start += n
    return torch.tensor(out, dtype=torch.int64)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("packed", [False, True])
def test_thd_positions(cp, packed, device):
    """Megatron's positions, built on the device asked for; the plan's largest position is theirs."""
    rng = random.Random(cp * 10 + packed)
    cases = [[0, 2 * cp, 6 * cp, 4 * cp, 2 * cp], [2 * cp], [0, 0], []]
    cases += [[2 * cp * rng.randint(0, 40) for _ in range(rng.randint(1, 9))] for _ in range(5)]
    for lengths in cases:
        cu = torch.tensor([0] + list(torch.tensor(lengths, dtype=torch.int64).cumsum(0)), dtype=torch.int32)
        for rank in range(cp):
            want = megatron_thd_positions(lengths, cp, rank, packed)
            got = thd_rope_positions(cu, sum(lengths) // cp, cp, rank, packed, device=device)
            assert got.device.type == device and got.dtype == torch.int64
            assert torch.equal(got.cpu(), want), (lengths, cp, rank, got, want)
            top = thd_rope_plan(cu, sum(lengths) // cp, cp, rank, packed)[1]
            assert top == (int(want.max()) if want.numel() else -1), (lengths, cp, rank)
        assert thd_rope_positions(cu, sum(lengths) // cp + 1, cp, 0, packed, device=device) is None
    # Offsets that decrease (their rows still adding up): no positions, not a device-side error.
    cu = torch.tensor([0, 5 * cp, 3 * cp, 8 * cp], dtype=torch.int32)
    assert thd_rope_plan(cu, 8, cp, 0, packed) is None
    assert thd_rope_positions(cu, 8, cp, 0, packed, device=device) is None
    # A packed table and offsets that start below 0: positions before its first row.
    cu = torch.tensor([-4 * cp, 4 * cp, 8 * cp], dtype=torch.int32)
    assert (thd_rope_plan(cu, 12, cp, 0, packed) is None) == packed
    assert thd_rope_plan(torch.zeros(0, dtype=torch.int32), 0, cp, 0, packed) is None


@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fast_thd_rope_equals_megatrons(cp, dtype):
    """The replacement install() puts into megatron-core against megatron-core's own THD RoPE."""
    rope_utils = pytest.importorskip("megatron.core.models.common.embeddings.rope_utils")
    from verl_ops.integrations.megatron_mla import fast_thd_rope

    original = getattr(rope_utils._apply_rotary_pos_emb_thd, "__wrapped__", rope_utils._apply_rotary_pos_emb_thd)
    fast = fast_thd_rope(original)
    lengths = [2 * cp, 10 * cp, 4 * cp]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    g = torch.Generator().manual_seed(7)
    for rank in range(cp):
        for packed in (False, True):
            freqs = rope_freqs(sum(lengths) if packed else max(lengths), 8)[:, None, None, :]
            t = torch.randn(sum(lengths) // cp, 3, 8, generator=g).to(dtype)
            kw = dict(rotary_interleaved=False, mscale=1.1, cp_group=_Group(cp, rank))
            mla_kw = "mla_rotary_interleaved" if "mla_rotary_interleaved" in original.__code__.co_varnames else (
                "multi_latent_attention")
            kw[mla_kw] = True
            a = t.clone().requires_grad_(True)
            b = t.clone().requires_grad_(True)
            want = original(a, cu, freqs, **kw)
            got = fast(b, cu, freqs, **kw)
            assert torch.equal(got, want), (rank, packed)
            grad = torch.randn(want.shape, generator=g).to(dtype)
            want.backward(grad)
            got.backward(grad)
            assert torch.equal(a.grad, b.grad), (rank, packed)
    # Interleaved rotate-half is not covered: it goes to Megatron's own function.
    freqs = rope_freqs(max(lengths), 8)[:, None, None, :]
    t = torch.randn(sum(lengths) // cp, 3, 8, generator=g)
    kw = dict(rotary_interleaved=True, mscale=1.0, cp_group=_Group(cp, 0))
    assert torch.equal(fast(t, cu, freqs, **kw), original(t, cu, freqs, **kw))


@pytest.mark.parametrize("cp", [1, 2])
def test_fast_thd_rope_under_inference_mode(cp):
    """Under torch.inference_mode the offsets and the frequency table are inference tensors (no
    version counter): megatron-core's rows, call after call, the offsets changed in place between
    calls included (nothing is remembered on such a tensor)."""
    rope_utils = pytest.importorskip("megatron.core.models.common.embeddings.rope_utils")
    from verl_ops.integrations.megatron_mla import fast_thd_rope

    original = getattr(rope_utils._apply_rotary_pos_emb_thd, "__wrapped__", rope_utils._apply_rotary_pos_emb_thd)
    fast = fast_thd_rope(original)
    mla_kw = "mla_rotary_interleaved" if "mla_rotary_interleaved" in original.__code__.co_varnames else (
        "multi_latent_attention")
    g = torch.Generator().manual_seed(11)
    with torch.inference_mode():
        # A table longer than the batch (per-sequence positions, which the offsets decide).
        freqs = rope_freqs(20 * cp, 8)[:, None, None, :]
        cu = torch.zeros(4, dtype=torch.int32)
        for rank in range(cp):
            kw = {"rotary_interleaved": False, "mscale": 1.1, "cp_group": _Group(cp, rank), mla_kw: True}
            # One total, other offsets, changed in place between calls of the same rank.
            for lengths in ([2 * cp, 10 * cp, 4 * cp], [8 * cp, 2 * cp, 6 * cp]):
                cu.copy_(torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32))
                assert cu.is_inference() and freqs.is_inference()
                t = torch.randn(sum(lengths) // cp, 3, 8, generator=g)
                want = original(t, cu, freqs, **kw)
                for _ in range(2):
                    assert torch.equal(fast(t, cu, freqs, **kw), want), (lengths, rank)
    # Ordinary offsets and table used under inference mode first, then with grad: what the first
    # call built (inference tensors, which autograd cannot save) must not reach the second.
    lengths = [2 * cp, 10 * cp, 4 * cp]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    freqs = rope_freqs(20 * cp, 8)[:, None, None, :]
    kw = {"rotary_interleaved": False, "mscale": 1.1, "cp_group": _Group(cp, 0), mla_kw: True}
    t = torch.randn(sum(lengths) // cp, 3, 8, generator=g)
    with torch.inference_mode():
        fast(t, cu, freqs, **kw)
    a, b = t.clone().requires_grad_(True), t.clone().requires_grad_(True)
    got, want = fast(a, cu, freqs, **kw), original(b, cu, freqs, **kw)
    assert torch.equal(got, want)
    got.sum().backward()
    want.sum().backward()
    assert torch.equal(a.grad, b.grad)


def test_bad_input():
    cos, sin = tables(rope_freqs(4, 8), 1.0, torch.float32)
    x = torch.randn(3, 2, 8)
    pos = torch.tensor([0, 1, 2])
    with pytest.raises(RuntimeError, match=r"mla_rope: positions\[1\]=4 is outside the 4 rows of cos / sin"):
        mla_rope(x, cos, sin, torch.tensor([0, 4, 1]))
    with pytest.raises(RuntimeError, match="mla_rope: positions must be int64"):
        mla_rope(x, cos, sin, pos.int())
    with pytest.raises(RuntimeError, match=r"mla_rope: positions must be \[3\]"):
        mla_rope(x, cos, sin, pos[:2])
    with pytest.raises(RuntimeError, match="mla_rope: cos must have x's dtype"):
        mla_rope(x, cos.double(), sin, pos)
    with pytest.raises(RuntimeError, match=r"mla_rope: sin must be \[table_rows, 8\]"):
        mla_rope(x, cos, sin[:, :4], pos)
    with pytest.raises(RuntimeError, match="mla_rope: the rope dim .* must be even"):
        mla_rope(torch.randn(3, 2, 7), cos[:, :7], sin[:, :7], pos)
    with pytest.raises(RuntimeError, match="mla_rope: x must be float32, float64, float16 or bfloat16"):
        mla_rope(x.int(), cos.int(), sin.int(), pos)
    with pytest.raises(RuntimeError, match=r"mla_rope: x must be \[rows, heads, dim\]"):
        mla_rope(x[0], cos, sin, pos)


def test_exported():
    assert verl_ops.mla_rope is mla_rope
