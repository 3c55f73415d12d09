"""Run verl main's own unit tests of the THD/BSHD helpers against verl_ops' drop-ins.

    python3 tests/verl_main_harness.py --verl-git-dir /work/.mirror/verl-project+verl/repo [--rev HEAD]
    python3 tests/verl_main_harness.py --verl-src ~/src/verl      # a verl checkout

(Not a pytest file: run it with python.) The verl test files that mention the helpers
(``preprocess_packed_seqs`` ... ``build_vlm_attn_mask_bshd``) and verl's ``verl/`` package are
extracted to a temp dir at run time; nothing of verl is copied into this project. ``verl`` and
``verl.utils`` are bare packages (their ``__init__`` with ray, transformers, ... is not run) and
``verl.utils.device`` / ``verl.utils.model`` are stubbed, as in tests/verl_stubs.py; the test files
stub megatron-core themselves.

The runnable files (RUN) are run twice with pytest on CPU: once with verl main's own functions
(sanity check: the harness runs them), once with every function verl_ops provides patched into
the ``verl/models/mcore/util.py`` module each test loads. A verl_ops case that passes without
calling any drop-in is reported as such. Skipped tests (CUDA) and the other files that mention the
helpers (NOT_RUN: GPU / multi-rank / real megatron, or the helper replaced by a fake) are reported
as not applicable, with the reason. Exit status 1 when a verl_ops case fails.
"""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import logging
import re
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest
import torch

from verl_ops.integrations import verl as vi

DROP_INS = vi._all_drop_ins()  # name -> verl_ops function (THD, BSHD, dict-output, VLM mask, R3)
NAMES = [n for n in DROP_INS if not n.startswith("_") and "r3" not in n]  # the helpers in scope
RUN = ["tests/utils/test_megatron_bshd_preprocess.py"]
NOT_RUN = {
    "tests/special_distributed/test_megatron_dynamic_cp_features.py": "needs CUDA, torch.distributed ranks and real megatron-core",
    "tests/utils/test_special_megatron_kl_loss_tp.py": "multi-GPU TP test of the KL loss (needs CUDA + ranks); names preprocess_bshd_engine only in a docstring",
    "tests/models/test_model_forward_fused.py": "replaces preprocess_thd_engine by a fake (tests model_forward_fused's call, not the helper); needs verl's full import tree",
    "tests/utils/test_dynamic_cp_scheduler.py": "needs tensordict and verl's tensordict_utils import tree; replaces "
    "preprocess/postprocess_thd_engine by fakes; its DynamicCPScheduler cases (assignment adapter, errors) are encoded "
    "in tests/test_verl_dcp.py, which also compares the drop-in with verl's class over Megatron's scheduler",
    "tests/utils/test_megatron_router_replay_dcp.py": "replaces preprocess/postprocess_thd_engine by fakes (router-replay plumbing); needs verl's engine imports "
    "(tensordict); its pp_gather case fakes torch.distributed.all_gather_object, which the drop-in does not use "
    "(it gathers tensors): the same case runs on two gloo ranks in tests/test_verl_pp.py",
    "tests/utils/megatron/test_router_replay_model_walk_on_cpu.py": "replaces preprocess_packed_seqs by a lambda (router walk only)",
}
MODE = "verl"  # "verl": verl main's own functions; "verl_ops": the drop-ins
CALLED: set[str] = set()  # drop-ins called by the current test


def sources(args, dest: Path) -> tuple[str, list[str]]:
    """Extract verl/ and the test files naming a helper into dest; returns (commit, test files)."""
    pattern = r"\b(" + "|".join(NAMES) + r")\b"
    if args.verl_git_dir:
        git = ["git", f"--git-dir={args.verl_git_dir}"]
        commit = subprocess.check_output([*git, "rev-parse", args.rev], text=True).strip()
        grep = subprocess.run([*git, "grep", "-l", "-E", pattern, commit, "--", "tests/*.py"],
                              capture_output=True, text=True).stdout.split()
        files = sorted(line.split(":", 1)[1] for line in grep)
        archive = subprocess.run([*git, "archive", commit, "verl", *files], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    else:
        src = Path(args.verl_src)
        commit = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or "(not a git checkout)"
        files = sorted(str(p.relative_to(src)) for p in (src / "tests").rglob("*.py") if re.search(pattern, p.read_text()))
        shutil.copytree(src / "verl", dest / "verl")
        for f in files:
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src / f, dest / f)
    (dest / "pytest.ini").write_text("[pytest]\n")  # rootdir: no verl / verl_ops pytest config
    return commit, files


def stub_verl(root: Path) -> None:
    """verl, verl.utils, verl.models(.mcore) as bare packages of root/verl; light stubs for the two
    verl modules util.py imports (NPU detection, an output dataclass used in annotations)."""
    for name in ("verl", "verl.utils", "verl.models", "verl.models.mcore"):
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(root.joinpath(*name.split(".")))]
        sys.modules[name] = pkg
    sys.modules["verl.utils.device"] = types.SimpleNamespace(is_npu_available=False)
    sys.modules["verl.utils.model"] = types.SimpleNamespace(CausalLMOutputForPPO=type("CausalLMOutputForPPO", (), {}))
    # verl's util.py calls logger.warning_once, which transformers (imported by the real
    # verl.utils.model) adds to logging.Logger: add the same.
    if not hasattr(logging.Logger, "warning_once"):
        logging.Logger.warning_once = functools.lru_cache(None)(logging.Logger.warning)


