"""Shared fixtures and helpers of the verl_ops tests.

GPU tests carry the ``gpu`` marker (or the ``device`` fixture's "cuda" parameter, which exists only
when CUDA is available) and are skipped cleanly on machines without CUDA.
"""

from __future__ import annotations

import atexit
import os
import random
import shutil
import tempfile

# torch.compile's on-disk caches (TorchInductor's FX graph and AOTAutograd caches) live in one
# directory per user (/tmp/torchinductor_<user>) and outlive a build: a graph compiled against an
# older build of this package (another op schema) would be served again. The tests compile into
# a directory of their own, created fresh for each run.
if "VERL_OPS_TEST_INDUCTOR_CACHE" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="verl_ops_inductor_")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)
else:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.environ["VERL_OPS_TEST_INDUCTOR_CACHE"]

# The verl plugin (verl_ops_plugin, a "verl.plugins" entry point of this package) would patch verl
# wherever a test process imports the real verl: the tests that compare verl's own functions with
# the drop-ins, or that call install() themselves, need verl as it ships. tests/test_verl_plugin.py
# turns it on in the fresh processes it starts.
os.environ["VERL_OPS_PLUGIN"] = "off"

import pytest
import torch

import verl_ops  # noqa: F401  (registers torch.ops.verl_ops)

# VERL_OPS_TEST_CUDA_MEMORY_FRACTION=f caps this process's share of the GPU's memory (torch's
# allocator), so that several test processes can share one GPU (benchmarks/device/gpu_memcheck.sh
# runs shards of the suites side by side under compute-sanitizer).
if os.environ.get("VERL_OPS_TEST_CUDA_MEMORY_FRACTION") and torch.cuda.is_available():
    torch.cuda.set_per_process_memory_fraction(float(os.environ["VERL_OPS_TEST_CUDA_MEMORY_FRACTION"]))
from reference import ref_layout
from verl_ops import ThdLayout

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
DEVICE_PARAMS = [pytest.param(d, marks=[pytest.mark.gpu] if d == "cuda" else []) for d in DEVICES]

DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
]


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module", autouse=True)
def _close_dist_pools():
    """Worker pools of tests/_dist.py live for one test module."""
    yield
    from _dist import close_shared_pools

    close_shared_pools()


@pytest.fixture(params=DEVICE_PARAMS)
def device(request):
    """"cpu", and "cuda" when a GPU is present."""
    return request.param


@pytest.fixture
def rng(request):
    """A random.Random seeded from the test's id, so every test is reproducible on its own."""
    return random.Random(request.node.nodeid)


def seed_of(rng: random.Random) -> int:
    return rng.randrange(2**31)


# --------------------------------------------------------------------------------------------
# Data.


def random_lengths(rng: random.Random, n: int, align: int, *, zero=True, long=400) -> list:
    """n lengths drawn from the edge cases (0, 1, align-1, align, align+1) and random ones."""
    pool = [1, max(align - 1, 1), align, align + 1, 2 * align, 2 * align + 1]
    if zero:
        pool.append(0)
    out = []
    for _ in range(n):
        k = rng.random()
        if k < 0.5:
            out.append(rng.choice(pool))
        elif k < 0.9:
            out.append(rng.randint(1, 4 * align + 3))
        else:
            out.append(rng.randint(align, long))
    return out


