"""vocab_log_probs_forward / _backward and verl_ops.vocab_parallel_log_probs (docs/ops.md#vocab_log_probs):
against the definition (tests below), against Megatron-Core's vocab_parallel_cross_entropy and verl's
vocab_parallel_log_probs_from_logits where they are installed, with the vocabulary split across
gloo ranks, under torch.compile, and bad input."""

from __future__ import annotations

import pytest
import torch

import verl_ops
from verl_ops.integrations.verl_logprob import vocab_parallel_log_probs_from_logits

from _dist import dist_params, dist_runner

_ops = torch.ops.verl_ops
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def reference(logits, labels, vocab_start=0):
    """log softmax(logits)[label] in float32, a label outside [start, start + V) counting 0 for its logit
    (Megatron's masked prediction), and the gradient (softmax - onehot) * -g for a given g."""
    x = logits.float()
    m = x.max(-1, keepdim=True).values
    e = (x - m).exp()
    s = e.sum(-1)
    v = logits.shape[-1]
    t = labels.long() - vocab_start
    inside = (t >= 0) & (t < v)
    picked = (x - m).gather(-1, t.clamp(0, v - 1)[..., None])[..., 0]
    lp = -(s.log() - torch.where(inside, picked, torch.zeros_like(picked)))
    onehot = torch.zeros_like(x).scatter_(-1, t.clamp(0, v - 1)[..., None], inside[..., None].float())

    def grad(g):
        return ((e / s[..., None] - onehot) * -g.float()[..., None]).to(logits.dtype)

    return lp, grad


def devices():
    out = ["cpu"]
    if torch.cuda.is_available():
        out.append(pytest.param("cuda", marks=pytest.mark.gpu))
    return out


def _tol(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype in (torch.float32, torch.float64) else dict(rtol=1e-2, atol=2e-3)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,vocab", [((2, 37), 1000), ((301,), 4096), ((5, 3), 13), ((1,), 1)],
                         ids=["bsv", "tv", "odd_vocab", "one"])
@pytest.mark.parametrize("label_dtype", [torch.int64, torch.int32], ids=["i64", "i32"])
def test_equals_definition(device, dtype, shape, vocab, label_dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(*shape, vocab, generator=g) * 4).to(dtype).to(device)
    labels = torch.randint(0, vocab, shape, generator=g).to(label_dtype).to(device)
    labels.view(-1)[0] = -100  # outside the vocabulary: counts 0, as in Megatron
    want, want_grad = reference(logits, labels)
    x = logits.clone().requires_grad_(True)
    got = verl_ops.vocab_parallel_log_probs(x, labels)
    assert got.dtype == torch.float32 and got.shape == labels.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    gout = torch.randn(shape, generator=g).to(device)
    got.backward(gout)
    assert x.grad.dtype == dtype and x.grad.shape == logits.shape
    torch.testing.assert_close(x.grad, want_grad(gout), **_tol(dtype))


@pytest.mark.parametrize("device", devices())
def test_strided_logits_and_slice_offset(device):
    """A transposed / sliced logits tensor (the kernel's rows need not be contiguous), and a
    vocabulary slice that starts at vocab_start (labels outside it count 0)."""
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(7, 5, 72, generator=g).to(torch.bfloat16).to(device)
    logits = wide[..., 4:68]  # rows 72 apart, 64 columns
    labels = torch.randint(100, 164, (7, 5), generator=g).to(device)
    labels[0, 0] = 99
    labels[1, 1] = 164
    want, want_grad = reference(logits, labels, vocab_start=100)
    x = logits.detach().clone().requires_grad_(True)
    lp, mx, se, ll = _ops.vocab_log_probs_forward(logits, labels, 100)
    torch.testing.assert_close(lp, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mx, logits.float().max(-1).values)
    assert ll[0, 0] == 0 and ll[1, 1] == 0 and ll[2, 2] == logits[2, 2, labels[2, 2] - 100].float()
    gout = torch.randn(7, 5, generator=g).to(device)
    grad = _ops.vocab_log_probs_backward(gout, logits, labels, mx, se, 100)
    torch.testing.assert_close(grad, want_grad(gout), rtol=1e-2, atol=2e-3)
    tr = torch.randn(64, 9, generator=g).to(device).t()  # [9, 64], inner stride 9: copied first
    lab = torch.randint(0, 64, (9,), generator=g).to(device)
    torch.testing.assert_close(verl_ops.vocab_parallel_log_probs(tr, lab), reference(tr, lab)[0])


