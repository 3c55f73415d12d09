"""preprocess_thd (pack) and postprocess_thd (unpack) against the docs/layout.md#pack reference:
property tests, dtypes and feature shapes, roundtrips, autograd, opcheck, torch.compile, CUDA graphs,
CUDA vs CPU, and the bad-input battery of docs/ops.md#errors."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import DTYPES, Batch, make_layout, random_data, random_lengths, scattered_mask, seed_of
from reference import ref_layout, ref_pack, ref_roll_dropped

import verl_ops
from verl_ops.layout import CP_LAYOUT_CODES
from verl_ops import ThdLayout, postprocess_thd, preprocess_thd

OPS = torch.ops.verl_ops
FORMS = ["jagged", "values", "padded"]
PADS = ["none", "min_local_rows", "bucket"]
LAYOUT_CP = [(lay, cp) for lay in ("zigzag", "contiguous") for cp in (1, 2, 3, 4)]
LAYOUT_CP_IDS = [f"{lay}-cp{cp}" for lay, cp in LAYOUT_CP]
FEATURES = [((), torch.int64), ((3,), torch.float32), ((2, 3), torch.bfloat16)]  # (F, dtype)


def ref_rank(batch: Batch, cu_padded, layout: ThdLayout, rank: int, roll: bool):
    return ref_pack(
        batch.seqs,
        cu_padded,
        layout.cp_size,
        rank,
        layout.cp_layout,
        roll,
        feature_shape=batch.feature_shape,
        dtype=batch.dtype,
    )


def raw_args(layout: ThdLayout, x):
    """(values, cu_seqlens, cu_seqlens_padded) of the raw ops for input x (values or padded)."""
    return x, layout.cu_seqlens.to(x.device), layout.cu_seqlens_padded.to(x.device)


def assert_same(got: torch.Tensor, expected: torch.Tensor, what=""):
    got = got.cpu()
    assert got.dtype == expected.dtype, what
    assert got.shape == expected.shape, what
    assert torch.equal(got, expected), what


def pack_all_ranks(x, layout, mask=None, roll=False):
    packs = [preprocess_thd(x, layout, r, attention_mask=mask, roll=roll)[0] for r in range(layout.cp_size)]
    return torch.stack(packs) if layout.cp_size > 1 else packs[0]


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill with a byte pattern that no test value equals (NaN for floats, 0xA5... for integers)."""
    if t.numel():
        t.view(torch.uint8).fill_(0xFF if t.is_floating_point() else 0xA5)
    return t


def poison_allocator(device, *nbytes):
    """Leave poisoned blocks of these sizes in the allocator (CPU malloc or the CUDA caching
    allocator), so that outputs of those sizes start out as garbage, not as fresh zero pages: a row
    an op forgets to write then shows up."""
    blocks = [poison_(torch.empty(max(n, 1), dtype=torch.uint8, device=device)) for n in nbytes]
    if device == "cuda":
        torch.cuda.synchronize()
    del blocks


# --------------------------------------------------------------------------------------------
# Property tests against the reference.


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("pad", PADS)
@pytest.mark.parametrize("fp8", [False, True], ids=["nofp8", "fp8"])
@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
@pytest.mark.parametrize("roll", [False, True], ids=["noroll", "roll"])
@pytest.mark.parametrize("cp_layout, cp", LAYOUT_CP, ids=LAYOUT_CP_IDS)
def test_pack_matches_reference(device, rng, cp_layout, cp, roll, tp, fp8, pad, form):
    factor = 2 if (cp_layout == "zigzag" and cp > 1) else 1
    for _ in range(2):
        lengths = random_lengths(rng, rng.randint(1, 7), tp * cp * factor)
        feature_shape, dtype = rng.choice(FEATURES)
        batch = Batch(rng, lengths, feature_shape, dtype)
        layout, cu_padded = make_layout(rng, lengths, tp, cp, cp_layout, fp8, pad)
        x, mask = batch.input(form, device)
        expected = [ref_rank(batch, cu_padded, layout, r, roll) for r in range(cp)]
        for r in range(cp):
            poison_allocator(device, layout.local_rows * batch.values[:1].nbytes, layout.local_rows * 8)
            packed, pos = preprocess_thd(x, layout, r, attention_mask=mask, roll=roll)
            ctx = f"lengths={lengths} rank={r}"
            assert packed.device.type == device
            assert_same(packed, expected[r][0], ctx)
            assert_same(pos, expected[r][1], ctx)
        # The raw op with cp_rank=-1 packs every rank at once: [cp, local_rows, *F].
        raw_x = x.values() if form == "jagged" else x
        packed, pos = OPS.preprocess_thd(
            *raw_args(layout, raw_x), layout.local_rows, cp, -1, CP_LAYOUT_CODES[cp_layout], roll, mask
        )
        assert_same(packed, torch.stack([e[0] for e in expected]))
        assert_same(pos, torch.stack([e[1] for e in expected]))


def test_reference_zigzag_example():
    """A hand-written case, so the reference itself is checked against verl's rows
    (docs/layout.md#padding-rows)."""
    seqs = [torch.arange(1, 6), torch.arange(11, 14)]  # lengths 5 and 3
    # cp=2 zigzag: padded 8 and 4, chunks of 2 and 1; local rows 6.
    packed, pos = ref_pack(seqs, [0, 8, 12], 2, 0, "zigzag", False)
    assert packed.tolist() == [1, 2, 0, 0, 11, 0]  # chunks 0, 3 of seq 0; chunks 0, 3 of seq 1
    assert pos.tolist() == [0, 1, 0, 0, 0, 0]  # padding rows of a second chunk: position 0
    packed, pos = ref_pack(seqs, [0, 8, 12], 2, 1, "zigzag", True)
    # position q holds token q+1 of the zero-padded sequence: 1 2 3 4 5 0 0 0 -> 2 3 4 5 0 0 0 1
    assert packed.tolist() == [4, 5, 0, 0, 13, 0]
    assert pos.tolist() == [3, 3, 0, 0, 1, 2]  # rolled inside chunks, chunk ends keep their own
    packed, pos = ref_pack(seqs, [0, 8, 12], 2, 1, "contiguous", False)
    assert packed.tolist() == [0, 0, 11, 12, 13, 0]  # global rows 6..11 of 1 2 3 4 5 0 0 0 | 11 12 13 0
    assert pos.tolist() == [0, 0, 0, 1, 2, 0]


# verl's own expectations (verl 0.9.1 and verl main's tests of preprocess_thd_engine), through the
# native op: (lengths-as-tokens, cu_padded, cp, rank, layout, roll, packed, positions).
VERL_ROW_CASES = [
    # min_local_rows padding, cp=1: position 0 in the padding rows
    ([list(range(100))], [0, 128], 1, 0, "zigzag", False, list(range(100)) + [0] * 28,
     list(range(100)) + [0] * 28),
    # one token, cp=2 (dynamic CP local_cp_size=2), rank 1: first-chunk padding keeps its position
    ([[7]], [0, 4], 2, 1, "zigzag", False, [0, 0], [1, 0]),
    # contiguous: global packed intervals, padding rows position 0
    ([[10, 11, 12, 13, 14], [20, 21, 22]], [0, 6, 10], 2, 1, "contiguous", False,
     [0, 20, 21, 22, 0], [0, 0, 1, 2, 0]),
    # contiguous roll: each sequence rolls on its own, positions rolled too
    ([[1, 2, 3, 4], [5, 6, 7, 8]], [0, 4, 8], 2, 0, "contiguous", True, [2, 3, 4, 1], [1, 2, 3, 0]),
    # zigzag roll, cp=2, labels 1..7 (verl 0.9.1; verl main's test expects [2, 3, 1, 1])
    ([list(range(1, 8))], [0, 8], 2, 0, "zigzag", True, [2, 3, 0, 1], [1, 1, 0, 0]),
    ([list(range(1, 8))], [0, 8], 2, 1, "zigzag", True, [4, 5, 6, 7], [3, 3, 5, 5]),
]


