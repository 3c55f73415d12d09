"""The verl plugin (verl_ops_plugin, the "verl.plugins" entry point): ``pip install verl_ops`` plus
a bare ``import verl`` puts the drop-ins into verl's modules and MLACoreAttention into the models
verl's builders make; turned off, nothing changes; a broken or unknown environment gets a warning
and verl's originals, never an exception.

Each case runs tests/verl_plugin_child.py in a fresh process (the plugin acts once per process, on
``import verl``). They need verl 0.9.1 with its import-time dependencies (ray, tensordict, omegaconf,
transformers, codetiming), megatron-core and this package installed (its entry point registered):
.ci/run installs them and sets VERL_OPS_REQUIRE_VERL=1, so that there a missing dependency fails
instead of skipping.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = os.path.join(HERE, "verl_plugin_child.py")
PLUGIN_ENV = ("VERL_OPS_PLUGIN", "VERL_OPS_PLUGIN_VERSION_CHECK", "VERL_USE_EXTERNAL_PLUGINS",
              "VERL_USE_EXTERNAL_MODULES", "RANK", "FAKE_MEGATRON_VERSION", "VERL_OPS_LOG_LEVEL")


def _verl_importable() -> str | None:
    """Why verl (with its import-time dependencies) cannot be imported, or None."""
    code = "import ray, tensordict, omegaconf, transformers, codetiming, megatron.core, verl"
    env = {k: v for k, v in os.environ.items() if k not in PLUGIN_ENV}
    env["VERL_USE_EXTERNAL_PLUGINS"] = "none"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    return None if r.returncode == 0 else (r.stderr.strip().splitlines() or ["?"])[-1]


_WHY_NOT = _verl_importable()
if _WHY_NOT is not None:
    if os.environ.get("VERL_OPS_REQUIRE_VERL") == "1":
        raise RuntimeError(f"VERL_OPS_REQUIRE_VERL=1 but verl cannot be imported: {_WHY_NOT}")
    pytest.skip(f"verl and its import-time dependencies are not installed: {_WHY_NOT}", allow_module_level=True)


def run(scenario: str, pythonpath: str | None = None, **env) -> tuple[dict, str]:
    """(result, stderr) of one scenario in a fresh process with ``env`` set (the plugin's own
    variables otherwise unset)."""
    full = {k: v for k, v in os.environ.items() if k not in PLUGIN_ENV}
    full.update(env)
    if pythonpath:
        full["PYTHONPATH"] = pythonpath + os.pathsep + full.get("PYTHONPATH", "")
    r = subprocess.run(
        [sys.executable, CHILD, scenario], capture_output=True, text=True, errors="replace", env=full, timeout=600,
        cwd=HERE,
    )
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, f"scenario {scenario} failed (rc {r.returncode}):\n{r.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):]), r.stderr


def test_entry_point_is_registered():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="verl.plugins")}
    assert eps.get("verl_ops") == "verl_ops_plugin", eps


def test_bare_import_verl_puts_the_drop_ins_in_place():
    res, err = run("state")
    assert res["plugin_loaded"]
    drop_ins = res["drop_ins"]
    # verl's util and every module that imported its functions by name (model_forward), and the
    # router-replay / dynamic CP modules.
    assert any(k.startswith("verl.models.mcore.model_forward.") for k in drop_ins)
    assert any(k.startswith("verl.utils.megatron.router_replay_utils.") for k in drop_ins)
    assert any(k.startswith("verl.utils.dynamic_cp_scheduler.") for k in drop_ins)
    assert len(drop_ins) >= 25, drop_ins
    assert all(drop_ins.values()), [k for k, v in drop_ins.items() if not v]
    assert res["gpt_model_wrapped"]
    assert res["warnings"] == []
    # One INFO line (rank 0) for the data path names what was patched and what was left alone.
    info = [ln for ln in err.splitlines() if "verl_ops plugin: verl 0.9.1: verl.models.mcore.util" in ln]
    assert len(info) == 1, err[-3000:]
    assert "preprocess_thd_engine" in info[0] and "left alone: none" in info[0]


@pytest.mark.parametrize("value, level", [("10", 10), ("debug", 10), ("WARNING", 30), ("", 20), ("bogus", 20),
                                          ("--10", 20)])
def test_log_level_names_numbers_and_bad_values(value, level):
    res, _ = run("log_level", VERL_OPS_LOG_LEVEL=value)
    assert res["level"] == level
    assert res["drop_ins"] and all(res["drop_ins"].values()), res["drop_ins"]
    if value in ("bogus", "--10"):
        assert len(res["warnings"]) == 1 and f"VERL_OPS_LOG_LEVEL={value!r}" in res["warnings"][0], res["warnings"]
    else:
        assert res["warnings"] == []


def test_log_level_is_not_read_when_the_plugin_is_off():
    res, _ = run("log_level", VERL_OPS_LOG_LEVEL="bogus", VERL_OPS_PLUGIN="off")
    assert res["level"] == 0 and res["warnings"] == []
    assert res["drop_ins"] and not any(res["drop_ins"].values())


def test_warnings_as_errors_never_break_verls_imports():
    res, _ = run("warnings_as_errors", VERL_OPS_LOG_LEVEL="bogus")
    assert res["drop_ins"] and all(res["drop_ins"].values()), res["drop_ins"]


def test_uninstall_undoes_the_plugin_in_modules_imported_later_too():
    res, _ = run("uninstall")
    if res["late_imported_before"]:
        pytest.skip("this verl imports verl.utils.dynamic_cp_scheduler early: no owner is left to import later")
    assert any(k.startswith("verl.models.mcore.model_forward.") for k in res["before"]), res["before"]
    assert sorted(res["restored"]) == res["before"]
    assert res["after"] == [], res["after"]
    # what went back is verl's own (defined in verl's modules), not some other object
    assert res["restored_modules"] and all(m.startswith("verl.") for m in res["restored_modules"]), res
    assert res["report_data_undone"]
    assert res["warnings"] == []


def test_a_spec_that_cannot_be_copied_is_left_alone():
    res, _ = run("spec_copy_fails")
    assert not res["caller_spec_placed"] and res["layer_arg_kept"]
    assert res["mtp_copy_placed"] and res["report_placed"] == 1
    assert len(res["warnings"]) == 1 and "transformer_layer_spec could not be copied" in res["warnings"][0]


def test_info_line_only_on_rank_zero():
    _, err = run("state", RANK="1")
    assert "verl_ops plugin: verl 0.9.1" not in err


@pytest.mark.parametrize(
    "env",
    [
        {"VERL_OPS_PLUGIN": "off"},
        {"VERL_OPS_PLUGIN": "0"},
        {"VERL_USE_EXTERNAL_PLUGINS": "none"},
        {"VERL_USE_EXTERNAL_PLUGINS": "some_other_plugin"},
    ],
    ids=["ours-off", "ours-0", "verl-none", "verl-selects-another"],
)
def test_turned_off_patches_nothing(env):
    res, _ = run("state", **env)
    assert res["drop_ins"] and not any(res["drop_ins"].values())
    assert not res["gpt_model_wrapped"]
    assert res["warnings"] == []


def test_parts():
    data, _ = run("state", VERL_OPS_PLUGIN="data")
    assert all(data["drop_ins"].values()) and not data["gpt_model_wrapped"]
    mla, _ = run("state", VERL_OPS_PLUGIN="mla")
    assert not any(mla["drop_ins"].values()) and mla["gpt_model_wrapped"]


def test_verl_external_modules_is_the_explicit_alternative():
    res, _ = run("state", VERL_USE_EXTERNAL_PLUGINS="none", VERL_USE_EXTERNAL_MODULES="verl_ops_plugin")
    assert res["plugin_loaded"] and all(res["drop_ins"].values()) and res["gpt_model_wrapped"]


@pytest.fixture
def verl_copy(tmp_path):
    """A copy of the installed verl on a path searched first, to be edited by the test."""
    import importlib.util

    spec = importlib.util.find_spec("verl")
    src = os.path.dirname(spec.origin)
    dst = tmp_path / "verl"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_other_signatures_keep_verls_function_with_a_warning(verl_copy):
    util = verl_copy / "verl" / "models" / "mcore" / "util.py"
    text = util.read_text()
    old = "def preprocess_packed_seqs(\n    input_ids: torch.Tensor, attention_mask: torch.Tensor,"
    assert old in text
    util.write_text(text.replace(old, "def preprocess_packed_seqs(\n    input_ids: torch.Tensor, extra_flag, attention_mask: torch.Tensor,"))
    res, _ = run("state", pythonpath=str(verl_copy))
    drop_ins = res["drop_ins"]
    assert drop_ins["verl.models.mcore.util.preprocess_packed_seqs"] is False
    assert drop_ins["verl.models.mcore.model_forward.preprocess_packed_seqs"] is False
    others = {k: v for k, v in drop_ins.items() if not k.endswith(".preprocess_packed_seqs")}
    assert all(others.values()), others
    assert any("verl.models.mcore.util.preprocess_packed_seqs" in w for w in res["warnings_all"]), res
    assert "verl.models.mcore.util.preprocess_packed_seqs (other parameters)" in res["report"]["data"]["left alone"]


def test_unknown_verl_version_is_left_alone_with_a_warning(verl_copy):
    (verl_copy / "verl" / "version" / "version").write_text("0.8.0\n")
    res, _ = run("state", pythonpath=str(verl_copy))
    assert not any(res["drop_ins"].values())
    assert any("verl 0.8.0 is outside the releases" in w for w in res["warnings"]), res["warnings"]
    forced, _ = run("state", pythonpath=str(verl_copy), VERL_OPS_PLUGIN_VERSION_CHECK="0")
    assert all(forced["drop_ins"].values())


def test_unknown_megatron_version_leaves_models_alone_with_a_warning():
    res, _ = run("megatron_version", FAKE_MEGATRON_VERSION="0.12.0")
    assert not res["gpt_model_wrapped"]
    assert all(res["drop_ins"].values())
    assert any("megatron-core 0.12.0 is outside the releases" in w for w in res["warnings"]), res["warnings"]


def test_megatron_without_mla_keeps_the_attention_with_a_warning():
    res, _ = run("no_mla")
    assert res["build"]["slots"] == ["DotProductAttention"]
    assert len(res["warnings"]) == 1 and "has no MLA" in res["warnings"][0]


def test_broken_verl_ops_never_breaks_verl():
    res, _ = run("broken_ops")
    assert res["model_forward_module"] == "verl.models.mcore.util"  # verl's own function
    assert len(res["warnings"]) == 1 and "verl_ops could not be imported" in res["warnings"][0]


def test_models_verl_builds_run_mla_core_attention():
    """verl's model_initializer and vanilla mbridge build real (tiny, CPU, local-spec) DeepSeek-V3
    models after a bare ``import verl``: every MLA layer, MTP included, runs MLACoreAttention, and a
    training step (loss and every gradient) equals the model built with megatron_mla.install(spec)."""
    res, err = run("builders")
    assert res["wrapped"]
    n = sum(res["reference_layers"].values())
    assert n == 3 and res["reference_layers"] == {"MLACoreAttention": n}  # 2 decoder layers + 1 MTP
    for builder in ("model_initializer", "mbridge"):
        got = res[builder]
        assert "skipped" not in got, got
        assert got["layers"] == {"MLACoreAttention": n}, (builder, got)
        assert got["loss_equal"] and got["grads_equal"] and got["tokens"] > 0, (builder, got)
    assert res["warnings"] == []
    models = res["report"]["mla"]["models"]
    assert [m["mla_core_attention"] for m in models] == [n, n, n]
    info = [ln for ln in err.splitlines() if "verl_ops plugin: megatron-core" in ln]
    assert len(info) == 1 and f"MLACoreAttention in {n} of {n} MLA layers" in info[0], err[-3000:]


def test_verls_value_pad_is_bypassed_for_mla_core_attention():
    res, _ = run("verl_value_pad")
    assert res["class_forward"] == "verl.models.mcore.patch"  # verl's patch is in place ...
    assert res["v_dims"] == [res["v_head_dim"]]  # ... and MLACoreAttention still gets V as it is
    assert res["qk_head_dim"] in res["v_dims_verl_forward"]  # (verl's forward itself pads it)
    for key in ("before", "after", "without_plugin_dispatch"):
        assert res[key]["loss_equal"] and res[key]["grads_equal"], (key, res[key])


def test_unsupported_layers_keep_their_attention_and_are_reported():
    res, _ = run("unsupported")
    assert res["supported"] == {"slots": ["MLACoreAttention"], "callers_spec_unchanged": True}
    assert res["dropout"] == {"slots": ["DotProductAttention"], "callers_spec_unchanged": True}
    models = res["report"]["mla"]["models"]
    assert models[1]["kept"] == {"config.attention_dropout=0.1": models[1]["kept"]["config.attention_dropout=0.1"]}
    assert models[1]["kept"]["config.attention_dropout=0.1"] >= 1 and not models[1]["replaced"]


def test_verls_engine_forward_with_the_plugin_equals_without(tmp_path):
    """verl's own Megatron engine forward (get_mcore_engine_forward_fn -> gptmodel_forward_model_engine,
    the engine's log-prob processor, a policy-gradient loss, backward) on a model from vanilla
    mbridge's DeepSeek-V3 provider, once with the plugin and once without, each in a fresh process:
    the plugin's run goes through verl_ops (drop-ins in verl's modules, MLACoreAttention in every MLA
    layer, verl_ops' log-probs) and gives the same log-probs, entropy, routes and gradients (float32
    on the CPU: both attentions are exact float32 references)."""
    import torch

    on_file, off_file = tmp_path / "on.pt", tmp_path / "off.pt"
    on, _ = run("engine_forward", VERL_OPS_ENGINE_OUT=str(on_file))
    off, _ = run("engine_forward", VERL_OPS_PLUGIN="off", VERL_OPS_ENGINE_OUT=str(off_file))
    assert on["layers"] == {"MLACoreAttention": 2}, on["layers"]
    assert off["layers"] == {"ReferenceMLACoreAttention": 2}, off["layers"]
    assert on["log_probs_fn"].startswith("verl_ops."), on["log_probs_fn"]
    assert not off["log_probs_fn"].startswith("verl_ops."), off["log_probs_fn"]
    # verl's model_forward binds the THD helpers by name: the plugin's are there, and only with it
    mf = {k: v for k, v in on["drop_ins"].items() if k.startswith("verl.models.mcore.model_forward.")}
    assert mf and all(mf.values()), on["drop_ins"]
    assert not any(off["drop_ins"].values()), off["drop_ins"]
    assert on["param_sum"] == off["param_sum"], "the two processes built different weights"
    assert on["nested"] == off["nested"] == [True, True]
    a, b = torch.load(on_file), torch.load(off_file)
    for r_on, r_off in zip(a["routes"], b["routes"], strict=True):
        assert torch.equal(r_on, r_off), "the router chose other experts with the plugin"
    for key in ("log_probs", "entropy"):
        assert a[key].shape == b[key].shape, key
        torch.testing.assert_close(a[key], b[key], rtol=2e-5, atol=2e-5, msg=lambda m, key=key: f"{key}: {m}")
    assert a["grads"].keys() == b["grads"].keys()
    attention = [n for n in a["grads"] if ".self_attention." in n and a["grads"][n] is not None]
    assert attention, "no attention parameter got a gradient"
    for name, ga in a["grads"].items():
        gb = b["grads"][name]
        assert (ga is None) == (gb is None), name
        if ga is not None:
            torch.testing.assert_close(ga, gb, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.gpu
def test_verls_engine_forward_on_te_specs_with_the_plugin_gpu(tmp_path):
    """On a GPU with TransformerEngine: verl's own engine forward on the model mbridge builds from
    TE's specs (DeepSeek-V3's head dims, bf16), without the plugin (TE's attention; the routes
    recorded) and with it (MLACoreAttention, verl_ops' drop-ins; the routes replayed): log-probs,
    entropy and every gradient within bf16 tolerance (relative norms, as tests/test_megatron_model.py's
    CUDA cases). Both runs' step times go to VERL_OPS_TEST_REPORT_DIR's verl_engine_forward_<megatron-core>.json
    (speed is a benchmark's to show, not a test's)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import importlib.util

    sys.path.insert(0, HERE)
    import megatron_model_lib as lib

    if importlib.util.find_spec("transformer_engine") is None:
        pytest.skip("needs TransformerEngine (benchmarks/device/te_setup.sh)")
    off_file, on_file = tmp_path / "off.pt", tmp_path / "on.pt"
    off, _ = run("engine_forward", VERL_OPS_PLUGIN="off", VERL_OPS_ENGINE_DEVICE="cuda",
                 VERL_OPS_ENGINE_OUT=str(off_file))
    on, _ = run("engine_forward", VERL_OPS_ENGINE_DEVICE="cuda", VERL_OPS_ENGINE_OUT=str(on_file),
                VERL_OPS_ENGINE_REPLAY=str(off_file))
    a, b = torch.load(on_file), torch.load(off_file)
    grad_errors = lib.grad_report(a["grads"], b["grads"])["errors"]
    folder = os.environ.get("VERL_OPS_TEST_REPORT_DIR")
    if folder:  # the run's numbers for its notes (step times included: shown, not asserted)
        summary = {
            name: {k: r[k] for k in ("te", "te_selected", "layers", "lengths", "step_ms", "log_probs_fn")}
            for name, r in (("plugin_on", on), ("plugin_off", off))
        }
        summary["rel_norm"] = {k: lib.rel_err(a[k], b[k]) for k in ("log_probs", "entropy") if a[k].shape == b[k].shape}
        summary["grad_rel_norm_max"] = max(grad_errors.values(), default=None)
        os.makedirs(folder, exist_ok=True)
        try:  # one file per megatron-core version (gpu_te.sh runs every version into one folder)
            from megatron.core import __version__ as version
        except Exception:  # noqa: BLE001
            version = "unknown"
        with open(os.path.join(folder, f"verl_engine_forward_{version}.json"), "w") as f:
            json.dump(summary, f, indent=1, default=str)
    assert off["te"] and on["te"], "TransformerEngine did not import in the scenario"
    assert off["layers"] == {"TEDotProductAttention": 2}, off["layers"]
    assert on["layers"] == {"MLACoreAttention": 2}, on["layers"]
    assert off["te_selected"] and (off["te_selected"]["flash"] or off["te_selected"]["fused"]), off["te_selected"]
    assert on["log_probs_fn"].startswith("verl_ops."), on["log_probs_fn"]
    assert on["param_sum"] == off["param_sum"], "the two processes built different weights"
    for key, tol in (("log_probs", 2e-2), ("entropy", 2e-2)):
        assert a[key].shape == b[key].shape, key
        assert lib.rel_err(a[key], b[key]) <= tol, f"{key}: relative difference {lib.rel_err(a[key], b[key]):.3g}"
    bad = {n: round(e, 4) for n, e in grad_errors.items() if e > 5e-2}
    assert not bad, f"gradients beyond 5e-2 relative: {bad}"
