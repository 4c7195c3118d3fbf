"""`holoserve compress` / `holoserve eval` end to end on a tiny BERT and synthetic GLUE rows.

Every written checkpoint is checked on the saved file (tests/compress_helpers.check_saved_checkpoint),
not on the in-memory model.
"""
import json
import os

import pytest
import torch

from holoserve.core.artifact import load_artifact

from holoserve.core.files import sha256_file
from holoserve.cli import main

from tests.helpers.checkpoints import check_saved_checkpoint, write_glue
from tests.helpers.tiny import make_tiny_bert

os.environ.setdefault("OMP_NUM_THREADS", "1")
STEPS = ["--max-steps", "12", "--threads", "1", "--no-progress"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipe")
    return {"root": root, "model": make_tiny_bert(root / "tiny", hidden=32, intermediate=64),
            "glue": write_glue(root / "glue")}


def compress(env, out, *extra):
    argv = ["compress", "--task", extra[0] if extra and not extra[0].startswith("-") else "sst2",
            "--data-dir", str(env["glue"]), "--out", str(out), "--model", str(env["model"]), *STEPS]
    argv += [x for x in extra if not (x == extra[0] and not x.startswith("-"))]
    return main(argv)


@pytest.fixture(scope="module")
def admm_ckpt(env):
    out = env["root"] / "admm"
    assert compress(env, out, "--method", "admm") == 0
    return out


def test_tensorrt_qat_stores_the_extra_ranges(env):
    """--set tensorrt_qat=true: QAT also quantizes Q/K/V outputs, the softmax and the residual-Add inputs
    whose INT8 SQNR clears the floor; the manifest carries their ranges for the TensorRT export, each
    residual input's SQNR, and the dev metric with those quantizers on."""
    out = env["root"] / "admm-trt"
    assert compress(env, out, "--tensorrt-qat") == 0
    check_saved_checkpoint(out)
    m = json.loads((out / "manifest.json").read_text())
    amax, layers = m["quantization"]["activations"]["amax"], m["sparsity"]["layers"]
    residual = [f"{n}.output" for n in layers if n.endswith(".output.dense")]
    residual += [f"{n[: -len('.dense')]}.residual" for n in layers if n.endswith(".output.dense")]
    rec = m["training"]["tensorrt_qat_residuals"]
    assert sorted(rec["sqnr_db"]) == sorted(residual) and rec["min_sqnr_db"] == 20.0
    assert rec["float"] == sorted(k for k in residual if rec["sqnr_db"][k] < 20.0)
    extra = [f"{n}.output" for n in layers if n.endswith((".query", ".key", ".value"))]
    extra += [f"{n[: -len('.query')]}.softmax" for n in layers if n.endswith(".query")]
    extra += [k for k in residual if k not in rec["float"]]
    assert sorted(amax) == sorted([f"{n}.input" for n in layers] + extra)
    assert m["training"]["preset_config"]["tensorrt_qat"] is True
    assert set(m["metrics"]["compressed_tensorrt"]) == set(m["metrics"]["compressed"])


def test_tensorrt_qat_without_qat_is_refused(env, capsys):
    """--tensorrt-qat with a method that runs no QAT would silently train nothing: a clear error instead."""
    for extra in (("--method", "magnitude"), ("--no-quant",)):
        assert compress(env, env["root"] / "never", "--tensorrt-qat", *extra) == 2
        err = capsys.readouterr().err
        assert "tensorrt_qat" in err and "--method oneshot or admm" in err
    assert not (env["root"] / "never").exists()


def test_admm_checkpoint_is_2to4_and_int8_on_disk(admm_ckpt):
    info = check_saved_checkpoint(admm_ckpt)
    assert info["layers"] == 12 and info["quantized"]
    assert info["zero_share"] >= 0.5
    m = json.loads((admm_ckpt / "manifest.json").read_text())
    assert m["metrics"]["primary"] == "accuracy"
    assert set(m["metrics"]["dense"]) == {"accuracy"} and set(m["metrics"]["compressed"]) == {"accuracy"}
    t = m["training"]
    assert t["method"] == "admm" and t["quant"] and t["distillation"] and t["preset"] == "quick"
    # budgets are epochs of the training rows (quick: 3 dense, 2 ADMM, 2 QAT), here capped by --max-steps 12
    per_epoch = -(-t["train_rows"] // 32)
    assert {"dense", "admm", "qat"} <= set(t["phases"])
    assert [t["phases"][k]["steps"] for k in ("dense", "admm", "qat")] == [min(12, n * per_epoch) for n in (3, 2, 2)]
    assert t["preset_config"]["admm"]["epochs"] == 2 and t["preset_config"]["admm"]["steps"] == min(12, 2 * per_epoch)
    assert t["phases"]["admm"]["penalty"] == "decoupled"
    assert "CPU" in t["machine"] and t["wall_seconds"] > 0
    assert t["device"] == ("cuda" if torch.cuda.is_available() else "cpu")  # --device auto
    amax = m["quantization"]["activations"]["amax"]
    assert sorted(amax) == sorted(f"{n}.input" for n in m["sparsity"]["layers"])
    assert m["dense_modules"] == ["embeddings", "LayerNorm", "pooler", "classifier"]
    load_artifact(admm_ckpt)  # the contract's own reader agrees


def test_eval_cli_reproduces_the_manifest_metric(admm_ckpt, env, capsys):
    assert main(["eval", str(admm_ckpt), "--task", "sst2", "--data-dir", str(env["glue"])]) == 0
    out = json.loads(capsys.readouterr().out)
    m = json.loads((admm_ckpt / "manifest.json").read_text())
    assert out["metrics"] == pytest.approx(m["metrics"]["compressed"], abs=1e-9)
    assert out["numerics"].startswith("int8 weights + int8 activations")
    assert out["rows"] == 48


def test_rerun_resumes_from_saved_state_and_is_deterministic(admm_ckpt, env, caplog):
    state = admm_ckpt.with_name("admm.state")
    assert (state / "teacher" / "teacher.json").is_file() and (state / "qat-done.json").is_file()
    # same job again: every phase is loaded from state, the result is bit-identical
    with caplog.at_level("INFO", logger="holoserve.compress"):
        assert compress(env, admm_ckpt, "--method", "admm", "--overwrite") == 0
    err = caplog.text
    assert "already trained" in err and "[admm] already done" in err and "[qat] already done" in err
    first = sha256_file(admm_ckpt / "model.safetensors")
    # a fresh run with the same seed (new out, new state) reproduces the same weights
    other = env["root"] / "admm-again"
    assert compress(env, other, "--method", "admm") == 0
    assert sha256_file(other / "model.safetensors") == first


def test_state_of_another_job_is_refused(admm_ckpt, env, capsys):
    rc = compress(env, env["root"] / "admm", "--method", "admm", "--overwrite", "--seed", "5")
    assert rc == 2 and "belongs to a different job" in capsys.readouterr().err


def test_state_saved_before_a_new_setting_existed_still_resumes(admm_ckpt, env, caplog):
    """A setting a later version adds, left unset, does not orphan the state an earlier version saved; set, the
    job is a different one."""
    job = admm_ckpt.with_name("admm.state") / "job.json"
    saved = json.loads(job.read_text())
    assert saved["preset"]["equal_time_step_seconds"] is None
    del saved["preset"]["equal_time_step_seconds"]
    job.write_text(json.dumps(saved))
    with caplog.at_level("INFO", logger="holoserve.compress"):
        assert compress(env, admm_ckpt, "--method", "admm", "--overwrite") == 0
    assert "[qat] already done" in caplog.text
    assert compress(env, admm_ckpt, "--method", "admm", "--overwrite", "--set", "equal_time_step_seconds=1") == 2


def test_no_quant_and_reused_teacher(admm_ckpt, env):
    out = env["root"] / "sparse"
    assert compress(env, out, "--no-quant", "--teacher", str(admm_ckpt.with_name("admm.state") / "teacher")) == 0
    info = check_saved_checkpoint(out)
    assert not info["quantized"]
    m = json.loads((out / "manifest.json").read_text())
    assert m["training"]["phases"]["dense"]["reused"] is True
    assert "masked" in m["training"]["phases"] and "qat" not in m["training"]["phases"]


def test_magnitude_baseline_with_ptq(admm_ckpt, env):
    out = env["root"] / "magnitude"
    assert compress(env, out, "--method", "magnitude", "--teacher",
                    str(admm_ckpt.with_name("admm.state") / "teacher")) == 0
    check_saved_checkpoint(out)
    m = json.loads((out / "manifest.json").read_text())
    assert m["training"]["method"] == "magnitude" and m["training"]["distillation"]  # same KD as ADMM
    assert {"one_shot", "sparse_fp32"} <= set(m["metrics"])


def test_ptq_of_a_sparse_checkpoint_keeps_its_zeros(admm_ckpt, env):
    sparse = env["root"] / "sparse-src"
    assert compress(env, sparse, "--no-quant", "--teacher", str(admm_ckpt.with_name("admm.state") / "teacher"),
                    "--max-steps", "4") == 0
    out = env["root"] / "ptq"
    assert main(["compress", "--task", "sst2", "--method", "ptq", "--model", str(sparse), "--data-dir",
                 str(env["glue"]), "--out", str(out), "--threads", "1", "--no-progress"]) == 0
    info = check_saved_checkpoint(out)
    assert info["quantized"]
    m = json.loads((out / "manifest.json").read_text())
    assert m["training"]["method"] == "ptq" and "source_fp32" in m["metrics"]


def test_ptq_of_a_dense_model_is_int8_only(admm_ckpt, env):
    out = env["root"] / "ptq-dense"
    teacher = admm_ckpt.with_name("admm.state") / "teacher"
    assert main(["compress", "--task", "sst2", "--method", "ptq", "--model", str(teacher), "--data-dir",
                 str(env["glue"]), "--out", str(out), "--threads", "1", "--no-progress"]) == 0
    art = load_artifact(out)
    assert art.quantized and art.sparse_layers == []


def test_pair_task_and_headerless_task(env):
    for task in ("mrpc", "cola"):
        out = env["root"] / task
        assert compress(env, out, task, "--max-steps", "4") == 0
        check_saved_checkpoint(out)
        m = json.loads((out / "manifest.json").read_text())
        assert m["task"]["name"] == task and m["task"]["pair"] is (task == "mrpc")
        assert m["metrics"]["primary"] == ("f1" if task == "mrpc" else "mcc")


def test_cli_errors_are_clear(env, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("HOLOSERVE_DATA_DIR", raising=False)
    assert main(["compress", "--task", "sst2", "--out", str(tmp_path / "x"), "--model", str(env["model"])]) == 2
    assert "--data-dir" in capsys.readouterr().err
    assert main(["compress", "--task", "nope", "--data-dir", str(env["glue"]), "--out", str(tmp_path / "y")]) == 2
    assert "unknown task" in capsys.readouterr().err
    assert main(["compress", "--method", "ptq", "--data-dir", str(env["glue"]), "--out", str(tmp_path / "z")]) == 2
    assert "needs --model" in capsys.readouterr().err
    assert main(["eval", str(tmp_path / "missing"), "--data-dir", str(env["glue"])]) == 2
    assert "does not exist" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert compress(env, tmp_path / "gpu", "--device", "cuda") == 2
        assert "--device cuda: torch sees no CUDA GPU" in capsys.readouterr().err


def test_fp16_carried_base_model_loads_as_float32(env, tmp_path):
    """bench/gpu/bundle_train.py ships the base model's weights as FP16; compress trains in float32."""
    from safetensors import safe_open

    from holoserve.compress.context import load_hf_classifier
    from holoserve.data.tasks import get_task

    from tests.helpers.bench import gpu_module

    mod = gpu_module("bundle_train")
    out = tmp_path / "carry"
    assert mod.main(["--data-dir", str(env["glue"]), "--tasks", "sst2", "--model", str(env["model"]),
                     "--out", str(out)]) == 0
    assert (out / "glue" / "SST-2" / "train.tsv").is_file() and (out / "glue" / "SST-2" / "dev.tsv").is_file()
    with safe_open(str(out / "base" / "model.safetensors"), "np") as f:
        dtypes = {str(f.get_tensor(k).dtype) for k in f.keys()}
    assert "float16" in dtypes and "float32" not in dtypes
    model = load_hf_classifier(out / "base", get_task("sst2"))
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def _no_nan(token):
    raise AssertionError(f"{token} in a manifest: not valid JSON")


def test_skipped_admm_phase_projects_the_teacher_and_writes_strict_json(admm_ckpt, env, caplog):
    """--set admm.steps=0: the teacher is projected onto 2:4 ∩ INT8 and QAT follows; the skipped
    phase has no loss (null, not NaN, which strict JSON readers reject)."""
    out = env["root"] / "admm0"
    with caplog.at_level("INFO"):
        assert compress(env, out, "--method", "admm", "--set", "admm.steps=0", "--teacher",
                        str(admm_ckpt.with_name("admm.state") / "teacher")) == 0
    info = check_saved_checkpoint(out)
    assert info["layers"] == 12 and info["quantized"]
    m = json.loads((out / "manifest.json").read_text(), parse_constant=_no_nan)
    assert m["training"]["phases"]["admm"]["steps"] == 0 and m["training"]["phases"]["admm"]["loss"] is None
    assert isinstance(m["training"]["phases"]["qat"]["loss"], float)
    assert "[admm] steps=0 loss=n/a" in caplog.text


def test_oneshot_baseline_spends_the_admm_budget_on_qat_with_distillation(admm_ckpt, env):
    """The default method, oneshot: the teacher projected once onto 2:4 ∩ INT8, then QAT with KD for the
    ADMM + QAT steps."""
    out = env["root"] / "oneshot"
    teacher = admm_ckpt.with_name(admm_ckpt.name + ".state") / "teacher"
    assert compress(env, out, "--teacher", str(teacher)) == 0  # no --method: the default
    info = check_saved_checkpoint(out)
    assert info["quantized"] and info["layers"] == 12
    t = json.loads((out / "manifest.json").read_text())["training"]
    admm = json.loads((admm_ckpt / "manifest.json").read_text())["training"]["phases"]
    assert t["method"] == "oneshot" and t["distillation"] is True
    # the recipe names what ran, and no ADMM
    assert t["recipe"].startswith("one-shot projection onto 2:4 ∩ INT8") and "ADMM" not in t["recipe"]
    assert "projection=obs" in t["recipe"] and "QAT with distillation" in t["recipe"]
    assert t["phases"]["admm"]["steps"] == 0
    assert t["phases"]["qat"]["steps"] == admm["admm"]["steps"] + admm["qat"]["steps"]


@pytest.mark.parametrize("method", ["oneshot", "admm"])
def test_activation_aware_masks(admm_ckpt, env, caplog, method):
    """--set mask_metric=activation: 2:4 masks scored by |w| x input-channel norm; the checkpoint keeps the
    contract, and the mask differs from the magnitude one (the tiny model's inputs are far from uniform)."""
    teacher = admm_ckpt.with_name(admm_ckpt.name + ".state") / "teacher"
    outs = {}
    for metric in ("magnitude", "activation"):
        outs[metric] = env["root"] / f"mask-{method}-{metric}"
        with caplog.at_level("INFO"):
            assert compress(env, outs[metric], "--method", method, "--teacher", str(teacher),
                            "--set", f"mask_metric={metric}") == 0
        check_saved_checkpoint(outs[metric])
    assert "activation-aware 2:4 masks" in caplog.text
    m = json.loads((outs["activation"] / "manifest.json").read_text())
    assert m["training"]["preset_config"]["mask_metric"] == "activation"
    from safetensors.torch import load_file

    a, b = (load_file(str(outs[k] / "model.safetensors")) for k in ("activation", "magnitude"))
    layer = next(k for k in a if k.endswith("attention.self.query.weight"))
    assert not torch.equal(a[layer] != 0, b[layer] != 0)


def test_mask_activation_power_weighs_the_input_norms(admm_ckpt, env, caplog):
    """mask_activation_power scores by |w| x ||x|| ** power: power 0 gives exactly the magnitude mask (the tiny
    model's activation-aware mask differs from it, test above), 0.5 is logged as such."""
    from safetensors.torch import load_file

    teacher = admm_ckpt.with_name(admm_ckpt.name + ".state") / "teacher"
    masks = {}
    for name, sets in (("magnitude", ["mask_metric=magnitude"]), ("power0", ["mask_activation_power=0"]),
                       ("power05", ["mask_activation_power=0.5"])):
        out = env["root"] / f"mask-power-{name}"
        with caplog.at_level("INFO"):
            assert compress(env, out, "--method", "oneshot", "--teacher", str(teacher),
                            *[a for x in sets for a in ("--set", x)]) == 0
        w = load_file(str(out / "model.safetensors"))
        masks[name] = {k: v != 0 for k, v in w.items() if k.endswith(".weight") and "encoder" in k and v.dim() == 2
                       and "LayerNorm" not in k}
    assert masks["power0"].keys() == masks["magnitude"].keys() and len(masks["magnitude"]) == 12
    assert all(torch.equal(masks["power0"][k], masks["magnitude"][k]) for k in masks["magnitude"])
    assert "input-channel norm ^ 0.5 over" in caplog.text


def test_negative_mask_activation_power_is_refused(admm_ckpt, env, capsys):
    teacher = admm_ckpt.with_name(admm_ckpt.name + ".state") / "teacher"
    assert compress(env, env["root"] / "bad-power", "--teacher", str(teacher), "--set", "mask_activation_power=-1") != 0
    assert "mask_activation_power=-1.0: use a number >= 0" in capsys.readouterr().err


def test_unknown_mask_metric_is_refused(admm_ckpt, env, capsys):
    teacher = admm_ckpt.with_name(admm_ckpt.name + ".state") / "teacher"
    assert compress(env, env["root"] / "bad-metric", "--teacher", str(teacher), "--set", "mask_metric=wanda") != 0
    assert "mask_metric='wanda': choose activation, magnitude or saliency" in capsys.readouterr().err


@pytest.mark.parametrize("metric", ["activation", "saliency"])
def test_obs_projection(admm_ckpt, env, caplog, metric):
    """projection=obs (the default): the one-shot projection updates the kept weights (SparseGPT's compensation),
    with the default masks or SparseGPT's saliency ones; the checkpoint keeps the contract and records the choice."""
    from safetensors.torch import load_file

    teacher = admm_ckpt.with_name(admm_ckpt.name + ".state") / "teacher"
    out = env["root"] / f"obs-{metric}"
    with caplog.at_level("INFO"):
        assert compress(env, out, "--teacher", str(teacher), "--set", "projection=obs",
                        "--set", f"mask_metric={metric}") == 0
    check_saved_checkpoint(out)
    assert f"OBS 2:4 projection (masks by {'SparseGPT saliency' if metric == 'saliency' else metric})" in caplog.text
    assert "hard 2:4 ∩ INT8 projection (obs)" in caplog.text
    training = json.loads((out / "manifest.json").read_text())["training"]
    cfg, proj = training["preset_config"], training["phases"]["projection"]
    assert cfg["projection"] == "obs" and cfg["mask_metric"] == metric
    assert proj["method"] == "obs" and len(proj["layers"]) == 12 and proj["heldout_batches"] == proj["calib_batches"]
    assert all(0 < d["fit_vs_nearest"] < 1 and d["heldout_vs_nearest"] > 0 and d["heldout_relative"] > 0
               for d in proj["layers"].values())
    if metric == "activation":  # the default's masks (tests/unit/compress/test_qat.py), other weights
        ref = env["root"] / "obs-ref"
        assert compress(env, ref, "--teacher", str(teacher), "--set", "projection=nearest") == 0
        a, b = load_file(str(out / "model.safetensors")), load_file(str(ref / "model.safetensors"))
        layer = next(k for k in a if k.endswith("attention.self.query.weight"))
        assert not torch.equal(a[layer], b[layer])


def _projected(admm_ckpt, env, caplog, folder: str, projection: str):
    """(checkpoint, teacher, manifest) of a compress run from the ADMM checkpoint's teacher with `projection`,
    its log in `caplog`; the checkpoint keeps the contract."""
    teacher = admm_ckpt.with_name(admm_ckpt.name + ".state") / "teacher"
    out = env["root"] / folder
    with caplog.at_level("INFO"):
        assert compress(env, out, "--teacher", str(teacher), "--set", f"projection={projection}") == 0
    check_saved_checkpoint(out)
    return out, teacher, json.loads((out / "manifest.json").read_text())


def test_admm_projection_is_2to4_int8_records_each_layer_and_resumes_identically(admm_ckpt, env, caplog):
    """projection=admm: the layer-wise ADMM solve onto 2:4 ∩ INT8 (masks free to move), then QAT; the checkpoint
    keeps the contract, the manifest holds each Linear's held-out reconstruction error, and the same job again
    (resumed from its state, and fresh in a new folder) writes a byte-identical model."""
    out, teacher, m = _projected(admm_ckpt, env, caplog, "admm-projection", "admm")
    assert "ADMM 2:4 projection (masks by activation)" in caplog.text
    proj = m["training"]["phases"]["projection"]
    assert proj["method"] == "admm" and len(proj["layers"]) == 12
    assert all(d["iters"] >= 1 and 0 < d["fit_vs_nearest"] < 1 and d["heldout_relative"] > 0
               for d in proj["layers"].values())
    assert "after_projection" in m["metrics"]
    first = sha256_file(out / "model.safetensors")
    assert compress(env, out, "--teacher", str(teacher), "--set", "projection=admm", "--overwrite") == 0
    assert sha256_file(out / "model.safetensors") == first
    again = env["root"] / "admm-projection-again"
    assert compress(env, again, "--teacher", str(teacher), "--set", "projection=admm") == 0
    assert sha256_file(again / "model.safetensors") == first


def test_admm_on_the_default_mask_projection(admm_ckpt, env, caplog):
    """projection=admm_fixed_mask: ADMM on the default's masks, fitted on projection_batches (64 unless set) with
    the damping 0.1, then the default's QAT; the masks never move, the checkpoint keeps the contract, and the
    manifest records what ran (activation ranges still from calib_batches)."""
    out, teacher, m = _projected(admm_ckpt, env, caplog, "admm-fixed-mask", "admm_fixed_mask")
    assert ("ADMM_FIXED_MASK 2:4 projection (masks by activation) over 64 calibration batches, damping 0.1"
            in caplog.text)
    t = m["training"]
    proj = t["phases"]["projection"]
    assert t["method"] == "oneshot" and proj["method"] == "admm_fixed_mask"
    assert proj["calib_batches"] == 64 and proj["damp"] == 0.1 and proj["heldout_batches"] == 16
    assert t["preset_config"]["calib_batches"] == 16 and "admm_fixed_mask" in t["recipe"]
    assert all(d["mask_moved_vs_start"] == 0 and d["iters"] >= 1 and 0 <= d["rows_from_iterations"] <= 1
               for d in proj["layers"].values())
    caplog.clear()
    other = env["root"] / "admm-fixed-mask-8"
    with caplog.at_level("INFO"):
        assert compress(env, other, "--teacher", str(teacher), "--set", "projection=admm_fixed_mask",
                        "--set", "projection_batches=8", "--set", "projection_damp=1.0") == 0
    assert "over 8 calibration batches, damping 1" in caplog.text


def test_admm_stable_mask_projection(admm_ckpt, env, caplog):
    """projection=admm_stable: ADMM with the mask free to move from the default's, held by the hysteresis
    projection_tau, fitted as admm_fixed_mask is (64 batches, damping 0.1), then the default's QAT; the manifest
    records the tau, and a larger tau moves no more of the mask."""
    from holoserve.compress.config import STABLE_TAU

    out, teacher, m = _projected(admm_ckpt, env, caplog, "admm-stable", "admm_stable")
    assert "ADMM_STABLE 2:4 projection (masks by activation) over 64 calibration batches, damping 0.1" in caplog.text
    t = m["training"]
    proj = t["phases"]["projection"]
    assert t["method"] == "oneshot" and proj["method"] == "admm_stable"
    assert f"hysteresis of {STABLE_TAU:g} toward that mask" in t["recipe"]
    loose = sum(d["mask_moved_vs_start"] for d in proj["layers"].values())
    tight = env["root"] / "admm-stable-tight"
    assert compress(env, tight, "--teacher", str(teacher), "--set", "projection=admm_stable",
                    "--set", "projection_tau=1000") == 0
    layers = json.loads((tight / "manifest.json").read_text())["training"]["phases"]["projection"]["layers"]
    assert sum(d["mask_moved_vs_start"] for d in layers.values()) <= loose
    assert all(d["mask_moved_vs_start"] == 0 for d in layers.values())


def test_equal_time_gives_up_the_slower_projections_extra_seconds_in_qat(admm_ckpt, env, caplog):
    """equal_time_step_seconds (the paired benchmark's rule): a projection other than obs times the default (obs)
    projection on a copy of the model, and QAT gives up round(extra seconds / step seconds) of its steps, as the
    projection's record says; the state folder keeps them, so a resumed run trains the same schedule; obs itself
    trains all its steps."""
    teacher = admm_ckpt.with_name(admm_ckpt.name + ".state") / "teacher"
    base = env["root"] / "equal-time-obs"
    with caplog.at_level("INFO"):
        assert compress(env, base, "--teacher", str(teacher), "--set", "equal_time_step_seconds=0.001") == 0
    assert "[equal-time]" not in caplog.text
    phases = json.loads((base / "manifest.json").read_text())["training"]["phases"]
    total = phases["qat"]["steps"]
    assert "equal_time" not in phases["projection"] and total > 1
    out = env["root"] / "equal-time-admm"
    args = ("--teacher", str(teacher), "--set", "projection=admm_fixed_mask", "--set", "equal_time_step_seconds=0.001")
    caplog.clear()
    with caplog.at_level("INFO"):
        assert compress(env, out, *args) == 0
    assert "[equal-time] timing the default projection (obs)" in caplog.text
    phases = json.loads((out / "manifest.json").read_text())["training"]["phases"]
    e = phases["projection"]["equal_time"]
    assert e["reference"] == "obs" and e["reference_seconds"] > 0 and e["step_seconds"] == 0.001
    assert e["projection_seconds"] == phases["projection"]["seconds"]
    over = max(0.0, e["projection_seconds"] - e["reference_seconds"])
    assert e["steps_given_up"] == min(total, round(over / 0.001))
    assert phases["qat"]["steps"] == total - e["steps_given_up"] == e["qat_steps"]
    state = out.with_name(out.name + ".state")
    kept = json.loads((state / "equal-time.json").read_text())
    (state / "equal-time.json").write_text(json.dumps({**kept, "steps_given_up": 1}))
    for f in state.glob("qat-done*"):
        f.unlink()
    caplog.clear()
    with caplog.at_level("INFO"):
        assert compress(env, out, *args, "--overwrite") == 0
    assert "timing the default projection" not in caplog.text
    phases = json.loads((out / "manifest.json").read_text())["training"]["phases"]
    assert phases["qat"]["steps"] == total - 1 and phases["projection"]["equal_time"]["steps_given_up"] == 1
    assert compress(env, env["root"] / "never", *args[:2], "--set", "equal_time_step_seconds=0") == 2


def test_bad_projection_fit_settings_are_refused(admm_ckpt, env, capsys):
    teacher = admm_ckpt.with_name(admm_ckpt.name + ".state") / "teacher"
    for setting, said in (("projection_damp=-1", "projection_damp=-1.0"),
                          ("projection_batches=0", "projection_batches=0")):
        assert compress(env, env["root"] / "never", "--teacher", str(teacher), "--set", setting) == 2
        assert said in capsys.readouterr().err
    assert compress(env, env["root"] / "never", "--teacher", str(teacher), "--set", "projection=admm_fixed_mask",
                    "--set", "mask_metric=saliency") == 2
    assert "mask metric's mask" in capsys.readouterr().err
    assert compress(env, env["root"] / "never", "--teacher", str(teacher), "--set", "projection=admm_stable",
                    "--set", "projection_tau=-1") == 2
    assert "projection_tau=-1" in capsys.readouterr().err
    assert not (env["root"] / "never").exists()


def test_admm_guided_keeps_admm_on_through_qat_and_resumes_identically(admm_ckpt, env, caplog):
    """--method admm_guided: the layer-wise ADMM projection, then QAT with the ADMM penalty on (Z/U updated on a
    cadence, the masks at the end Z's, which may differ from the projection's); the checkpoint keeps the
    contract, and the same job resumed from its state, or fresh in a new folder, writes the same bytes."""
    teacher = admm_ckpt.with_name(admm_ckpt.name + ".state") / "teacher"
    out = env["root"] / "admm-guided"
    args = ("--method", "admm_guided", "--teacher", str(teacher), "--set", "admm_cfg.interval=3",
            "--set", "admm_cfg.guide_rho=0.05")
    with caplog.at_level("INFO"):
        assert compress(env, out, *args) == 0
    check_saved_checkpoint(out)
    assert "ADMM 2:4 projection" in caplog.text
    m = json.loads((out / "manifest.json").read_text())
    qat = m["training"]["phases"]["qat"]
    assert m["training"]["phases"]["projection"]["method"] == "admm" and m["training"]["method"] == "admm_guided"
    assert qat["admm_guided"] and qat["steps"] > 0 and qat["z_updates"] == int(0.8 * qat["steps"]) // 3
    first = sha256_file(out / "model.safetensors")
    assert compress(env, out, *args, "--overwrite") == 0
    assert sha256_file(out / "model.safetensors") == first
    again = env["root"] / "admm-guided-again"
    assert compress(env, again, *args) == 0
    assert sha256_file(again / "model.safetensors") == first


@pytest.mark.parametrize("sets, message", [
    (["mask_metric=saliency", "projection=nearest"],
     "mask_metric=saliency is SparseGPT's score, known only inside the one-time OBS"),
    (["projection=exact"], "projection='exact': choose one of nearest, obs, admm"),
])
def test_bad_projection_settings_are_refused(env, capsys, sets, message):
    """Refused before any work: no teacher is trained, no state is written."""
    out = env["root"] / f"bad-projection-{len(message)}"
    assert compress(env, out, *[a for x in sets for a in ("--set", x)]) != 0
    assert message in capsys.readouterr().err
    assert not out.exists() and not out.with_name(out.name + ".state").exists()


def test_admm_refuses_saliency_masks(admm_ckpt, env, capsys):
    """ADMM's Z-steps need a mask score of their own; SparseGPT's exists only inside the OBS projection."""
    teacher = admm_ckpt.with_name(admm_ckpt.name + ".state") / "teacher"
    assert compress(env, env["root"] / "bad-admm", "--method", "admm", "--teacher", str(teacher),
                    "--set", "mask_metric=saliency") != 0
    assert "mask_metric=saliency is SparseGPT's score" in capsys.readouterr().err


def test_admm_can_start_from_the_hard_projection(admm_ckpt, env, capsys):
    """admm_cfg.init=projection: W starts on 2:4 ∩ INT8 (the teacher's OBS projection), so the ADMM phase
    starts from what one-shot would train; the run records where it started, the checkpoint is 2:4 ∩ INT8."""
    teacher = admm_ckpt.with_name(admm_ckpt.name + ".state") / "teacher"
    out = env["root"] / "admm-from-projection"
    assert compress(env, out, "--method", "admm", "--teacher", str(teacher), "--set", "projection=obs",
                    "--set", "admm_cfg.init=projection") == 0
    check_saved_checkpoint(out)
    admm = json.loads((out / "manifest.json").read_text())["training"]["phases"]["admm"]
    assert admm["init"] == "projection" and admm["steps"] > 0 and "dev_at_start" in admm
    plain = json.loads((admm_ckpt / "manifest.json").read_text())["training"]["phases"]["admm"]
    assert plain["init"] == "teacher" and "dev_at_start" not in plain
    assert compress(env, env["root"] / "bad-init", "--method", "admm", "--teacher", str(teacher),
                    "--set", "admm_cfg.init=random") != 0
    assert "admm_cfg.init='random': choose one of teacher, projection" in capsys.readouterr().err
    assert not (env["root"] / "bad-init").exists()


def test_distillation_can_read_perturbed_copies_of_the_rows(admm_ckpt, env, capsys):
    """distill.augment=N: the distilling phases also read N perturbed copies of each training row,
    labelled only by the teacher; the step count stays the real rows'. Bad settings are refused before
    any training."""
    teacher = admm_ckpt.with_name(admm_ckpt.name + ".state") / "teacher"
    out = env["root"] / "augmented"
    assert compress(env, out, "--teacher", str(teacher), "--set", "distill.augment=2") == 0
    check_saved_checkpoint(out)
    training = json.loads((out / "manifest.json").read_text())["training"]
    qat = training["phases"]["qat"]
    plain = json.loads((admm_ckpt / "manifest.json").read_text())["training"]["phases"]
    assert qat["teacher_only_rows"] == 2 * training["train_rows"] and "teacher_only_rows" not in plain["qat"]
    # one-shot's QAT: the ADMM + QAT budget, rows aside
    assert qat["steps"] == plain["admm"]["steps"] + plain["qat"]["steps"]
    for setting, message in (("distill.augment=-1", "distill.augment=-1: the number of perturbed copies"),
                             ("distill.augment_rate=0", "distill.augment_rate=0.0: use a per-token probability")):
        assert compress(env, env["root"] / "bad-augment", "--teacher", str(teacher), "--set", "distill.augment=1",
                        "--set", setting) != 0
        assert message in capsys.readouterr().err
    assert compress(env, env["root"] / "bad-augment", "--teacher", str(teacher), "--set", "distill.augment=1",
                    "--set", "distill.enabled=false") != 0
    assert "distill.augment needs distillation" in capsys.readouterr().err
    assert not (env["root"] / "bad-augment").exists()


def test_the_student_can_swap_gelu_for_relu(admm_ckpt, env, capsys):
    """activation=relu, activation_ramp=0: the student (not the teacher) computes ReLU in its FFN from the
    projection on; the checkpoint says so in config.json, `holoserve eval` reproduces its metric, and the export
    computes ReLU (no Erf left) with every prediction as in `holoserve eval`."""
    import onnx

    teacher = admm_ckpt.with_name(admm_ckpt.name + ".state") / "teacher"
    out = env["root"] / "relu"
    assert compress(env, out, "--teacher", str(teacher), "--set", "activation=relu", "--set", "activation_ramp=0") == 0
    capsys.readouterr()
    check_saved_checkpoint(out)
    assert json.loads((out / "config.json").read_text())["hidden_act"] == "relu"
    assert json.loads((teacher / "config.json").read_text())["hidden_act"] == "gelu"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["training"]["preset_config"]["activation"] == "relu"
    assert main(["eval", str(out), "--data-dir", str(env["glue"])]) == 0
    assert json.loads(capsys.readouterr().out)["metrics"] == pytest.approx(manifest["metrics"]["compressed"], abs=1e-9)
    assert main(["export", str(out), "--target", "onnxruntime", "--data-dir", str(env["glue"])]) == 0
    capsys.readouterr()
    ops = {n.op_type for n in onnx.load(str(out / "model.onnx")).graph.node}
    assert "Relu" in ops and "Erf" not in ops
    assert main(["eval", str(out), "--data-dir", str(env["glue"]), "--backend", "onnxruntime", "--compare",
                 "--threads", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["compare"]["different_predictions"] == 0
    assert compress(env, env["root"] / "bad-act", "--teacher", str(teacher), "--set", "activation=silu") != 0
    assert "activation='silu': choose one of gelu, relu" in capsys.readouterr().err
    assert not (env["root"] / "bad-act").exists()


def test_the_activation_ramp_moves_the_student_to_relu_during_qat(admm_ckpt, env, capsys, caplog):
    """activation=relu ramps by default (activation_ramp unset: half of QAT): the projection and calibration
    see the teacher's GELU (the same projected model as the plain GELU student's), QAT moves the FFN to ReLU
    over its first half, and the checkpoint is the ReLU model `holoserve eval` reproduces. A method without
    QAT swaps before it starts; settings that cannot ramp are refused before any work."""
    import logging

    teacher = admm_ckpt.with_name(admm_ckpt.name + ".state") / "teacher"
    gelu, ramped = env["root"] / "ramp-gelu", env["root"] / "ramp-relu"
    assert compress(env, gelu, "--teacher", str(teacher)) == 0
    with caplog.at_level(logging.INFO, logger="holoserve"):
        assert compress(env, ramped, "--teacher", str(teacher), "--set", "activation=relu") == 0
    capsys.readouterr()
    check_saved_checkpoint(ramped)
    assert json.loads((ramped / "config.json").read_text())["hidden_act"] == "relu"
    m, g = (json.loads((d / "manifest.json").read_text()) for d in (ramped, gelu))
    qat = m["training"]["phases"]["qat"]
    assert qat["activation_ramp_steps"] == 10 and qat["steps"] == 20  # half of one-shot's 10 + 10 QAT steps
    assert "the FFN activation moves to relu over the first 10 of 20 steps" in caplog.text
    assert m["training"]["preset_config"]["activation_ramp"] is None  # the default, recorded as such
    # projected and calibrated with the teacher's GELU: the same activation ranges as the GELU student's
    assert m["quantization"]["activations"]["amax"] == g["quantization"]["activations"]["amax"]
    assert m["metrics"]["after_projection"] == g["metrics"]["after_projection"]
    assert main(["eval", str(ramped), "--data-dir", str(env["glue"])]) == 0
    assert json.loads(capsys.readouterr().out)["metrics"] == pytest.approx(m["metrics"]["compressed"], abs=1e-9)
    magnitude = env["root"] / "ramp-magnitude"
    assert compress(env, magnitude, "--teacher", str(teacher), "--method", "magnitude", "--set", "activation=relu") == 0
    assert json.loads((magnitude / "config.json").read_text())["hidden_act"] == "relu"
    assert "activation_ramp_steps" not in json.dumps(json.loads((magnitude / "manifest.json").read_text()))
    capsys.readouterr()
    for extra, message in ((["--set", "activation_ramp=0.5"], "activation_ramp needs activation"),
                           (["--set", "activation=relu", "--set", "activation_ramp=1.5"], "activation_ramp=1.5: use"),
                           (["--set", "activation=relu", "--set", "activation_ramp=0.5", "--method", "magnitude"],
                            "--method magnitude has no QAT phase")):
        assert compress(env, env["root"] / "bad-ramp", "--teacher", str(teacher), *extra) != 0
        assert message in capsys.readouterr().err
    assert not (env["root"] / "bad-ramp").exists()