@pytest.mark.parametrize("case", VERL_ROW_CASES, ids=lambda c: f"{c[4]}-cp{c[2]}-r{c[3]}-roll{int(c[5])}")
def test_verl_row_examples(device, case):
    toks, cu_padded, cp, rank, cp_layout, roll, want, want_pos = case
    seqs = [torch.tensor(t, dtype=torch.int64) for t in toks]
    packed, pos = ref_pack(seqs, cu_padded, cp, rank, cp_layout, roll)
    assert packed.tolist() == want and pos.tolist() == want_pos
    layout = ThdLayout.from_padded_offsets(
        [len(t) for t in toks], torch.tensor(cu_padded, dtype=torch.int32), cp_size=cp, cp_layout=cp_layout
    ).to(device)
    x = torch.nested.nested_tensor([s.to(device) for s in seqs], layout=torch.jagged)
    got, got_pos = preprocess_thd(x, layout, rank, roll=roll)
    assert got.cpu().tolist() == want and got_pos.cpu().tolist() == want_pos


@pytest.mark.parametrize("feature_shape", [(), (5,), (3, 4), (48, 8)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtypes_and_feature_shapes(device, rng, dtype, feature_shape):
    lengths = random_lengths(rng, 6, 4)
    batch = Batch(rng, lengths, feature_shape, dtype)
    layout, cu_padded = make_layout(rng, lengths, cp=2, cp_layout="zigzag", fp8=True)
    for form in FORMS:
        x, mask = batch.input(form, device)
        for r in range(2):
            poison_allocator(device, layout.local_rows * batch.values[:1].nbytes, layout.local_rows * 8)
            packed, pos = preprocess_thd(x, layout, r, attention_mask=mask, roll=True)
            expected, expected_pos = ref_rank(batch, cu_padded, layout, r, True)
            assert_same(packed, expected, f"{form} rank {r}")
            assert_same(pos, expected_pos, f"{form} rank {r}")
        out = postprocess_thd(pack_all_ranks(x, layout, mask), layout, attention_mask=mask, as_nested=False)
        assert_same(out, batch.padded_expected() if form == "padded" else batch.values, form)


@pytest.mark.parametrize(
    "dtype, feature_shape",
    [
        (torch.uint8, ()),  # 1-byte rows
        (torch.bool, (1,)),
        (torch.uint8, (3,)),  # odd row sizes
        (torch.uint8, (7,)),
        (torch.uint8, (1, 1)),
        (torch.int16, (3,)),
        (torch.float16, (5,)),
        (torch.float32, (0,)),  # empty rows: only position ids carry information
        (torch.bfloat16, (4, 0)),
    ],
    ids=str,
)
@pytest.mark.parametrize("cp_layout, cp", [("zigzag", 4), ("contiguous", 2), ("zigzag", 1)])
def test_odd_row_sizes(device, rng, dtype, feature_shape, cp_layout, cp):
    lengths = random_lengths(rng, 9, 8) + [1, 0, 2]
    batch = Batch(rng, lengths, feature_shape, dtype)
    layout, cu_padded = make_layout(rng, lengths, cp=cp, cp_layout=cp_layout)
    for form in FORMS:
        x, mask = batch.input(form, device)
        for r in range(cp):
            packed, pos = preprocess_thd(x, layout, r, attention_mask=mask)
            expected, expected_pos = ref_rank(batch, cu_padded, layout, r, False)
            assert_same(packed, expected, f"{form} rank {r}")
            assert_same(pos, expected_pos, f"{form} rank {r}")
        out = postprocess_thd(pack_all_ranks(x, layout, mask), layout, attention_mask=mask, as_nested=False)
        assert_same(out, batch.padded_expected() if form == "padded" else batch.values, form)


def test_large_batch_cpu_threads(rng):
    """Enough rows for the CPU kernels' parallel_for to split the work over threads."""
    lengths = [rng.randint(0, 700) for _ in range(48)]
    batch = Batch(rng, lengths, (3,), torch.int32)
    for cp_layout, cp in (("zigzag", 4), ("contiguous", 2)):
        layout, cu_padded = make_layout(rng, lengths, 2, cp, cp_layout, True, "bucket")
        for masked in (False, True):
            x = batch.padded if masked else batch.values
            mask = batch.mask if masked else None
            cu, cup = layout.cu_seqlens, layout.cu_seqlens_padded
            poison_allocator("cpu", cp * layout.local_rows * 12, cp * layout.local_rows * 8)
            packed, pos = OPS.preprocess_thd(x, cu, cup, layout.local_rows, cp, -1, CP_LAYOUT_CODES[cp_layout], True, mask)
            expected = [ref_rank(batch, cu_padded, layout, r, True) for r in range(cp)]
            assert_same(packed, torch.stack([e[0] for e in expected]))
            assert_same(pos, torch.stack([e[1] for e in expected]))
            poison_allocator("cpu", x.numel() * 4)
            out = OPS.postprocess_thd(packed, cu, cup, layout.total_tokens, cp, -1, CP_LAYOUT_CODES[cp_layout], True, mask)
            assert_same(out, batch.padded_expected() if masked else batch.values)


def test_empty_batch_and_empty_sequences(device):
    # No sequences at all (values input only: a nested tensor needs at least one sequence).
    layout = ThdLayout.from_lengths([], cp_size=2)
    packed, pos = preprocess_thd(torch.zeros(0, 3, device=device), layout, 1)
    assert packed.shape == (0, 3) and pos.shape == (0,)
    out = postprocess_thd(torch.zeros(2, 0, 3, device=device), layout, as_nested=False)
    assert out.shape == (0, 3)
    # Only empty sequences, padded up by min_local_rows: every row is padding.
    layout = ThdLayout.from_lengths([0, 0], cp_size=2, min_local_rows=3, cp_layout="contiguous")
    packed, pos = preprocess_thd(torch.zeros(0, 3, device=device), layout, 1)
    assert_same(packed, torch.zeros(3, 3))
    assert_same(pos, torch.tensor([0, 0, 0]))  # padding rows hold position 0 (verl)


def test_non_contiguous_inputs(device, rng):
    lengths = random_lengths(rng, 7, 8)
    batch = Batch(rng, lengths, (6,), torch.float32)
    layout, cu_padded = make_layout(rng, lengths, cp=2)
    expected = [ref_rank(batch, cu_padded, layout, r, True) for r in range(2)]
    # values with a stride: every other column of a wider tensor.
    wide = torch.zeros(batch.values.shape[0], 12)
    wide[:, ::2] = batch.values
    # padded input and mask stored transposed ([S, B, F] and [S, B]).
    padded_t = batch.padded.transpose(0, 1).contiguous().transpose(0, 1)
    mask_t = batch.mask.t().contiguous().t()
    assert not padded_t.is_contiguous() and not mask_t.is_contiguous()
    for r in range(2):
        got = preprocess_thd(wide.to(device)[:, ::2], layout, r, roll=True)
        assert_same(got[0], expected[r][0])
        got = preprocess_thd(padded_t.to(device), layout, r, attention_mask=mask_t.to(device), roll=True)
        assert_same(got[0], expected[r][0])
        assert_same(got[1], expected[r][1])


# --------------------------------------------------------------------------------------------
# Roundtrips.


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("pad", PADS)
@pytest.mark.parametrize("fp8", [False, True], ids=["nofp8", "fp8"])
@pytest.mark.parametrize("cp_layout, cp", LAYOUT_CP, ids=LAYOUT_CP_IDS)
def test_roundtrip(device, rng, cp_layout, cp, fp8, pad, form):
    lengths = random_lengths(rng, rng.randint(1, 9), 2 * cp)
    batch = Batch(rng, lengths, (3,), torch.float32)
    layout, _ = make_layout(rng, lengths, 1, cp, cp_layout, fp8, pad)
    x, mask = batch.input(form, device)
    packed = pack_all_ranks(x, layout, mask)
    poison_allocator(device, batch.padded.numel() * 4, batch.values.numel() * 4)
    expected_shape = (cp, layout.local_rows, 3) if cp > 1 else (layout.local_rows, 3)
    assert packed.shape == expected_shape
    if form == "padded":
        out = postprocess_thd(packed, layout, attention_mask=mask)
        assert_same(out, batch.padded_expected())
    elif form == "jagged":
        out = postprocess_thd(packed, layout)  # as_nested=True
        assert out.is_nested
        assert_same(out.values(), batch.values)
        assert_same(out.offsets(), batch.offsets)
    else:
        out = postprocess_thd(packed, layout, as_nested=False)
        assert not out.is_nested
        assert_same(out, batch.values)


def roundtrip_expected(batch, layout, lengths, cp, cp_layout, masked, roll):
    """What an unpack of the full pack gives back: the batch, except that verl's roll leaves a few
    tokens in no row (a sequence followed by an empty one), which come back as zero."""
    values = batch.padded_expected() if masked else batch.values
    return dropped_as_zero(values, layout, lengths, cp, cp_layout, roll, batch.mask if masked else None)


def dropped_as_zero(values, layout, lengths, cp, cp_layout, roll, mask=None):
    expected = values.clone()
    if roll:
        for i, t in ref_roll_dropped(lengths, layout.cu_seqlens_padded_cpu.tolist(), cp, cp_layout):
            if mask is not None:
                expected[i, mask[i].nonzero()[t, 0]] = 0
            else:
                expected[int(layout.cu_seqlens_cpu[i]) + t] = 0
    return expected


@pytest.mark.parametrize("roll", [False, True], ids=["noroll", "roll"])
@pytest.mark.parametrize("masked", [False, True], ids=["jagged", "padded"])
@pytest.mark.parametrize("cp_layout, cp", LAYOUT_CP, ids=LAYOUT_CP_IDS)
def test_raw_roundtrip_per_rank(device, rng, cp_layout, cp, masked, roll):
    """The raw unpack of one rank's shard (cp_rank=r) restores exactly that rank's tokens and zeros
    the others; the shards together restore everything, rolled or not."""
    lengths = random_lengths(rng, 8, 2 * cp)
    batch = Batch(rng, lengths, (2,), torch.float64)
    layout, _ = make_layout(rng, lengths, 1, cp, cp_layout, True, "min_local_rows")
    mask = batch.mask.to(device) if masked else None
    x = (batch.padded if masked else batch.values).to(device)
    expected = roundtrip_expected(batch, layout, lengths, cp, cp_layout, masked, roll)
    cu, cu_padded = layout.cu_seqlens.to(device), layout.cu_seqlens_padded.to(device)
    total = torch.zeros_like(expected)
    covered = torch.zeros(expected.shape[:-1], dtype=torch.int64)
    for r in range(cp):
        packed, _ = OPS.preprocess_thd(x, cu, cu_padded, layout.local_rows, cp, r, CP_LAYOUT_CODES[cp_layout], roll, mask)
        out = OPS.postprocess_thd(packed, cu, cu_padded, layout.total_tokens, cp, r, CP_LAYOUT_CODES[cp_layout], roll, mask)
        out = out.cpu()
        # Every token comes back either exactly or as zero.
        assert torch.all((out == expected) | (out == 0))
        total += out
        covered += (out != 0).any(-1).long()
    assert_same(total, expected)
    assert covered.max() <= 1  # no token is restored by two ranks
    packed, _ = OPS.preprocess_thd(x, cu, cu_padded, layout.local_rows, cp, -1, CP_LAYOUT_CODES[cp_layout], roll, mask)
    out = OPS.postprocess_thd(packed, cu, cu_padded, layout.total_tokens, cp, -1, CP_LAYOUT_CODES[cp_layout], roll, mask)
    assert_same(out, expected)


# --------------------------------------------------------------------------------------------
# Autograd.


def small_case(seed=0, cp=2, cp_layout="zigzag", F=(2,), **layout_kw):
    rng = random.Random(seed)
    lengths = [3, 0, 5, 1, 2]
    batch = Batch(rng, lengths, F, torch.float64)
    layout = ThdLayout.from_lengths(lengths, cp_size=cp, cp_layout=cp_layout, **layout_kw)
    return batch, layout


@pytest.mark.parametrize("cp_layout, cp, rank", [("zigzag", 2, 1), ("contiguous", 4, 2), ("zigzag", 1, 0)])
@pytest.mark.parametrize("roll", [False, True], ids=["noroll", "roll"])
def test_gradcheck_preprocess(device, cp_layout, cp, rank, roll):
    batch, layout = small_case(cp=cp, cp_layout=cp_layout, min_local_rows=7)
    offsets = batch.offsets.to(device)
    mask = batch.mask.to(device)

    def jagged(values):
        nt = torch.nested.nested_tensor_from_jagged(values, offsets)
        return preprocess_thd(nt, layout, rank, roll=roll)[0]

    def plain(values):
        return preprocess_thd(values, layout, rank, roll=roll)[0]

    def padded(x):
        return preprocess_thd(x, layout, rank, attention_mask=mask, roll=roll)[0]

    values = batch.values.to(device).requires_grad_()
    assert torch.autograd.gradcheck(jagged, (values,))
    assert torch.autograd.gradcheck(plain, (values,))
    assert torch.autograd.gradcheck(padded, (batch.padded.to(device).requires_grad_(),))
    assert torch.autograd.gradgradcheck(plain, (values,))


@pytest.mark.parametrize("cp_layout, cp", [("zigzag", 2), ("contiguous", 4), ("zigzag", 1)])
def test_gradcheck_postprocess(device, cp_layout, cp):
    batch, layout = small_case(cp=cp, cp_layout=cp_layout, pad_to_length_bucket=16)
    g = torch.Generator().manual_seed(1)
    shape = (cp, layout.local_rows, 2) if cp > 1 else (layout.local_rows, 2)
    packed = torch.randn(shape, generator=g, dtype=torch.float64).to(device).requires_grad_()
    mask = batch.mask.to(device)
    assert torch.autograd.gradcheck(lambda p: postprocess_thd(p, layout, as_nested=False), (packed,))
    assert torch.autograd.gradcheck(lambda p: postprocess_thd(p, layout, attention_mask=mask), (packed,))
    assert torch.autograd.gradcheck(lambda p: postprocess_thd(p, layout).values(), (packed,))
    assert torch.autograd.gradgradcheck(lambda p: postprocess_thd(p, layout, as_nested=False), (packed,))


def test_grad_modes(device):
    """The Python API calls the op below the Autograd key when nothing needs a gradient (an input
    without requires_grad, no_grad, inference mode) and through it otherwise: same values, a
    graph only where one is wanted, gradients through the recorded one."""
    batch, layout = small_case(cp=2)
    values = batch.values.to(device)
    ref = preprocess_thd(values, layout, 1)[0]
    assert ref.grad_fn is None and not ref.requires_grad
    leaf = values.clone().requires_grad_()
    out = preprocess_thd(leaf, layout, 1)[0]
    assert out.grad_fn is not None and torch.equal(out.detach(), ref)
    out.sum().backward()
    assert leaf.grad.sum().item() == layout_valid_rows(layout, 1) * values.shape[1]
    with torch.no_grad():
        out = preprocess_thd(leaf, layout, 1)[0]
    assert out.grad_fn is None and not out.requires_grad and torch.equal(out, ref)
    with torch.inference_mode():
        out = preprocess_thd(values, layout, 1)[0]
    assert out.is_inference() and torch.equal(out, ref)
    shards = torch.stack([preprocess_thd(values, layout, r)[0] for r in range(2)])
    back = postprocess_thd(shards, layout, as_nested=False)
    assert back.grad_fn is None and torch.equal(back, values)
    leaf = shards.clone().requires_grad_()
    back = postprocess_thd(leaf, layout, as_nested=False)
    assert back.grad_fn is not None and torch.equal(back.detach(), values)


def layout_valid_rows(layout, rank):
    """How many of this rank's rows hold a valid token (each receives gradient 1 from sum())."""
    cu, cu_padded = layout.cu_seqlens.tolist(), layout.cu_seqlens_padded.tolist()
    count = 0
    for i in range(len(cu) - 1):
        n, p = cu[i + 1] - cu[i], cu_padded[i + 1] - cu_padded[i]
        c = p // (2 * layout.cp_size)
        for chunk in (rank, 2 * layout.cp_size - 1 - rank):
            count += max(0, min(n, (chunk + 1) * c) - chunk * c)
    return count


@pytest.mark.parametrize("roll", [False, True], ids=["noroll", "roll"])
def test_gradcheck_raw_ops(device, roll):
    batch, layout = small_case(cp=2, fp8_padding=True)
    cu, cu_padded = layout.cu_seqlens.to(device), layout.cu_seqlens_padded.to(device)
    mask = batch.mask.to(device)
    values = batch.values.to(device).requires_grad_()
    padded = batch.padded.to(device).requires_grad_()
    lr, T = layout.local_rows, layout.total_tokens
    for rank in (-1, 0, 1):
        assert torch.autograd.gradcheck(
            lambda v: OPS.preprocess_thd(v, cu, cu_padded, lr, 2, rank, 0, roll, None)[0], (values,)
        )
        assert torch.autograd.gradcheck(
            lambda x: OPS.preprocess_thd(x, cu, cu_padded, lr, 2, rank, 0, roll, mask)[0], (padded,)
        )
        shape = (2, lr, 2) if rank < 0 else (lr, 2)
        packed = torch.randn(shape, dtype=torch.float64, device=device).requires_grad_()
        assert torch.autograd.gradcheck(
            lambda p: OPS.postprocess_thd(p, cu, cu_padded, T, 2, rank, 0, roll, None), (packed,)
        )
        assert torch.autograd.gradcheck(
            lambda p: OPS.postprocess_thd(p, cu, cu_padded, T, 2, rank, 0, roll, mask), (packed,)
        )


def test_pack_backward_is_unpack(device, rng):
    """docs/layout.md#autograd: pack's backward is an unpack-gather of the gradient (padding rows
    drop out)."""
    lengths = random_lengths(rng, 6, 4)
    batch = Batch(rng, lengths, (3,), torch.float32)
    layout, _ = make_layout(rng, lengths, cp=2, pad="bucket")
    values = batch.values.to(device).requires_grad_()
    packed, _ = preprocess_thd(values, layout, 1, roll=True)
    grad = torch.randn(packed.shape).to(device)
    packed.backward(grad)
    expected = OPS.postprocess_thd(
        grad, layout.cu_seqlens.to(device), layout.cu_seqlens_padded.to(device), layout.total_tokens,
        2, 1, 0, True, None,
    )
    assert_same(values.grad, expected.cpu())


@pytest.mark.parametrize("masked", [False, True], ids=["jagged", "padded"])
def test_unpack_backward_is_pack(device, rng, masked):
    """docs/layout.md#autograd: unpack's backward wrt this rank's shard is the pack of the gradient
    for this rank."""
    lengths = random_lengths(rng, 6, 8)
    batch = Batch(rng, lengths, (3,), torch.float32)
    layout, _ = make_layout(rng, lengths, cp=4, cp_layout="zigzag", fp8=True)
    cu, cup = layout.cu_seqlens.to(device), layout.cu_seqlens_padded.to(device)
    mask = batch.mask.to(device) if masked else None
    packed = torch.randn(layout.local_rows, 3).to(device).requires_grad_()
    out = OPS.postprocess_thd(packed, cu, cup, layout.total_tokens, 4, 2, 0, True, mask)
    grad = torch.randn(out.shape).to(device)
    out.backward(grad)
    expected, _ = OPS.preprocess_thd(grad, cu, cup, layout.local_rows, 4, 2, 0, True, mask)
    assert_same(packed.grad, expected.cpu())


# --------------------------------------------------------------------------------------------
# opcheck.


def opcheck_cases(device):
    batch, layout = small_case(cp=2, fp8_padding=True)
    batch4, layout4 = small_case(seed=3, cp=4, cp_layout="contiguous", F=(2, 3), min_local_rows=9)
    d = device

    def lay(layout):
        return layout.cu_seqlens.to(d), layout.cu_seqlens_padded.to(d)

    v = batch.values.to(d).requires_grad_()
    x = batch.padded.to(d).requires_grad_()
    m = batch.mask.to(d)
    v4 = batch4.values.to(d).requires_grad_()
    x4, m4 = batch4.padded.to(d).requires_grad_(), batch4.mask.to(d)
    ids = batch.values[:, 0].to(torch.int64).to(d)
    lr, lr4, T, T4 = layout.local_rows, layout4.local_rows, layout.total_tokens, layout4.total_tokens
    pack = [
        (v, *lay(layout), lr, 2, 0, 0, False, None),
        (v, *lay(layout), lr, 2, -1, 0, True, None),
        (x, *lay(layout), lr, 2, 1, 0, True, m),
        (ids, *lay(layout), lr, 2, 1, 0, False, None),
        (v4, *lay(layout4), lr4, 4, 3, 1, True, None),
        (x4, *lay(layout4), lr4, 4, -1, 1, False, m4),
    ]
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(shape, generator=g, dtype=torch.float64).to(d).requires_grad_()

    unpack = [
        (rand(2, lr, 2), *lay(layout), T, 2, -1, 0, False, None),
        (rand(lr, 2), *lay(layout), T, 2, 1, 0, True, None),
        (rand(2, lr, 2), *lay(layout), T, 2, -1, 0, True, m),
        (rand(4, lr4, 2, 3), *lay(layout4), T4, 4, -1, 1, False, m4),
        (rand(lr4, 2, 3), *lay(layout4), T4, 4, 2, 1, True, None),
    ]
    return pack, unpack


def test_opcheck_preprocess(device):
    for args in opcheck_cases(device)[0]:
        torch.library.opcheck(OPS.preprocess_thd.default, args)


def test_opcheck_postprocess(device):
    for args in opcheck_cases(device)[1]:
        torch.library.opcheck(OPS.postprocess_thd.default, args)


@pytest.mark.parametrize(
    "args",
    [
        (torch.tensor([3, 0, 5]), 1, 2, 0, False, None, None),
        (torch.tensor([3, 0, 5], dtype=torch.int32), 2, 2, 1, True, 100, 24),
        (torch.tensor([], dtype=torch.int64), 1, 4, 0, True, None, 8),
    ],
)
def test_opcheck_thd_layout(args):
    """thd_layout is a host op (CPU lengths in, fresh int32 CPU offsets out, not differentiable);
    docs/ops.md#every-op still asks for a fake kernel (its output shapes are [B + 1]) and a clean opcheck."""
    torch.library.opcheck(OPS.thd_layout.default, args)


# --------------------------------------------------------------------------------------------
# torch.compile(fullgraph=True, dynamic=True).


def compile_case(rng, cp=2, cp_layout="zigzag", F=(4,), n=6, device="cpu", with_lengths=False, **kw):
    """A batch and its layout, the layout on `device` (built outside the compiled function)."""
    lengths = random_lengths(rng, n, 2 * cp)
    batch = Batch(rng, lengths, F, torch.float32)
    layout = ThdLayout.from_lengths(lengths, cp_size=cp, cp_layout=cp_layout, **kw).to(device)
    return (batch, layout, lengths) if with_lengths else (batch, layout)


def test_compile_python_api_values(device, rng):
    def f(values, layout):
        packed, pos = preprocess_thd(values, layout, 1, roll=True)
        return packed * 2, pos + 1

    cf = torch.compile(f, fullgraph=True, dynamic=True)
    for kw in (dict(), dict(fp8_padding=True), dict(cp_layout="contiguous", min_local_rows=50)):
        batch, layout = compile_case(rng, device=device, **kw)
        values = batch.values.to(device)
        got, want = cf(values, layout), f(values, layout)
        assert_same(got[0], want[0].cpu())
        assert_same(got[1], want[1].cpu())

    # Layout closed over rather than passed.
    batch, layout = compile_case(rng, device=device, cp=4, pad_to_length_bucket=24)
    values = batch.values.to(device)

    def h(values):
        return preprocess_thd(values, layout, 3)

    got, want = torch.compile(h, fullgraph=True, dynamic=True)(values), h(values)
    assert_same(got[0], want[0].cpu())
    assert_same(got[1], want[1].cpu())


def test_compile_python_api_padded(device, rng):
    def f(x, mask, layout):
        packed, pos = preprocess_thd(x, layout, 0, attention_mask=mask)
        out = postprocess_thd(torch.stack([packed, packed]), layout, attention_mask=mask)
        return packed, pos, out

    cf = torch.compile(f, fullgraph=True, dynamic=True)
    for kw in (dict(), dict(cp_layout="contiguous", fp8_padding=True)):
        batch, layout = compile_case(rng, device=device, **kw)
        x, mask = batch.padded.to(device), batch.mask.to(device)
        for got, want in zip(cf(x, mask, layout), f(x, mask, layout)):
            assert_same(got, want.cpu())


def test_compile_raw_ops(device, rng):
    def f(values, cu, cu_padded, local_rows: int, total_tokens: int, mask):
        packed, pos = OPS.preprocess_thd(values, cu, cu_padded, local_rows, 2, -1, 0, True, mask)
        out = OPS.postprocess_thd(packed, cu, cu_padded, total_tokens, 2, -1, 0, True, mask)
        return packed, pos, out

    cf = torch.compile(f, fullgraph=True, dynamic=True)
    for masked in (False, True):
        for kw in (dict(), dict(min_local_rows=64)):
            batch, layout, lengths = compile_case(rng, device=device, with_lengths=True, **kw)
            x = (batch.padded if masked else batch.values).to(device)
            mask = batch.mask.to(device) if masked else None
            cu, cup = layout.cu_seqlens, layout.cu_seqlens_padded
            args = (x, cu, cup, layout.local_rows, layout.total_tokens, mask)
            got, want = cf(*args), f(*args)
            for a, b in zip(got, want):
                assert_same(a, b.cpu())
            assert_same(got[2], roundtrip_expected(batch, layout, lengths, 2, "zigzag", masked, True))


def test_compile_backward(device, rng):
    def f(values, layout, weight):
        packed, pos = preprocess_thd(values, layout, 1, roll=True)
        return (packed * weight[: packed.shape[0]]).sum()

    cf = torch.compile(f, fullgraph=True, dynamic=True)
    batch, layout = compile_case(rng, device=device, fp8_padding=True)
    weight = torch.randn(layout.local_rows, 4).to(device)
    v1 = batch.values.to(device).requires_grad_()
    v2 = batch.values.to(device).requires_grad_()
    cf(v1, layout, weight).backward()
    f(v2, layout, weight).backward()
    assert_same(v1.grad, v2.grad.cpu())


def test_compile_nested_input(device, rng):
    def f(nt, layout):
        packed, pos = preprocess_thd(nt, layout, 1, roll=True)
        return packed + 1, pos

    cf = torch.compile(f, fullgraph=True, dynamic=True)
    for kw in (dict(), dict(cp_layout="contiguous", fp8_padding=True)):
        batch, layout = compile_case(rng, device=device, **kw)
        nt = batch.nested(device)
        got, want = cf(nt, layout), f(nt, layout)
        assert_same(got[0], want[0].cpu())
        assert_same(got[1], want[1].cpu())


def test_compile_nested_output(device, rng):
    """postprocess_thd's default output (as_nested=True, a jagged nested tensor) under
    torch.compile(fullgraph=True): docs/ops.md#every-op asks for no graph breaks."""

    def f(nt, layout):
        packed = torch.stack([preprocess_thd(nt, layout, r)[0] for r in range(layout.cp_size)])
        return postprocess_thd(packed, layout)

    batch, layout = compile_case(rng, device=device)
    nt = batch.nested(device)
    out = torch.compile(f, fullgraph=True, dynamic=True)(nt, layout)
    assert out.is_nested
    assert_same(out.values(), batch.values)
    assert_same(out.offsets(), batch.offsets)


@pytest.mark.gpu
def test_compile_cpu_layout_cuda_input(rng):
    """A layout left on the CPU with CUDA data: eager moves it; compiled code must too."""

    def f(values, layout):
        return preprocess_thd(values, layout, 1, roll=True)

    batch, layout = compile_case(rng, fp8_padding=True)
    values = batch.values.cuda()
    got, want = torch.compile(f, fullgraph=True, dynamic=True)(values, layout), f(values, layout)
    assert_same(got[0], want[0].cpu())
    assert_same(got[1], want[1].cpu())


# --------------------------------------------------------------------------------------------
# CUDA only: graph capture, poisoned outputs, CUDA vs CPU on large batches.


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("cp_layout, cp", LAYOUT_CP, ids=LAYOUT_CP_IDS)
def test_cuda_graph_replay(rng, cp_layout, cp, form):
    lengths = random_lengths(rng, 12, 2 * cp)
    batch = Batch(rng, lengths, (5,), torch.bfloat16)
    layout, cu_padded = make_layout(rng, lengths, 1, cp, cp_layout, True, "min_local_rows")
    layout = layout.to("cuda")
    rank = cp - 1
    x, mask = batch.input(form, "cuda")
    static_x = x.values() if form == "jagged" else x  # the nested tensor's values buffer is the input
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            preprocess_thd(x, layout, rank, attention_mask=mask, roll=True, validate=False)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        packed, pos = preprocess_thd(x, layout, rank, attention_mask=mask, roll=True, validate=False)
    # New data in the static input, garbage in the static outputs; replay must rewrite every row.
    g = torch.Generator().manual_seed(seed_of(rng))
    new = random_data(static_x.shape, batch.dtype, g)
    if form == "padded":
        seqs = [new[i][batch.mask[i]] for i in range(len(lengths))]
    else:
        seqs = list(new.split(lengths))
    static_x.copy_(new)
    poison_(packed)
    poison_(pos)
    graph.replay()
    torch.cuda.synchronize()
    expected, expected_pos = ref_pack(
        seqs, cu_padded, cp, rank, cp_layout, True, feature_shape=(5,), dtype=batch.dtype
    )
    assert_same(packed, expected)
    assert_same(pos, expected_pos)
    eager = preprocess_thd(x, layout, rank, attention_mask=mask, roll=True)
    assert_same(packed, eager[0].cpu())

    # Unpack captured the same way: all shards in, the batch out (zeros where the mask is false).
    shards = pack_all_ranks(x, layout, mask)
    static_shards = torch.zeros_like(shards)
    out_mask = mask if form == "padded" else None
    for _ in range(2):
        postprocess_thd(static_shards, layout, attention_mask=out_mask, as_nested=False, validate=False)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = postprocess_thd(static_shards, layout, attention_mask=out_mask, as_nested=False, validate=False)
    static_shards.copy_(shards)
    poison_(out)
    graph.replay()
    torch.cuda.synchronize()
    if form == "padded":
        expected = torch.zeros_like(new)
        expected[batch.mask] = new[batch.mask]
    else:
        expected = new
    assert_same(out, expected)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "feature_shape, dtype, max_len",
    [
        ((4096,), torch.bfloat16, 2000),
        ((), torch.int64, 2000),
        ((48, 8), torch.int16, 1000),
        ((3,), torch.uint8, 2000),
    ],
    ids=["hidden-bf16", "ids-int64", "router-int16", "odd-uint8"],
)
def test_cuda_matches_cpu_large(rng, feature_shape, dtype, max_len):
    lengths = [rng.randint(0, max_len) for _ in range(64)]
    g = torch.Generator().manual_seed(seed_of(rng))
    values = random_data((sum(lengths), *feature_shape), dtype, g)
    values_gpu = values.cuda()
    configs = [("zigzag", 2, True, True), ("contiguous", 4, False, False), ("zigzag", 1, False, True)]
    if feature_shape != (4096,):
        configs += [("zigzag", 4, True, False), ("contiguous", 2, True, True)]
    for cp_layout, cp, fp8, roll in configs:
        layout = ThdLayout.from_lengths(lengths, tp_size=2, cp_size=cp, cp_layout=cp_layout, fp8_padding=fp8)
        args = (layout.local_rows, cp, -1, CP_LAYOUT_CODES[cp_layout], roll, None)
        poison_allocator("cuda", values[:1].nbytes * layout.total_padded, 8 * layout.total_padded)
        cu, cup = layout.cu_seqlens.cuda(), layout.cu_seqlens_padded.cuda()
        packed, pos = OPS.preprocess_thd(values_gpu, cu, cup, *args)
        cpu_packed, cpu_pos = OPS.preprocess_thd(values, layout.cu_seqlens, layout.cu_seqlens_padded, *args)
        assert_same(packed, cpu_packed, (cp_layout, cp))
        assert_same(pos, cpu_pos, (cp_layout, cp))
        poison_allocator("cuda", values.nbytes)
        out = OPS.postprocess_thd(
            packed, layout.cu_seqlens.cuda(), layout.cu_seqlens_padded.cuda(), layout.total_tokens, cp, -1,
            CP_LAYOUT_CODES[cp_layout], roll, None,
        )
        assert_same(out, dropped_as_zero(values, layout, lengths, cp, cp_layout, roll), (cp_layout, cp))
        del packed, pos, out
    if feature_shape == (4096,):
        return
    # Padded input with a scattered mask, one rank at a time.
    S = max(lengths) + 3
    mask = scattered_mask(rng, lengths, S)
    padded = random_data((64, S, *feature_shape), dtype, g)
    layout = ThdLayout.from_lengths(lengths, cp_size=2, fp8_padding=True)
    for r in range(2):
        poison_allocator("cuda", padded[0, :1].nbytes * layout.local_rows, 8 * layout.local_rows)
        got = preprocess_thd(padded.cuda(), layout, r, attention_mask=mask.cuda(), roll=True)
        want = preprocess_thd(padded, layout, r, attention_mask=mask, roll=True)
        assert_same(got[0], want[0])
        assert_same(got[1], want[1])
    packed = torch.stack([preprocess_thd(padded, layout, r, attention_mask=mask)[0] for r in range(2)])
    poison_allocator("cuda", padded.nbytes)
    got = postprocess_thd(packed.cuda(), layout, attention_mask=mask.cuda())
    assert_same(got, postprocess_thd(packed, layout, attention_mask=mask))


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1000, 6000])
def test_cuda_matches_cpu_many_sequences(rng, batch):
    """Many short sequences with narrow rows (ids, [T, 1] log-probs), whose tiles grow to several
    rows per thread: pack and unpack under several rules, against the CPU kernels."""
    lengths = [rng.choice([0, 1, 2, 3, 7, 40]) for _ in range(batch)]
    g = torch.Generator().manual_seed(seed_of(rng))
    for feature_shape, dtype in (((), torch.int64), ((1,), torch.float32)):
        values = random_data((sum(lengths), *feature_shape), dtype, g)
        values_gpu = values.cuda()
        for cp_layout, cp, fp8, roll in [("zigzag", 1, False, True), ("zigzag", 4, True, True), ("contiguous", 2, False, False)]:
            layout = ThdLayout.from_lengths(lengths, cp_size=cp, cp_layout=cp_layout, fp8_padding=fp8)
            args = (layout.local_rows, cp, -1, CP_LAYOUT_CODES[cp_layout], roll, None)
            cu, cup = layout.cu_seqlens.cuda(), layout.cu_seqlens_padded.cuda()
            packed, pos = OPS.preprocess_thd(values_gpu, cu, cup, *args)
            cpu_packed, cpu_pos = OPS.preprocess_thd(values, layout.cu_seqlens, layout.cu_seqlens_padded, *args)
            assert_same(packed, cpu_packed, (batch, cp_layout, cp))
            assert_same(pos, cpu_pos, (batch, cp_layout, cp))
            out = OPS.postprocess_thd(packed, cu, cup, layout.total_tokens, cp, -1, CP_LAYOUT_CODES[cp_layout], roll, None)
            assert_same(out, dropped_as_zero(values, layout, lengths, cp, cp_layout, roll), (batch, cp_layout, cp))


