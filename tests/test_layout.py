"""ThdLayout.from_lengths against the docs/layout.md#rules reference."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys

import pytest
import torch
from conftest import build_layout, random_lengths
from reference import layout_is_valid, ref_layout

from verl_ops import ThdLayout

CP_LAYOUTS = ["zigzag", "contiguous"]


def check_against_reference(lengths, tp, cp, cp_layout, fp8, mlr, bucket):
    """Build the layout and compare every field with the reference; or, where the reference result
    breaks an invariant the kernels rely on, check that the layout is rejected."""
    args = (tp, cp, cp_layout, fp8, mlr, bucket)
    try:
        ref = ref_layout(lengths, *args)
    except ValueError:
        ref = None
    if ref is None or not layout_is_valid(ref[1], cp, cp_layout):
        with pytest.raises((ValueError, RuntimeError)):
            build_layout(lengths, *args)
        return False
    cu, cu_padded = ref
    layout = build_layout(lengths, *args)
    ctx = f"lengths={lengths} args={args}"
    for name in ("cu_seqlens", "cu_seqlens_padded", "cu_seqlens_cpu", "cu_seqlens_padded_cpu"):
        t = getattr(layout, name)
        assert t.dtype == torch.int32, (name, ctx)
        assert t.device.type == "cpu", (name, ctx)
    assert layout.cu_seqlens.tolist() == cu, ctx
    assert layout.cu_seqlens_padded.tolist() == cu_padded, ctx
    assert layout.cu_seqlens_cpu.tolist() == cu, ctx
    assert layout.cu_seqlens_padded_cpu.tolist() == cu_padded, ctx
    padded = [b - a for a, b in zip(cu_padded[:-1], cu_padded[1:])]
    assert layout.seqlens_padded == padded, ctx
    assert layout.max_seqlen == max(padded, default=0), ctx
    assert layout.max_seqlen_unpadded == max(lengths, default=0), ctx
    assert layout.total_tokens == cu[-1] == sum(lengths), ctx
    assert layout.total_padded == cu_padded[-1], ctx
    assert layout.local_rows * cp == cu_padded[-1], ctx
    assert list(layout.lengths) == list(lengths), ctx
    assert layout.batch_size == len(lengths)
    assert (layout.tp_size, layout.cp_size, layout.cp_layout) == (tp, cp, cp_layout)
    align = tp * cp * (2 if (cp_layout == "zigzag" and cp > 1) else 1)
    assert layout.align == (math.lcm(16, align) if fp8 else align), ctx
    return True


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("cp_layout", CP_LAYOUTS)
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("tp", [1, 2])
def test_from_lengths_matches_reference(rng, tp, cp, cp_layout, fp8):
    factor = 2 if (cp_layout == "zigzag" and cp > 1) else 1
    align = tp * cp * factor
    built = rejected = 0
    for _ in range(15):
        lengths = random_lengths(rng, rng.randint(1, 12), align)
        total = sum(lengths)
        # min_local_rows: unset, 0, below and above what the batch already has, and ones that
        # break the zigzag invariant; buckets: unset, 1, odd, multiples of the alignment.
        base = ref_layout(lengths, tp, cp, cp_layout, fp8)[1][-1]  # the total before rules 5 and 6
        mlrs = [None, 0, 1, total // cp + rng.randint(1, 50), base // cp + rng.randint(1, 50),
                tp * factor * rng.randint(1, 100)]
        buckets = [None, 1, rng.choice([3, 5, 7]), 2 * tp * cp * rng.randint(1, 20), rng.randint(2, 300)]
        for mlr, bucket in itertools.product(mlrs, buckets):
            if check_against_reference(lengths, tp, cp, cp_layout, fp8, mlr, bucket):
                built += 1
            else:
                rejected += 1
    assert built > 0
    # Only zigzag with cp > 1 has an invariant the padding rules can break (total % cp == 0 always
    # holds: every rule pads to a multiple of cp).
    if cp_layout == "zigzag" and cp > 1:
        assert rejected > 0
    else:
        assert rejected == 0


def test_rejection_happens(rng):
    """The rejection branch of the property test is exercised by real cases (zigzag only)."""
    # cp=2 zigzag: align 4; min_local_rows=3 pads the total to 6 -> the last sequence gets 6 rows.
    assert not layout_is_valid(ref_layout([3], 1, 2, "zigzag", False, 3, None)[1], 2, "zigzag")
    with pytest.raises((ValueError, RuntimeError), match="zigzag"):
        ThdLayout.from_lengths([3], cp_size=2, min_local_rows=3)
    with pytest.raises((ValueError, RuntimeError), match="zigzag"):
        ThdLayout.from_lengths([5, 1, 1], cp_size=2, pad_to_length_bucket=3)
    # The same paddings are fine for the contiguous layout.
    assert ThdLayout.from_lengths([3], cp_size=2, cp_layout="contiguous", min_local_rows=3).total_padded == 6
    contiguous = ThdLayout.from_lengths([5, 1, 1], cp_size=2, cp_layout="contiguous", pad_to_length_bucket=3)
    assert contiguous.total_padded == 12


@pytest.mark.parametrize(
    "lengths, kw, cu_padded",
    [
        # Rule 1: zigzag doubles the alignment only when cp > 1.
        ([5, 1, 0, 8], dict(tp_size=2, cp_size=1), [0, 6, 8, 8, 16]),
        ([5, 1, 0, 8], dict(tp_size=1, cp_size=2), [0, 8, 12, 12, 20]),
        ([5, 1, 0, 8], dict(tp_size=1, cp_size=2, cp_layout="contiguous"), [0, 6, 8, 8, 16]),
        # Rules 2 + 4: FP8 aligns every sequence to lcm(16, align) and the total to align * 128.
        ([5, 17], dict(fp8_padding=True), [0, 16, 128]),
        ([5, 17], dict(cp_size=2, fp8_padding=True), [0, 16, 512]),
        # Rule 5: min_local_rows pads the last sequence up to cp * m.
        ([3, 1], dict(cp_size=2, min_local_rows=8), [0, 4, 16]),
        ([3, 1], dict(cp_size=2, min_local_rows=2), [0, 4, 8]),
        # Rule 6: bucket multiple of lcm(b, cp).
        ([3, 1], dict(cp_size=2, pad_to_length_bucket=12), [0, 4, 12]),
        ([3, 1], dict(cp_size=2, cp_layout="contiguous", pad_to_length_bucket=5), [0, 4, 10]),
    ],
)
def test_worked_examples(lengths, kw, cu_padded):
    """Hand-computed layouts, so the reference itself is checked against docs/layout.md#rules."""
    args = (
        kw.get("tp_size", 1),
        kw.get("cp_size", 1),
        kw.get("cp_layout", "zigzag"),
        kw.get("fp8_padding", False),
        kw.get("min_local_rows"),
        kw.get("pad_to_length_bucket"),
    )
    assert ref_layout(lengths, *args)[1] == cu_padded
    layout = ThdLayout.from_lengths(lengths, **kw)
    assert layout.cu_seqlens_padded.tolist() == cu_padded
    assert layout.max_seqlen == max(b - a for a, b in zip(cu_padded[:-1], cu_padded[1:]))


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("bucket", [None, 8])
def test_empty_batch(fp8, bucket):
    layout = ThdLayout.from_lengths([], cp_size=2, fp8_padding=fp8, pad_to_length_bucket=bucket)
    assert layout.cu_seqlens.tolist() == [0]
    assert layout.cu_seqlens_padded.tolist() == [0]
    assert (layout.max_seqlen, layout.total_tokens, layout.total_padded, layout.local_rows) == (0, 0, 0, 0)
    # min_local_rows cannot pad a last sequence that does not exist.
    with pytest.raises((ValueError, RuntimeError), match="min_local_rows"):
        ThdLayout.from_lengths([], cp_size=2, min_local_rows=4)