def random_data(shape, dtype, generator: torch.Generator) -> torch.Tensor:
    """Random non-zero-ish data of any dtype (on CPU)."""
    shape = tuple(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype == torch.uint8:
        return torch.randint(1, 256, shape, generator=generator).to(dtype)
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        lo, hi = max(info.min, -(2**40)), min(info.max, 2**40)
        return torch.randint(lo, hi, shape, generator=generator, dtype=torch.int64).to(dtype)
    return (torch.randn(shape, generator=generator, dtype=torch.float64) * 10).to(dtype)


def scattered_mask(rng: random.Random, lengths, seq_capacity: int) -> torch.Tensor:
    """bool [B, S] with lengths[i] trues per row at random positions (not one contiguous run)."""
    mask = torch.zeros(len(lengths), seq_capacity, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, sorted(rng.sample(range(seq_capacity), n))] = True
    return mask


class Batch:
    """One random batch in the three input forms of docs/layout.md#input-forms.

    seqs: per-sequence valid tokens [len_i, *F]; values: [total, *F]; offsets: int64 [B + 1];
    padded: [B, S, *F] with random garbage where `mask` [B, S] is false.
    """

    def __init__(self, rng: random.Random, lengths, feature_shape=(), dtype=torch.float32, extra=5):
        g = torch.Generator().manual_seed(seed_of(rng))
        self.lengths = list(lengths)
        self.feature_shape = tuple(feature_shape)
        self.dtype = dtype
        self.seqs = [random_data((n, *feature_shape), dtype, g) for n in lengths]
        self.values = (
            torch.cat(self.seqs) if self.seqs else torch.zeros((0, *feature_shape), dtype=dtype)
        )
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        self.offsets = torch.tensor(offsets, dtype=torch.int64)
        S = max(lengths, default=0) + rng.randint(1, extra)
        self.mask = scattered_mask(rng, lengths, S)
        self.padded = random_data((len(lengths), S, *feature_shape), dtype, g)
        for i, x in enumerate(self.seqs):
            self.padded[i, self.mask[i]] = x

    def nested(self, device="cpu") -> torch.Tensor:
        return torch.nested.nested_tensor_from_jagged(self.values.to(device), self.offsets.to(device))

    def input(self, form: str, device="cpu"):
        """(x, attention_mask) for preprocess_thd in the given form."""
        if form == "jagged":
            return self.nested(device), None
        if form == "values":
            return self.values.to(device), None
        assert form == "padded"
        return self.padded.to(device), self.mask.to(device)

    def padded_expected(self) -> torch.Tensor:
        """What unpacking to [B, S, *F] must give: the tokens where mask is true, zero elsewhere."""
        out = torch.zeros_like(self.padded)
        for i, x in enumerate(self.seqs):
            out[i, self.mask[i]] = x
        return out


# --------------------------------------------------------------------------------------------
# Layouts.


def build_layout(lengths, tp=1, cp=1, cp_layout="zigzag", fp8=False, mlr=None, bucket=None, **kw) -> ThdLayout:
    """ThdLayout.from_lengths with the rule arguments in a fixed positional order."""
    return ThdLayout.from_lengths(
        lengths,
        tp_size=tp,
        cp_size=cp,
        cp_layout=cp_layout,
        fp8_padding=fp8,
        min_local_rows=mlr,
        pad_to_length_bucket=bucket,
        **kw,
    )


def make_layout(rng, lengths, tp=1, cp=1, cp_layout="zigzag", fp8=False, pad="none"):
    """A valid layout, with min_local_rows / a length bucket chosen so that they do pad (and keep
    the zigzag invariant). Returns (layout, the reference cu_seqlens_padded)."""
    factor = 2 if (cp_layout == "zigzag" and cp > 1) else 1
    mlr = bucket = None
    if pad == "min_local_rows":
        # Above the total the other rules give, in steps that keep every padded length a multiple
        # of the original alignment tp * cp * factor.
        unit = tp * factor
        base = ref_layout(lengths, tp, cp, cp_layout, fp8)[1][-1]
        mlr = unit * -(-(base // cp + rng.randint(1, 40)) // unit)
    elif pad == "bucket":
        bucket = 2 * tp * cp * rng.choice([3, 5, 16])
    layout = build_layout(lengths, tp, cp, cp_layout, fp8, mlr, bucket)
    cu, cu_padded = ref_layout(lengths, tp, cp, cp_layout, fp8, mlr, bucket)
    assert layout.cu_seqlens_cpu.tolist() == cu
    assert layout.cu_seqlens_padded_cpu.tolist() == cu_padded
    return layout, cu_padded