@pytest.mark.gpu
def test_cuda_garbage_offsets_do_not_fault():
    """docs/ops.md#validation: never a crash or an out-of-bounds access, even with offsets the CUDA path
    cannot check without a host synchronisation. The result is unspecified; the device must stay
    healthy."""
    values = torch.randn(10, 4, device="cuda")
    packed = torch.randn(2, 6, 4, device="cuda")
    mask = torch.ones(3, 4, dtype=torch.bool, device="cuda")
    for cu, cu_padded in [
        ([0, 7, 3, 10], [0, 4, 8, 12]),  # non-monotone
        ([0, 5, 900, 10], [0, 4, 8, 12]),  # out of range
        ([0, 5, 8, 10], [0, 2, 4, 12]),  # padded shorter than valid
        ([0, 5, 8, 10], [0, 8, 3, 12]),  # padded non-monotone
        ([0, 5, 8, -4], [0, 4, 8, -12]),  # negative
    ]:
        cu = torch.tensor(cu, dtype=torch.int32, device="cuda")
        cu_padded = torch.tensor(cu_padded, dtype=torch.int32, device="cuda")
        for lay in ("zigzag", "contiguous"):
            for rank in (-1, 0, 1):
                OPS.preprocess_thd(values, cu, cu_padded, 6, 2, rank, CP_LAYOUT_CODES[lay], True, None)
                padded = values[:3, None].expand(3, 4, 4)
                OPS.preprocess_thd(padded, cu, cu_padded, 6, 2, rank, CP_LAYOUT_CODES[lay], True, mask)
                p = packed if rank < 0 else packed[0]
                OPS.postprocess_thd(p, cu, cu_padded, 10, 2, rank, CP_LAYOUT_CODES[lay], True, None)
                OPS.postprocess_thd(p, cu, cu_padded, 10, 2, rank, CP_LAYOUT_CODES[lay], True, mask)
    torch.cuda.synchronize()
    assert torch.equal(torch.ones(3, device="cuda").cpu(), torch.ones(3))