def test_all_zero_lengths():
    layout = ThdLayout.from_lengths([0, 0, 0], cp_size=2, min_local_rows=4)
    assert layout.cu_seqlens_padded.tolist() == [0, 0, 0, 8]
    assert layout.local_rows == 4


@pytest.mark.parametrize(
    "as_input",
    [
        list,
        lambda x: torch.tensor(x, dtype=torch.int32),
        lambda x: torch.tensor(x, dtype=torch.int64),
        lambda x: torch.tensor(x, dtype=torch.int16),
        tuple,
    ],
    ids=["list", "int32", "int64", "int16", "tuple"],
)
def test_lengths_forms(rng, as_input):
    lengths = random_lengths(rng, 9, 8)
    kw = dict(tp_size=2, cp_size=2, fp8_padding=True, min_local_rows=300)
    expected = ThdLayout.from_lengths(list(lengths), **kw)
    layout = ThdLayout.from_lengths(as_input(lengths), **kw)
    assert layout.same_as(expected)
    assert layout.lengths == tuple(lengths)
    assert all(type(n) is int for n in layout.lengths)
    assert layout.cu_seqlens.device.type == "cpu"
    assert layout.cu_seqlens.dtype == torch.int32


def test_int32_overflow_is_rejected():
    with pytest.raises((ValueError, RuntimeError), match="int32"):
        ThdLayout.from_lengths([2**30, 2**30, 5])


