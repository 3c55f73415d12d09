"""Raise each kind of formatted error from the extension in a child process; report crashes."""
import subprocess
import sys

CASES = {
    "thd_layout sizes": "torch.ops.verl_ops.thd_layout(torch.tensor([[3, 1]]))",
    "thd_layout int": "torch.ops.verl_ops.thd_layout(torch.tensor([3, 1]), 0)",
    "thd_layout dtype": "torch.ops.verl_ops.thd_layout(torch.tensor([3.0, 1.0]))",
    "thd_layout str": "torch.ops.verl_ops.thd_layout(torch.tensor([3, 1]), 1, 2, 'zz')",
    "preprocess dtype": "torch.ops.verl_ops.preprocess_thd(torch.zeros(4), torch.tensor([0, 4]), torch.tensor([0, 4], dtype=torch.int32), 4)",
    "preprocess int": "torch.ops.verl_ops.preprocess_thd(torch.zeros(4), torch.tensor([0, 4], dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32), 4, 1, 5)",
    "c10 check in torch": "torch.zeros(2, 3) @ torch.zeros(4, 5)",
}
for name, expr in CASES.items():
    code = f"import torch, verl_ops\ntry:\n    {expr}\nexcept Exception as e:\n    print(type(e).__name__, str(e).splitlines()[0][:150])\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    print(f"{name:22s} rc={r.returncode} {r.stdout.strip()} {r.stderr.strip()[-300:]}")