# --------------------------------------------------------------------------------------------
# Bad input (docs/ops.md#errors): a clear RuntimeError / ValueError naming the op and the argument.


def bad_case():
    rng = random.Random(7)
    lengths = [3, 0, 5, 2]
    batch = Batch(rng, lengths, (2,), torch.float32)
    layout = ThdLayout.from_lengths(lengths, cp_size=2)
    return batch, layout


ERRORS = (RuntimeError, ValueError)


def test_bad_input_python_preprocess(device):
    batch, layout = bad_case()
    values, x, mask = batch.values.to(device), batch.padded.to(device), batch.mask.to(device)
    op = "preprocess_thd"
    with pytest.raises(ERRORS, match=rf"{op}.*(values|\bx\b)"):
        preprocess_thd(values[:-1], layout, 0)  # rows != total_tokens
    with pytest.raises(ERRORS, match=rf"{op}.*(values|\bx\b)"):
        preprocess_thd(torch.cat([values, values[:1]]), layout, 0)
    with pytest.raises(ERRORS, match=rf"{op}.*attention_mask"):
        preprocess_thd(x, layout, 0, attention_mask=mask.int())  # not bool
    bad_mask = mask.clone()
    bad_mask[2, bad_mask[2].nonzero()[0]] = False  # row 2 has one token fewer than the layout says
    with pytest.raises(ERRORS, match=rf"{op}.*attention_mask"):
        preprocess_thd(x, layout, 0, attention_mask=bad_mask)
    more_mask = mask.clone()
    more_mask[1, 0] = True  # row 1 (length 0) gains a token
    with pytest.raises(ERRORS, match=rf"{op}.*attention_mask"):
        preprocess_thd(x, layout, 0, attention_mask=more_mask)
    with pytest.raises(ERRORS, match=rf"{op}.*attention_mask"):
        preprocess_thd(x[:3], layout, 0, attention_mask=mask[:3])  # 3 rows, 4 sequences
    with pytest.raises(ERRORS, match=rf"{op}.*(\bx\b|attention_mask)"):
        preprocess_thd(x[:, :-1], layout, 0, attention_mask=mask)  # x and mask disagree on S
    for rank in (-1, 2, 5, True, 1.0, None):
        with pytest.raises(ERRORS, match=rf"{op}.*cp_rank"):
            preprocess_thd(values, layout, rank)
    nt = batch.nested(device)
    with pytest.raises(ERRORS, match=rf"{op}.*attention_mask"):
        preprocess_thd(nt, layout, 0, attention_mask=mask)
    # Same total, different split: offsets [0, 3, 1, 8, 10] -> [0, 4, 4, 8, 10].
    other = torch.nested.nested_tensor_from_jagged(values, torch.tensor([0, 4, 4, 8, 10], device=device))
    with pytest.raises(ERRORS, match=rf"{op}.*offsets"):
        preprocess_thd(other, layout, 0)
    fewer = torch.nested.nested_tensor_from_jagged(values, torch.tensor([0, 3, 8, 10], device=device))
    with pytest.raises(ERRORS, match=rf"{op}.*(\bx\b|sequences|offsets)"):
        preprocess_thd(fewer, layout, 0)
    holes = torch.nested.nested_tensor_from_jagged(
        values, batch.offsets.to(device), lengths=torch.tensor([2, 0, 5, 2], device=device)
    )
    with pytest.raises(ERRORS, match=rf"{op}.*\bx\b"):
        preprocess_thd(holes, layout, 0)