@pytest.mark.parametrize(
    "kw",
    [
        dict(cp_size=4, min_local_rows=2**62),  # cp * m = 2**64
        dict(tp_size=3, cp_size=2**62, cp_layout="contiguous"),  # align = 3 * 2**62
        dict(cp_size=2, pad_to_length_bucket=2**63 - 1),  # lcm(b, cp) = 2**64 - 2
        dict(tp_size=2**20, cp_size=2**20),  # align = 2**41: fits int64, not int32
    ],
    ids=["min_local_rows", "tp_cp_product", "bucket", "align_2_41"],
)
def test_huge_arguments_are_rejected(kw):
    """Sizes whose padded total is far beyond the int32 offsets must be rejected, like any other
    total that does not fit (the reference gives totals >= 2**41 for all of these)."""
    cu_padded = ref_layout([5, 3], kw.get("tp_size", 1), kw["cp_size"], kw.get("cp_layout", "zigzag"), False,
                           kw.get("min_local_rows"), kw.get("pad_to_length_bucket"))[1]
    assert cu_padded[-1] >= 2**41
    with pytest.raises((ValueError, RuntimeError)):
        ThdLayout.from_lengths([5, 3], **kw)


def test_huge_alignment_does_not_crash():
    """tp * cp * 2 = 2**71 wraps to 0 in int64; the process must get an error, not die (SIGFPE from
    a division by zero). Runs in a subprocess so that a crash cannot take the test session down."""
    code = (
        "import verl_ops\n"
        "try:\n"
        "    l = verl_ops.ThdLayout.from_lengths([5, 3], tp_size=2**40, cp_size=2**30)\n"
        "except (ValueError, RuntimeError) as e:\n"
        "    print('raised:', e)\n"
        "else:\n"
        "    print('built:', l.cu_seqlens_padded.tolist())\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"the process died with return code {r.returncode}: {r.stderr[-2000:]}"
    assert r.stdout.startswith("raised:"), r.stdout


@pytest.mark.gpu
def test_lengths_on_cuda():
    lengths = [5, 0, 17, 3]
    layout = ThdLayout.from_lengths(torch.tensor(lengths, device="cuda"), cp_size=2)
    assert layout.cu_seqlens.device.type == "cuda"
    assert layout.cu_seqlens_padded.device.type == "cuda"
    assert layout.cu_seqlens_padded_cpu.device.type == "cpu"
    assert layout.cu_seqlens_padded.cpu().tolist() == ref_layout(lengths, 1, 2)[1]
    assert layout.to("cpu").same_as(layout)
    assert layout.to("cpu").cu_seqlens.device.type == "cpu"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lengths=[3, -1, 2]), "lengths"),
        (dict(lengths=torch.tensor([3, -1, 2])), "lengths"),
        (dict(lengths=[3, 1.5]), "lengths"),
        (dict(lengths=[3.0, 1.0]), "lengths"),
        (dict(lengths=torch.tensor([3.0, 1.0])), "lengths"),
        (dict(lengths=torch.tensor([True, False])), "lengths"),
        (dict(lengths=torch.tensor([[3, 1], [2, 2]])), "lengths"),
        (dict(lengths=torch.tensor(3)), "lengths"),
        (dict(lengths="abc"), "lengths"),
        (dict(lengths=[3, 1], tp_size=0), "tp_size"),
        (dict(lengths=[3, 1], tp_size=-2), "tp_size"),
        (dict(lengths=[3, 1], cp_size=0), "cp_size"),
        (dict(lengths=[3, 1], cp_size=-1), "cp_size"),
        (dict(lengths=[3, 1], cp_layout="zigzg"), "cp_layout"),
        (dict(lengths=[3, 1], cp_layout="ring"), "cp_layout"),
        (dict(lengths=[3, 1], pad_to_length_bucket=0), "pad_to_length_bucket"),
        (dict(lengths=[3, 1], pad_to_length_bucket=-4), "pad_to_length_bucket"),
        (dict(lengths=[3, 1], min_local_rows=-1), "min_local_rows"),
    ],
)
def test_bad_input(kwargs, match):
    kwargs = dict(kwargs)
    lengths = kwargs.pop("lengths")
    with pytest.raises((ValueError, RuntimeError), match=match):
        ThdLayout.from_lengths(lengths, **kwargs)