@pytest.mark.parametrize("device", devices())
def test_size_one_dims_and_extreme_labels(device):
    """Rows whose leading dims include size-1 dims with any stride (a transposed [1, T, V] is
    [T, 1, V] with strides (V, T V, 1)), rows one stride cannot walk, and labels whose distance to
    vocab_start leaves int64 (outside the slice, not wrapped into it)."""
    g = torch.Generator().manual_seed(6)
    for x in (torch.randn(1, 3, 16, generator=g).transpose(0, 1),
              torch.randn(4, 3, 1, 8, generator=g).permute(1, 2, 0, 3),
              torch.randn(3, 2, 2, 24, generator=g)[:, ::2]):
        x = x.to(device)
        labels = torch.randint(0, x.shape[-1], x.shape[:-1], generator=g).to(device)
        want, want_grad = reference(x, labels)
        xo = x.clone().requires_grad_(True)
        got = verl_ops.vocab_parallel_log_probs(x, labels)
        torch.testing.assert_close(got, want)
        gout = torch.randn(x.shape[:-1], generator=g).to(device)
        grad = _ops.vocab_log_probs_backward(gout, x, labels, *_ops.vocab_log_probs_forward(x, labels, 0)[1:3], 0)
        torch.testing.assert_close(grad, want_grad(gout))
    logits = torch.randn(2, 8, generator=g).to(device)
    labels = torch.tensor([-2**63, -2**63 + 2], device=device)
    lp, _, _, ll = _ops.vocab_log_probs_forward(logits, labels, 2**63 - 1)
    assert not ll.any()
    torch.testing.assert_close(lp, -(torch.logsumexp(logits, -1) - logits.max(-1).values))  # Megatron: counts 0


def test_empty_rows():
    x = torch.randn(0, 8, requires_grad=True)
    lp = verl_ops.vocab_parallel_log_probs(x, torch.zeros(0, dtype=torch.int64))
    assert lp.shape == (0,)
    lp.sum().backward()
    assert x.grad.shape == (0, 8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.gpu
def test_cuda_rl_sized_rows_bf16():
    """A micro-batch's worth of rows over a 32k vocabulary: the vector path, against the definition."""
    g = torch.Generator(device="cuda").manual_seed(2)
    logits = (torch.randn(3000, 32768, generator=g, device="cuda") * 3).to(torch.bfloat16)
    labels = torch.randint(0, 32768, (3000,), generator=g, device="cuda")
    want, want_grad = reference(logits, labels)
    x = logits.clone().requires_grad_(True)
    got = verl_ops.vocab_parallel_log_probs(x, labels)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)
    gout = torch.randn(3000, generator=g, device="cuda")
    got.backward(gout)
    torch.testing.assert_close(x.grad, want_grad(gout), rtol=1e-2, atol=1e-4)