def test_bad_layout_argument():
    batch, _ = bad_case()
    for bad in (None, {"cp_size": 2}, (torch.tensor([0, 3]), torch.tensor([0, 4]))):
        with pytest.raises((TypeError, ValueError), match="preprocess_thd.*layout"):
            preprocess_thd(batch.values, bad, 0)
        with pytest.raises((TypeError, ValueError), match="postprocess_thd.*layout"):
            postprocess_thd(batch.values, bad, 0)


def test_bad_input_python_postprocess(device):
    batch, layout = bad_case()
    mask = batch.mask.to(device)
    packed = torch.stack([preprocess_thd(batch.values, layout, r)[0] for r in range(2)]).to(device)
    op = "postprocess_thd"
    with pytest.raises(ERRORS, match=rf"{op}.*packed"):
        postprocess_thd(packed[0], layout)  # one shard where cp_size=2 needs all of them
    with pytest.raises(ERRORS, match=rf"{op}.*packed"):
        postprocess_thd(torch.cat([packed, packed[:1]]), layout)  # 3 shards
    with pytest.raises(ERRORS, match=rf"{op}.*packed"):
        postprocess_thd(packed[:, :-2], layout)  # too few rows
    layout1 = ThdLayout.from_lengths(batch.lengths)
    with pytest.raises(ERRORS, match=rf"{op}.*packed"):
        postprocess_thd(packed.reshape(-1, 2)[:-1], layout1)
    for rank in (-1, 2, True):
        with pytest.raises(ERRORS, match=rf"{op}.*cp_rank"):
            postprocess_thd(packed, layout, rank)
    with pytest.raises(ERRORS, match=rf"{op}.*attention_mask"):
        postprocess_thd(packed, layout, attention_mask=mask.to(torch.uint8))
    bad_mask = mask.clone()
    bad_mask[0] = False
    with pytest.raises(ERRORS, match=rf"{op}.*attention_mask"):
        postprocess_thd(packed, layout, attention_mask=bad_mask)