def recording(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        CALLED.add(name)
        return fn(*args, **kwargs)
    return wrapper


def with_drop_ins(load):
    """Wrap a test file's util.py loader: in verl_ops mode, patch the drop-ins into what it loads."""
    @functools.wraps(load)
    def wrapper(monkeypatch, *args, **kwargs):
        module = load(monkeypatch, *args, **kwargs)
        if MODE == "verl_ops":
            for name, ours in DROP_INS.items():
                theirs = getattr(module, name, None)
                if theirs is not None:
                    if not vi._accepts(ours, theirs):
                        print(f"  note: verl's {name}{inspect.signature(theirs)} has parameters the drop-in lacks")
                    monkeypatch.setattr(module, name, recording(name, ours))
        return module
    wrapper.harness_wrapped = True
    return wrapper


class Plugin:
    def __init__(self):
        self.results = {}  # nodeid -> (outcome, detail)
        self.got = {}  # nodeid -> the failing test's locals

    def pytest_collection_modifyitems(self, items):
        for module in {item.module for item in items}:
            for attr, value in vars(module).items():  # the helper that loads verl's util.py
                if attr.startswith("_load_mcore_util") and not getattr(value, "harness_wrapped", False):
                    setattr(module, attr, with_drop_ins(value))

    def pytest_runtest_setup(self, item):
        CALLED.clear()

    def pytest_runtest_makereport(self, item, call):
        """On failure keep the test function's tensor / list locals: what it got and expected
        (torch.testing.assert_close does not print the values)."""
        frames = [e.frame for e in (call.excinfo.traceback if call.excinfo else []) if e.path == item.path]
        if frames and call.excinfo.errisinstance(AssertionError):
            self.got[item.nodeid] = [f"  {k} = {v!r}"[:300] for k, v in frames[-1].f_locals.items()
                                     if isinstance(v, (torch.Tensor, list, tuple, int))]

    def pytest_runtest_logreport(self, report):
        if report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self.results[report.nodeid] = ("not applicable", reason.removeprefix("Skipped: "))
        elif report.failed:
            lines = [ln for ln in report.longreprtext.splitlines() if ln.startswith("E ")][:30]
            self.results[report.nodeid] = (f"FAILED ({report.when})", "\n".join(lines + self.got.get(report.nodeid, [])))
        elif report.when == "call":
            note = "" if MODE == "verl" else ("via " + ", ".join(sorted(CALLED)) if CALLED else "did NOT call any verl_ops drop-in")
            self.results[report.nodeid] = ("passed", note)


def run_pytest(root: Path, files: list[str]) -> dict:
    plugin = Plugin()
    if not files:  # pytest.main without paths would collect the current directory
        return plugin.results
    pytest.main([*(str(root / f) for f in files), "-q", "-p", "no:cacheprovider", "--import-mode=importlib",
                 f"--rootdir={root}", "--no-header", "-rN", "--tb=short"], plugins=[plugin])
    return plugin.results


def test_cases(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            seg = ast.get_source_segment(path.read_text(), node) or ""
            if any(n in seg for n in NAMES):
                out.append(node.name)
    return out


def main():
    global MODE
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--verl-git-dir", help="bare git dir of verl (e.g. from the fetch tool)")
    src.add_argument("--verl-src", help="a verl checkout")
    ap.add_argument("--rev", default="HEAD", help="revision of --verl-git-dir (default HEAD)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir")
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="verl_main_harness_"))
    try:
        commit, files = sources(args, root)
        print(f"verl commit {commit}\ntest files naming the helpers: {len(files)}")
        stub_verl(root)
        runnable = [f for f in RUN if f in files]
        results = {}
        for MODE in ("verl", "verl_ops"):
            print(f"\n######## pytest, {MODE} functions ########", flush=True)
            results[MODE] = run_pytest(root, runnable)

        print("\n================ results: verl main's own functions | verl_ops drop-ins ================")
        bad = 0
        for nodeid in dict.fromkeys([*results["verl"], *results["verl_ops"]]):
            theirs, ours = (results[m].get(nodeid, ("MISSING (harness error)", "")) for m in ("verl", "verl_ops"))
            bad += not ours[0].startswith(("passed", "not applicable")) or "NOT call" in ours[1]
            print(f"\n{nodeid.split('::', 1)[1]}\n  verl main: {theirs[0]} | verl_ops: {ours[0]}")
            for who, (outcome, detail) in (("verl main", theirs), ("verl_ops", ours)):
                if detail and (who == "verl_ops" or outcome != "passed"):
                    print(f"    {who}: " + detail.replace("\n", "\n    "))
        print("\n================ not applicable (not run) ================")
        for f in files:
            if f in runnable:
                continue
            reason = NOT_RUN.get(f, "not classified by this harness (new upstream file?): review and add to RUN or NOT_RUN")
            print(f"\n{f}: {reason}\n  cases naming a helper: {', '.join(test_cases(root / f)) or '(none: only in fixtures, helpers or docstrings)'}")
        for f in RUN:
            if f not in files:
                print(f"\n{f}: absent at this commit")
        for mode, res in results.items():
            counts = {o: sum(r[0].startswith(o) for r in res.values()) for o in ("passed", "FAILED", "not applicable")}
            print(f"summary, {mode} functions: {counts}")
        return 1 if bad else 0
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