@pytest.mark.parametrize(
    "args, match",
    [
        ((torch.tensor([3, -1]),), "lengths"),
        ((torch.tensor([[3, 1]]),), "lengths"),
        ((torch.tensor([3.0, 1.0]),), "lengths"),
        ((torch.tensor([3, 1]), 0), "tp_size"),
        ((torch.tensor([3, 1]), 1, 0), "cp_size"),
        ((torch.tensor([3, 1]), 1, 2, "zz"), "cp_layout"),
        ((torch.tensor([3, 1]), 1, 2, "zigzag", False, -1), "min_local_rows"),
        ((torch.tensor([3, 1]), 1, 2, "zigzag", False, None, 0), "pad_to_length_bucket"),
    ],
)
def test_raw_thd_layout_bad_input(args, match):
    with pytest.raises(RuntimeError, match=f"thd_layout.*{match}"):
        torch.ops.verl_ops.thd_layout(*args)


# --------------------------------------------------------------------------------------------
# from_padded_offsets: a layout from offsets built elsewhere.


@pytest.mark.parametrize("cp_layout", CP_LAYOUTS)
@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("fp8", [False, True])
def test_from_padded_offsets_reproduces_from_lengths(rng, cp_layout, cp, fp8):
    lengths = random_lengths(rng, 9, 2 * cp * 2)
    want = build_layout(lengths, 2, cp, cp_layout, fp8)
    got = ThdLayout.from_padded_offsets(
        torch.tensor(lengths), want.cu_seqlens_padded.clone(), tp_size=2, cp_size=cp, cp_layout=cp_layout
    )
    assert got.same_as(want)
    for name in ("lengths", "max_seqlen", "max_seqlen_unpadded", "min_seqlen_unpadded", "total_tokens",
                 "total_padded", "local_rows", "cp_size", "cp_layout", "tp_size"):
        assert getattr(got, name) == getattr(want, name), name
    assert got.cu_seqlens.dtype == got.cu_seqlens_padded.dtype == torch.int32
    assert torch.equal(got.cu_seqlens, want.cu_seqlens)


@pytest.mark.parametrize(
    "lengths, cu_padded, kw, match",
    [
        ([3, 1], [0, 4], {}, "entries"),
        ([3, 1], [1, 4, 8], {}, "cu_seqlens_padded must start at 0, got 1"),
        ([3, 5], [0, 4, 8], {}, "does not fit"),
        ([3, 1], [0, 4, 7], dict(cp_size=2, cp_layout="contiguous"), "divisible"),
        ([3, 1], [0, 6, 8], dict(cp_size=2), "multiple of 4"),
        ([3, -1], [0, 4, 8], {}, "lengths"),
        ([3, 1], [[0, 4, 8]], {}, "1-D"),
        ([3, 1], [0.0, 4.0, 8.0], {}, "integers"),
        ([3, 1], [0, 4, 8], dict(cp_layout="ring"), "cp_layout"),
        ([3, 1], [0, 4, 8], dict(tp_size=0), "tp_size"),
    ],
)
def test_from_padded_offsets_bad_input(lengths, cu_padded, kw, match):
    with pytest.raises(ValueError, match=f"from_padded_offsets.*{match}"):
        ThdLayout.from_padded_offsets(lengths, torch.tensor(cu_padded), **kw)


def test_to_device_keeps_everything_but_the_device():
    layout = build_layout([5, 0, 7], 1, 2, "zigzag", True)
    moved = layout.to("meta")
    assert moved.device == torch.device("meta") and moved.cu_seqlens.device == torch.device("meta")
    assert moved.same_as(layout) and moved.lengths == layout.lengths and moved.local_rows == layout.local_rows
    assert layout.to("cpu") is layout


def test_layout_from_the_layout_op_sets_every_field():
    """Layouts built by the layout op (from_lengths / from_nested) set every dataclass field, the
    same values as a layout built field by field, and their lengths tuple on first use."""
    import dataclasses

    for build in (lambda: ThdLayout.from_lengths([5, 0, 9], tp_size=2, cp_size=2),
                  lambda: ThdLayout.from_nested(torch.nested.nested_tensor([torch.ones(5), torch.ones(0), torch.ones(9)],
                                                                           layout=torch.jagged), tp_size=2, cp_size=2)):
        lay = build()
        assert set(vars(lay)) == {f.name for f in dataclasses.fields(ThdLayout)}
        assert lay.lengths == (5, 0, 9) and lay.batch_size == 3
        copy = dataclasses.replace(lay)
        assert copy.lengths == (5, 0, 9) and copy.same_as(lay) and copy.local_rows == lay.local_rows
        assert "lengths=(5, 0, 9)" in repr(lay)
        with pytest.raises(dataclasses.FrozenInstanceError):
            lay.local_rows = 3