_BATCH, _LAYOUT = bad_case()
_V, _X, _M = _BATCH.values, _BATCH.padded, _BATCH.mask
_CU, _CUP = _LAYOUT.cu_seqlens, _LAYOUT.cu_seqlens_padded
_LR, _T = _LAYOUT.local_rows, _LAYOUT.total_tokens  # lengths [3, 0, 5, 2], padded [4, 0, 8, 4], cp=2


def _i32(*xs):
    return torch.tensor(xs, dtype=torch.int32)


RAW_PACK_CASES = {
    "cu_seqlens-int64": (dict(cu=_CU.long()), "cu_seqlens"),
    "cu_seqlens_padded-int64": (dict(cup=_CUP.long()), "cu_seqlens_padded"),
    "cu_seqlens-2d": (dict(cu=_CU[None]), "cu_seqlens"),
    "cu_seqlens_padded-2d": (dict(cup=_CUP[None]), "cu_seqlens_padded"),
    "cu_seqlens-empty": (dict(cu=_CU[:0]), "cu_seqlens"),
    "cu_seqlens-non-monotone": (dict(cu=_i32(0, 3, 1, 8, 10)), "cu_seqlens"),
    "cu_seqlens-not-from-0": (dict(cu=_i32(1, 3, 3, 8, 10)), "cu_seqlens"),
    "cu_seqlens-past-the-data": (dict(cu=_i32(0, 3, 3, 8, 11)), r"(cu_seqlens|values)"),
    "cu_seqlens-length-mismatch": (dict(cu=_CU[:-1]), "cu_seqlens"),
    "cu_seqlens_padded-short-sequence": (dict(cup=_i32(0, 4, 4, 8, 12), lr=6), "cu_seqlens_padded"),
    "cu_seqlens_padded-non-monotone": (dict(cup=_i32(0, 4, 0, 8, 12), lr=6), "cu_seqlens_padded"),
    "cu_seqlens_padded-not-zigzag": (
        dict(cup=_i32(0, 6, 6, 12, 16), lr=8),
        r"(cu_seqlens_padded|padded length)",
    ),
    "local_rows-too-big": (dict(lr=_LR + 1), r"(cu_seqlens_padded|local_rows)"),
    "local_rows-too-small": (dict(lr=_LR - 1), r"(cu_seqlens_padded|local_rows)"),
    "local_rows-negative": (dict(lr=-1), "local_rows"),
    "values-too-few-rows": (dict(values=_V[:-1]), "values"),
    "values-too-many-rows": (dict(values=torch.cat([_V, _V[:1]])), "values"),
    "values-0d": (dict(values=torch.tensor(1.0)), "values"),
    "attention_mask-int": (dict(values=_X, mask=_M.int()), "attention_mask"),
    "attention_mask-rows": (dict(values=_X, mask=_M[:3]), "attention_mask"),
    "attention_mask-columns": (dict(values=_X, mask=_M[:, :-1]), r"(attention_mask|values|padded)"),
    "attention_mask-1d": (dict(values=_X, mask=_M[0]), "attention_mask"),
    "attention_mask-counts": (dict(values=_X, mask=~_M), "attention_mask"),
    # S = 0: no mask row can hold the layout's 3, 5 and 2 tokens.
    "attention_mask-empty-rows": (dict(values=_X[:, :0], mask=_M[:, :0]), "attention_mask"),
    "cp_rank-too-big": (dict(rank=2), "cp_rank"),
    "cp_rank-below-minus-1": (dict(rank=-2), "cp_rank"),
    "cp_size-0": (dict(cp=0, rank=0), "cp_size"),
    "cp_layout-typo": (dict(lay="zigzg"), "cp_layout"),
    "cp_layout-empty": (dict(lay=""), "cp_layout"),
}


