"""On a GPU machine with TransformerEngine: which cuDNN TE and torch load, and whether TE's fused
(cuDNN) attention runs MLA's 192/128 head dims on packed (THD) sequences, forward and backward.
Prints one line per fact; gpu_te.sh runs it before the tests, so that a refused backend shows its
reason and the libraries behind it."""
import os
import sys

os.environ.setdefault("NVTE_DEBUG", "1")
os.environ.setdefault("NVTE_DEBUG_LEVEL", "2")


def cudnn_maps() -> list:
    with open("/proc/self/maps") as f:
        return sorted({ln.split()[-1] for ln in f if "libcudnn" in ln})


import torch  # noqa: E402

import verl_ops  # noqa: E402,F401

print("after import verl_ops:", cudnn_maps())
import transformer_engine.pytorch as te  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests"))
import megatron_model_lib as lib  # noqa: E402  (te_attention: TE's backend as megatron-core selects it)

print("after import transformer_engine.pytorch:", cudnn_maps())
print("env: CUDA_HOME", os.environ.get("CUDA_HOME"), "CUDNN_HOME", os.environ.get("CUDNN_HOME"),
      "LD_LIBRARY_PATH", os.environ.get("LD_LIBRARY_PATH"))
print("torch cudnn", torch.backends.cudnn.version())
lengths = [700, 33, 1200, 5, 400]
cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32).cuda()
t, h = sum(lengths), 8
ok = True
ref = None
# TE's flash attention twice: as shipped (on FlashAttention-4 4.0.0b36 TE's causal window (-1, 0)
# masks every row: zeros, TransformerEngine #3528) and with megatron_model_lib.te_fa4_window_fix
for backend, fix in (("fused", False), ("flash", False), ("flash", True)):
    name = backend + (" (FA4 window fixed)" if fix else "")
    dpa = te.DotProductAttention(h, kv_channels=(192, 128), qkv_format="thd", attn_mask_type="padding_causal")
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(t, h, 192, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k = torch.randn(t, h, 192, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    v = torch.randn(t, h, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    try:
        # (the backend set as megatron-core's attention_backend sets it, TE's cached selection dropped)
        with lib.te_attention(backend, fa4_window_fix=fix) as seen:
            out = dpa(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
            out.float().square().sum().backward()
            torch.cuda.synchronize()
        got = [x.detach().float() for x in (out, q.grad, k.grad, v.grad)]
        line = f"{name}: ran {seen}, out {tuple(out.shape)}, dq norm {got[1].norm().item():.4g}"
        if backend == "fused":
            ref = got
        elif ref is not None:
            errs = [((a - b).norm() / b.norm().clamp_min(1e-30)).item() for a, b in zip(got, ref)]
            line += ", relative error against fused: out {:.3g}, dq {:.3g}, dk {:.3g}, dv {:.3g}".format(*errs)
            # the corrected FA4 path must agree with cuDNN (measured: about 3e-3)
            if fix and seen.get("fa4_window_fix") and max(errs) > 2e-2:
                ok = False
                line += " -> DISAGREES"
        print(line)
    except Exception as e:  # noqa: BLE001
        ok = ok and backend != "fused"
        print(f"{name}: {type(e).__name__}: {str(e)[:600]}")
    print(f"after {name}:", cudnn_maps())
sys.exit(0 if ok else 1)
