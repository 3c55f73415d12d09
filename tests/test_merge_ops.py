"""dynamic_cp_merge's two steps as ops: dynamic_cp_merge_header and dynamic_cp_merge_index against
references written from their layouts (csrc/core/merge_layout.h), on every device; opcheck; the
CUDA kernels against the CPU ones on batches larger than one block's chunk."""

import random

import pytest
import torch

import verl_ops  # noqa: F401

ops = torch.ops.verl_ops
M = 9  # meta words + status word


def ref_header(lengths, ids, B, meta7):
    """[n, rows, dtype hash, feature hash, row bytes, key hash, B, local_cp_size, status 0],
    lengths padded with 0, ids padded with -1."""
    n = len(lengths)
    rows, dh, fh, rb, kh, cp = meta7
    return [n, rows, dh, fh, rb, kh, B, cp, 0] + list(lengths) + [0] * (B - n) + list(ids) + [-1] * (B - n)


def ref_index(hdr, B, validate):
    """The index buffer and offsets, from the definition in merge_layout.h (plain lists)."""
    G = len(hdr)
    meta_at = G + 2
    merged_at = meta_at + G * M
    src_at = merged_at + B + 1
    fill = -1 if validate else 0
    buf = [fill] * (src_at + B + 1)
    for g, row in enumerate(hdr):
        buf[meta_at + g * M : meta_at + (g + 1) * M] = row[:M]
    max_rows = max(row[1] for row in hdr)
    for g, row in enumerate(hdr):
        first = row[M - 1]  # the status word
        for k in range(B):
            length, sample = row[M + k], row[M + B + k]
            slot = sample if 0 <= sample < B else B
            buf[merged_at + slot] = length
            buf[src_at + slot] = g * max_rows + first
            first += length
        if validate:
            buf[g] = int(first == row[1])
    merged = buf[merged_at : merged_at + B]
    cu = [buf[merged_at - 1]]
    for length in merged:
        cu.append(cu[-1] + length)
    if B:
        if validate:
            buf[G], buf[G + 1] = min(merged), min(buf[src_at : src_at + B])
        else:
            buf[G] = sum(merged)
    return buf, cu


def random_headers(rng, G, B, *, lengths_max=50, drop=False, bad_rows=False):
    """G header rows over a random division of the samples 0..B-1 among G groups (each group's ids
    in any order); ``drop`` leaves one sample out, ``bad_rows`` breaks one group's row count."""
    samples = list(range(B))
    rng.shuffle(samples)
    if drop and samples:
        samples.pop()
    cuts = sorted(rng.randint(0, len(samples)) for _ in range(G - 1))
    parts = [samples[a:b] for a, b in zip([0, *cuts], [*cuts, len(samples)])]
    rows = []
    for g, ids in enumerate(parts):
        lengths = [rng.choice([0, 1, rng.randint(0, lengths_max)]) for _ in ids]
        total = sum(lengths) + (1 if bad_rows and g == 0 else 0)
        rows.append(ref_header(lengths, ids, B, (total, 11, 22, 4, 33, 1)))
    return rows


CASES = [(1, 0), (1, 1), (2, 0), (2, 5), (3, 17), (4, 40), (8, 64)]


@pytest.mark.parametrize("G, B", CASES)
@pytest.mark.parametrize("validate", [True, False])
def test_index_matches_reference(device, rng, G, B, validate):
    for kw in ({}, {"drop": True}, {"bad_rows": True}):
        hdr = random_headers(rng, G, B, **kw)
        buf, cu = ops.dynamic_cp_merge_index(torch.tensor(hdr, device=device), B, validate)
        want_buf, want_cu = ref_index(hdr, B, validate)
        assert buf.dtype == torch.int64 and cu.dtype == torch.int32
        assert buf.tolist() == want_buf, kw
        assert cu.tolist() == want_cu, kw


def test_index_flags_a_bad_header(rng):
    B = 12
    good = random_headers(rng, 3, B)
    buf, _ = ops.dynamic_cp_merge_index(torch.tensor(good), B, True)
    assert buf[:3].tolist() == [1, 1, 1] and min(buf[3:5].tolist()) >= 0
    buf, _ = ops.dynamic_cp_merge_index(torch.tensor(random_headers(rng, 3, B, bad_rows=True)), B, True)
    assert buf[0].item() == 0
    buf, _ = ops.dynamic_cp_merge_index(torch.tensor(random_headers(rng, 3, B, drop=True)), B, True)
    assert min(buf[3:5].tolist()) == -1


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("n, B", [(0, 0), (0, 3), (3, 3), (4, 9)])
def test_header_matches_reference(device, rng, dtype, n, B):
    lengths = [rng.randint(0, 99) for _ in range(n)]
    ids = rng.sample(range(B), n)
    meta7 = (sum(lengths), 123456789, 2**32 - 1, 12, 7, 4)
    out = ops.dynamic_cp_merge_header(
        torch.tensor(lengths, dtype=dtype, device=device), torch.tensor(ids, dtype=dtype, device=device),
        B, meta7[0], meta7[1], meta7[2], meta7[3], meta7[4], meta7[5],
    )
    assert out.dtype == torch.int64 and out.device.type == device
    assert out.tolist() == ref_header(lengths, ids, B, meta7)


def test_opcheck(device, rng):
    hdr = torch.tensor(random_headers(rng, 3, 10), device=device)
    torch.library.opcheck(ops.dynamic_cp_merge_index.default, (hdr, 10, True))
    torch.library.opcheck(ops.dynamic_cp_merge_index.default, (hdr, 10, False))
    lengths = torch.tensor([3, 0, 5], device=device)
    ids = torch.tensor([4, 0, 2], device=device)
    torch.library.opcheck(ops.dynamic_cp_merge_header.default, (lengths, ids, 6, 8, 1, 2, 4, 0, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("G, B", [(2, 511), (2, 512), (4, 1500), (8, 5000)])
def test_cuda_matches_cpu_large(G, B):
    rng = random.Random(G * 10007 + B)
    for validate in (True, False):
        for kw in ({}, {"drop": True}, {"bad_rows": True}):
            hdr = torch.tensor(random_headers(rng, G, B, lengths_max=5000, **kw))
            buf_c, cu_c = ops.dynamic_cp_merge_index(hdr, B, validate)
            buf_g, cu_g = ops.dynamic_cp_merge_index(hdr.cuda(), B, validate)
            assert torch.equal(buf_g.cpu(), buf_c), (validate, kw)
            assert torch.equal(cu_g.cpu(), cu_c), (validate, kw)
    lengths = torch.randint(0, 1000, (B - 1,))
    ids = torch.randperm(B)[: B - 1]
    args = (B, 7, 1, 2, 4, 5, 2)
    assert torch.equal(ops.dynamic_cp_merge_header(lengths.cuda(), ids.cuda().int(), *args).cpu(),
                       ops.dynamic_cp_merge_header(lengths, ids.int(), *args))