def test_raw_pack_baseline():
    """The unmodified arguments of the raw battery are accepted."""
    OPS.preprocess_thd(_V, _CU, _CUP, _LR, 2, 0, 0, False, None)
    OPS.preprocess_thd(_X, _CU, _CUP, _LR, 2, -1, 0, True, _M)
    OPS.postprocess_thd(torch.randn(2, _LR, 2), _CU, _CUP, _T, 2, -1, 0, False, None)
    OPS.postprocess_thd(torch.randn(_LR, 2), _CU, _CUP, _T, 2, 1, 0, True, _M)


@pytest.mark.parametrize("case", RAW_PACK_CASES)
def test_bad_input_raw_preprocess(case):
    kw, match = RAW_PACK_CASES[case]
    args = dict(values=_V, cu=_CU, cup=_CUP, lr=_LR, cp=2, rank=0, lay="zigzag", roll=False, mask=None)
    args.update(kw)
    with pytest.raises(ERRORS, match=rf"preprocess_thd.*{match}"):
        OPS.preprocess_thd(*args.values())


_ROWS = r"(cu_seqlens_padded|local_rows|packed)"
RAW_UNPACK_CASES = {
    "packed-3-shards": (dict(packed=torch.randn(3, _LR, 2)), "packed"),
    "packed-1d-all-ranks": (dict(packed=torch.randn(2 * _LR)), "packed"),
    "packed-too-many-rows": (dict(packed=torch.randn(2, _LR + 1, 2)), _ROWS),
    "packed-too-few-rows": (dict(packed=torch.randn(_LR - 1, 2), rank=0), _ROWS),
    "total_tokens-wrong": (dict(T=_T + 1), "total_tokens"),
    "total_tokens-negative": (dict(T=-1), "total_tokens"),
    "cu_seqlens-int64": (dict(cu=_CU.long()), "cu_seqlens"),
    "cu_seqlens_padded-float": (dict(cup=_CUP.double()), "cu_seqlens_padded"),
    "cu_seqlens-2d": (dict(cu=_CU[None]), "cu_seqlens"),
    "cu_seqlens-non-monotone": (dict(cu=_i32(0, 3, 1, 8, 10)), "cu_seqlens"),
    "cu_seqlens_padded-short-sequence": (dict(cup=_i32(0, 4, 4, 8, 16)), "cu_seqlens_padded"),
    "attention_mask-int": (dict(mask=_M.int()), "attention_mask"),
    "attention_mask-rows": (dict(mask=_M[:2]), "attention_mask"),
    "attention_mask-counts": (dict(mask=~_M), "attention_mask"),
    "attention_mask-empty-rows": (dict(mask=_M[:, :0]), "attention_mask"),
    "cp_rank-too-big": (dict(rank=2), "cp_rank"),
    "cp_rank-below-minus-1": (dict(rank=-2), "cp_rank"),
    "cp_layout-typo": (dict(lay="Zigzag"), "cp_layout"),
}


