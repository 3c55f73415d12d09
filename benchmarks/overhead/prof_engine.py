"""Host time of each step of verl's preprocess_thd_engine drop-in on one device (megatron stubbed)."""
import os, sys, time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
import torch, pytest, verl_ops, verl_stubs
from verl_ops.integrations import verl as vi
from verl_ops.layout import ThdLayout

mp = pytest.MonkeyPatch(); verl_stubs.install_megatron_stub(mp)
dev = torch.device("cuda")
g = torch.Generator().manual_seed(0)
for B in (256, 1024):
    lens = torch.clamp(torch.exp(torch.randn(B, generator=g) + 5.5), 1, 8192).long()
    offs = torch.zeros(B + 1, dtype=torch.int64); offs[1:] = lens.cumsum(0)
    nested = torch.nested.nested_tensor_from_jagged(torch.randint(0, 100, (int(offs[-1]),)).to(dev), offs.to(dev))
    lay = ThdLayout.from_nested(nested)
    o = nested.offsets()
    pinned = torch.empty(B + 1, dtype=torch.int64, pin_memory=True)
    host = o.cpu()
    both, info = torch.ops.verl_ops.thd_layout_info(host, True)

    def d2h_pinned():
        pinned.copy_(o, non_blocking=True); torch.cuda.current_stream().synchronize(); return pinned

    steps = {
        "engine e2e": lambda: vi.preprocess_thd_engine(nested),
        "from_nested": lambda: ThdLayout.from_nested(nested),
        "offsets D2H (pageable)": lambda: o.to("cpu"),
        "offsets D2H (pinned + sync)": d2h_pinned,
        "thd_layout_info": lambda: torch.ops.verl_ops.thd_layout_info(host, True),
        "info.tolist": lambda: info.tolist(),
        "H2D offsets (pageable)": lambda: both.to(dev),
        "H2D offsets (pin + non_blocking)": lambda: both.pin_memory().to(dev, non_blocking=True),
        "PackedSeqParams": lambda: vi._make_packed_seq_params(lay, {}),
        "preprocess_thd (values)": lambda: verl_ops.preprocess_thd(nested._values, lay, 0, validate=False),
    }
    for name, f in steps.items():
        for _ in range(50): f()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(500): f()
        torch.cuda.synchronize()
        print(f"B={B} {name}: {(time.perf_counter() - t) / 500 * 1e6:.1f} us")
