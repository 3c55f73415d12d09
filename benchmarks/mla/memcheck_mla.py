"""Shapes for compute-sanitizer memcheck of mla_forward_padded's varlen backend at MLA head dims
(192 / 128; on compute capability 9.0 its forward is the own SM90 kernel): forward and backward on
an RL-like ragged batch with 16 heads, a long sequence with grouped heads, 1500 short sequences,
fp16 cross attention with rows that see no key, and device offsets past the rows. No reference
(tests/test_mla_varlen.py and tests/test_mla_sm90.py check values); the sanitizer checks every
access, so the script only needs to run them and fail on a non-finite output.

    compute-sanitizer --tool memcheck --error-exitcode 9 python3 benchmarks/mla/memcheck_mla.py
"""

import torch

from verl_ops import mla_cache_info, mla_forward_padded

OPS = torch.ops.verl_ops


def case(lengths, kv_lengths=None, hq=16, hk=16, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    kv_lengths = lengths if kv_lengths is None else kv_lengths
    tq, tk = sum(lengths), sum(kv_lengths)
    q = torch.randn(tq, hq, 192, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(tk, hk, 192, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(tk, hk, 128, device="cuda", dtype=dtype, generator=g)
    cu_q = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    cu_kv = cu_q if kv_lengths is lengths else torch.tensor([0] + kv_lengths, device="cuda").cumsum(0).to(torch.int32)
    return q, k, v, cu_q, cu_kv, max(lengths), max(kv_lengths)


def fwd_bwd(name, q, k, v, cu_q, cu_kv, max_q, max_kv, causal=True):
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    out = mla_forward_padded(q, k, v, cu_q, cu_kv, max_q, max_kv, causal=causal, backend="varlen")
    out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    ok = all(bool(torch.isfinite(t).all()) for t in (out, q.grad, k.grad, v.grad))
    print(f"{name}: {tuple(q.shape)} finite={ok}")
    assert ok, name


def main():
    print("varlen cache", mla_cache_info())
    g = torch.Generator().manual_seed(1)
    rl = torch.randn(14, generator=g, dtype=torch.float64).mul(0.9).exp().mul(900).clamp(1, 6000).long().tolist()
    fwd_bwd("rl-ragged h16 causal", *case(rl, seed=1))
    fwd_bwd("rl-ragged h16 full", *case(rl, seed=2), causal=False)
    fwd_bwd("long gqa 16/2", *case([8192, 3, 1, 2000], hq=16, hk=2, seed=3))
    short = torch.randint(0, 200, (1500,), generator=g).tolist()
    fwd_bwd("1500 sequences", *case(short, hq=2, hk=2, seed=4))
    fwd_bwd("fp16 cross", *case([300, 5, 130, 64], [40, 0, 129, 64], hq=4, hk=4, dtype=torch.float16, seed=5))
    q, k, v, cu, _, _, _ = case([100, 37, 200], hq=4, hk=4, seed=6)
    for bad in ([0, 100, 137, 5337], [-5000, 100, 137, 337], [0, 2**31 - 1, 2**31 - 1, 2**31 - 1], [0, 300, 137, 337]):
        cu_bad = torch.tensor(bad, dtype=torch.int32, device="cuda")
        for causal in (True, False):
            out, lse = OPS.mla_forward_padded(q, k, v, cu_bad, cu_bad, 200, 200, causal, None, 3)
            OPS.mla_backward_padded(torch.ones_like(out), q, k, v, out, lse, cu_bad, cu_bad, 200, 200, causal, None, 3)
    torch.cuda.synchronize()
    print("bad device offsets: ran")


if __name__ == "__main__":
    main()
