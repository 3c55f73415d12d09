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

print("after import transformer_engine.pytorch:", cudnn_maps())
print("env: CUDA_HOME", os.environ.get("CUDA_HOME"), "CUDNN_HOME", os.environ.get("CUDNN_HOME"),
      "LD_LIBRARY_PATH", os.environ.get("LD_LIBRARY_PATH"))
print("torch cudnn", torch.backends.cudnn.version())
lengths = [700, 33, 1200, 5, 400]
cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32).cuda()
t, h = sum(lengths), 8
ok = True
for backend in ("fused", "flash"):
    os.environ["NVTE_FUSED_ATTN"] = "1" if backend == "fused" else "0"
    os.environ["NVTE_FLASH_ATTN"] = "1" if backend == "flash" else "0"
    os.environ["NVTE_UNFUSED_ATTN"] = "0"
    try:
        from transformer_engine.pytorch.attention.dot_product_attention import dot_product_attention as dpa_mod

        dpa_mod._attention_backends.update(attention_params=None, backend_selection_requires_update=True)
        getattr(dpa_mod, "_thd_policy_backend_cache", {}).clear()
    except Exception as e:  # noqa: BLE001
        print("could not reset TE's backend cache:", e)
    dpa = te.DotProductAttention(h, kv_channels=(192, 128), qkv_format="thd", attn_mask_type="padding_causal")
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(t, h, 192, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k = torch.randn(t, h, 192, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    v = torch.randn(t, h, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    try:
        out = dpa(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
        out.float().square().sum().backward()
        torch.cuda.synchronize()
        print(f"{backend}: ran, out {tuple(out.shape)}, dq norm {q.grad.float().norm().item():.4g}")
    except Exception as e:  # noqa: BLE001
        ok = ok and backend != "fused"
        print(f"{backend}: {type(e).__name__}: {str(e)[:600]}")
    print(f"after {backend}:", cudnn_maps())
sys.exit(0 if ok else 1)