def test_opcheck():
    x = torch.randn(4, 3, 11, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (4, 3))
    torch.library.opcheck(_ops.vocab_log_probs_forward.default, (x, labels, 0),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    lp, mx, se, _ = _ops.vocab_log_probs_forward(x.detach(), labels, 0)
    torch.library.opcheck(_ops.vocab_log_probs_backward.default, (torch.randn(4, 3), x.detach(), labels, mx, se, 0))


def test_compiles_fullgraph():
    x = torch.randn(6, 50, requires_grad=True)
    labels = torch.randint(0, 50, (6,))
    fn = torch.compile(lambda a, b: verl_ops.vocab_parallel_log_probs(a, b).sum(), fullgraph=True, backend="aot_eager")
    fn(x, labels).backward()
    want, want_grad = reference(x.detach(), labels)
    torch.testing.assert_close(x.grad, want_grad(torch.ones(6)))


@pytest.mark.parametrize("bad,match", [
    (lambda x, lab: (x.long(), lab), "logits must be float32, float64, float16 or bfloat16"),
    (lambda x, lab: (x, lab[:-1]), "labels must have logits' shape less its last dim"),
    (lambda x, lab: (x, lab.float()), "labels must be int64 or int32"),
    (lambda x, lab: (x[:, :0], lab), "logits. last dim \\(the vocabulary slice\\) must be > 0"),
])
def test_bad_input(bad, match):
    x, lab = bad(torch.randn(4, 9), torch.randint(0, 9, (4,)))
    with pytest.raises((RuntimeError, ValueError), match="vocab_log_probs_forward: " + match):
        _ops.vocab_log_probs_forward(x, lab, 0)
    with pytest.raises(ValueError, match="vocab_start must be an int >= 0"):
        verl_ops.vocab_parallel_log_probs(torch.randn(4, 9), torch.randint(0, 9, (4,)), vocab_start=-1)
    lp, mx, se, _ = _ops.vocab_log_probs_forward(torch.randn(4, 9), torch.randint(0, 9, (4,)), 0)
    with pytest.raises(RuntimeError, match="vocab_log_probs_backward: sum_exp must have labels' shape"):
        _ops.vocab_log_probs_backward(torch.ones(4), torch.randn(4, 9), torch.randint(0, 9, (4,)), mx, se[:2], 0)
    with pytest.raises(RuntimeError, match="vocab_log_probs_backward: grad_log_probs must be float32"):
        _ops.vocab_log_probs_backward(torch.ones(4, dtype=torch.float64), torch.randn(4, 9),
                                      torch.randint(0, 9, (4,)), mx, se, 0)


# --------------------------------------------------------------------------------------------
# Megatron-Core's vocab_parallel_cross_entropy and verl's function (one process, TP 1), and the
# vocabulary split across gloo ranks.


def _megatron_tp(world):
    """Megatron's model parallel state with TP = world on the already-initialised process group."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    return ps


def check_split_vocab(rank, world, dtype_name, seed):
    """Each rank holds a slice of a [T, V] vocabulary; every rank's log-probs equal the whole
    vocabulary's, and its gradient slice the whole gradient's slice. Where megatron-core is
    installed, the drop-in equals -vocab_parallel_cross_entropy (Megatron's own TP path) too."""
    import torch.distributed as dist

    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(seed)
    t, v = 57, 40 * world
    logits = (torch.randn(t, v, generator=g) * 3).to(dtype)
    labels = torch.randint(0, v, (t,), generator=g)
    gout = torch.randn(t, generator=g)
    part = v // world
    mine = logits[:, rank * part:(rank + 1) * part].clone().requires_grad_(True)
    lp = verl_ops.vocab_parallel_log_probs(mine, labels, group=dist.group.WORLD)
    lp.backward(gout)
    want, want_grad = reference(logits, labels)
    torch.testing.assert_close(lp, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mine.grad, want_grad(gout)[:, rank * part:(rank + 1) * part], **_tol(dtype))
    try:
        from megatron.core import tensor_parallel
    except Exception:  # noqa: BLE001
        return True
    _megatron_tp(world)
    theirs_in = logits[:, rank * part:(rank + 1) * part].clone().requires_grad_(True)
    theirs = -tensor_parallel.vocab_parallel_cross_entropy(theirs_in, labels)
    theirs.backward(gout)
    ours_in = logits[:, rank * part:(rank + 1) * part].clone().requires_grad_(True)
    ours = vocab_parallel_log_probs_from_logits(ours_in, labels)
    ours.backward(gout)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert ours_in.grad.dtype == theirs_in.grad.dtype
    torch.testing.assert_close(ours_in.grad, theirs_in.grad, **_tol(dtype))
    return True


def check_masked_slice(rank, world):
    """A row whose whole slice on one rank is -inf (masked ids) but not elsewhere: that rank adds
    nothing to the sum (Megatron subtracts the global max first), so the log-probs stay finite."""
    import torch.distributed as dist

    g = torch.Generator().manual_seed(8)
    t, part = 9, 16
    logits = torch.randn(t, part * world, generator=g)
    logits[:3, :part] = float("-inf")  # rank 0's slice of rows 0-2
    labels = torch.randint(part, part * world, (t,), generator=g) if world > 1 else torch.randint(0, part, (t,))
    mine = logits[:, rank * part:(rank + 1) * part].clone().requires_grad_(True)
    lp = verl_ops.vocab_parallel_log_probs(mine, labels, group=dist.group.WORLD)
    want = torch.log_softmax(logits, -1).gather(-1, labels[:, None])[:, 0]
    torch.testing.assert_close(lp, want)
    lp.sum().backward()
    assert torch.isfinite(mine.grad).all()
    return True


def test_masked_slice(dist_run):
    assert dist_run("check_masked_slice") == [True] * dist_run.world


@pytest.fixture(params=dist_params(("gloo",), (2, 4)))
def dist_run(request):
    return dist_runner(request, "test_log_probs", pass_backend=False)


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_split_vocabulary(dist_run, dtype_name):
    assert dist_run("check_split_vocab", dtype_name, 3) == [True] * dist_run.world


def check_drop_in_equals_verl(rank, world):
    """verl's vocab_parallel_log_probs_from_logits (Megatron's cross entropy over its TP group) and the
    drop-in, with the vocabulary split across the pool's ranks."""
    try:
        import verl.utils.megatron.tensor_parallel as verl_tp
    except Exception:  # noqa: BLE001
        return "no verl"
    _megatron_tp(world)
    g = torch.Generator().manual_seed(4)
    for dtype in (torch.bfloat16, torch.float32):
        logits = (torch.randn(1, 333, 128 * world, generator=g) * 3).to(dtype)
        labels = torch.randint(0, 128 * world, (1, 333), generator=g)
        labels[0, 0] = -100
        gout = torch.randn(1, 333, generator=g)
        mine = logits[..., rank * 128:(rank + 1) * 128]
        a = mine.clone().requires_grad_(True)
        b = mine.clone().requires_grad_(True)
        theirs = verl_tp.vocab_parallel_log_probs_from_logits(a, labels)
        ours = vocab_parallel_log_probs_from_logits(b, labels)
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        theirs.backward(gout)
        ours.backward(gout)
        torch.testing.assert_close(b.grad, a.grad, **_tol(dtype))
    return True


def test_drop_in_equals_verl(dist_run):
    res = dist_run("check_drop_in_equals_verl")
    if res[0] == "no verl":
        pytest.skip("verl is not installed")
    assert res == [True] * dist_run.world