@pytest.mark.parametrize("case", RAW_UNPACK_CASES)
def test_bad_input_raw_postprocess(case):
    kw, match = RAW_UNPACK_CASES[case]
    args = dict(packed=torch.randn(2, _LR, 2), cu=_CU, cup=_CUP, T=_T, cp=2, rank=-1, lay="zigzag")
    args.update(roll=False, mask=None)
    args.update(kw)
    with pytest.raises(ERRORS, match=rf"postprocess_thd.*{match}"):
        OPS.postprocess_thd(*args.values())


@pytest.mark.gpu
def test_bad_input_device_mix():
    batch, layout = bad_case()
    v, x, m = batch.values.cuda(), batch.padded.cuda(), batch.mask
    cu, cup = layout.cu_seqlens, layout.cu_seqlens_padded
    lr, T = layout.local_rows, layout.total_tokens
    with pytest.raises(ERRORS, match="preprocess_thd.*cu_seqlens"):
        OPS.preprocess_thd(v, cu, cup.cuda(), lr, 2, 0, 0, False, None)
    with pytest.raises(ERRORS, match="preprocess_thd.*cu_seqlens_padded"):
        OPS.preprocess_thd(v, cu.cuda(), cup, lr, 2, 0, 0, False, None)
    with pytest.raises(ERRORS, match="preprocess_thd.*attention_mask"):
        OPS.preprocess_thd(x, cu.cuda(), cup.cuda(), lr, 2, 0, 0, False, m)
    with pytest.raises(ERRORS, match="preprocess_thd.*attention_mask"):
        preprocess_thd(x, layout, 0, attention_mask=m)
    packed = torch.randn(2, lr, 2, device="cuda")
    with pytest.raises(ERRORS, match="postprocess_thd.*cu_seqlens"):
        OPS.postprocess_thd(packed, cu, cup.cuda(), T, 2, -1, 0, False, None)
    with pytest.raises(ERRORS, match="postprocess_thd.*attention_mask"):
        OPS.postprocess_thd(packed, cu.cuda(), cup.cuda(), T, 2, -1, 0, False, m)
    with pytest.raises(ERRORS, match="postprocess_thd.*attention_mask"):
        postprocess_thd(packed, layout, attention_mask=m)
    with pytest.raises(ERRORS, match="thd_layout"):  # a host op: no CUDA kernel
        OPS.thd_layout(torch.tensor([3, 1], device="cuda"))


@pytest.mark.gpu
def test_cuda_kernels_built():
    """With a GPU present, the extension must have been built with its CUDA kernels."""
    assert verl_ops.cuda_available()
