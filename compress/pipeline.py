"""`holoserve compress`: one request, one checkpoint. The pipeline checks the request, reads and encodes the
rows (choosing max_seq_length from them), hands the run's frozen context (compress/context.py) to the
method's handler (compress/methods.py) and writes the checkpoint the handler's result describes. The methods:
  oneshot      the default: dense teacher -> one-shot projection onto 2:4 ∩ INT8 -> QAT with distillation
  admm         dense teacher -> ADMM toward 2:4 ∩ INT8 with distillation -> hard projection + QAT
  admm_guided  dense teacher -> layer-wise ADMM projection -> QAT with distillation and the ADMM penalty kept on
  magnitude    one-shot magnitude 2:4 + masked fine-tune, then post-training INT8 (the APEX ASP recipe)
  ptq          post-training INT8 of an existing model
Each phase saves its result under the state folder (`<out>.state/` by default), so an interrupted
run resumes where it stopped; a phase also saves mid-way every `preset.save_every` steps.
"""
from __future__ import annotations

import logging
import math
import shutil
import time
from dataclasses import replace
from pathlib import Path

import torch

from holoserve import HoloServeError
from holoserve.core.artifact import Artifact, load_artifact
from holoserve.core.machine import describe_cpu
from holoserve.core.progress import Progress
from holoserve.core.progress import current as current_progress
from holoserve.core.tokenizer import load_tokenizer
from holoserve.data.sources import DataOptions, load_for_training

from .checkpoint import CheckpointContents, save_checkpoint
from .config import ADMM_INITS, PROJECTIONS, STUDENT_ACTIVATIONS, Preset, apply_overrides, get_preset
from .context import CompressedModel, CompressionContext, CompressRequest, ModelSource, RunRecord, planned_cost
from .data import encode, with_perturbed_copies
from .distributed import Processes, resolve_device
from .methods import get_method
from .seqlen import UNBOUNDED, model_positions, token_lengths
from .seqlen import choose as choose_length

log = logging.getLogger("holoserve.compress")


def machine() -> str:
    desc = describe_cpu()
    if torch.cuda.is_available():
        desc = f"{torch.cuda.get_device_name(0)} GPU + {desc}"
    return desc


def check_preset_settings(preset: Preset, method: str) -> None:
    """Refuse preset settings no phase can honour (masks, projection, ADMM start, augmentation), before
    the teacher is trained."""
    if preset.projection not in PROJECTIONS:
        raise HoloServeError(f"projection={preset.projection!r}: choose one of {', '.join(PROJECTIONS)}")
    damp, batches = preset.projection_fit()
    if not (math.isfinite(damp) and damp >= 0):
        raise HoloServeError(f"projection_damp={damp}: use a number >= 0 (added to each layer Hessian's diagonal, "
                             "relative to its mean, e.g. 0.01 or 0.1)")
    if batches < 1:
        raise HoloServeError(f"projection_batches={batches}: the projection needs 1 calibration batch or more")
    if preset.projection in ("admm_fixed_mask", "admm_stable") and preset.mask_metric == "saliency":
        raise HoloServeError(f"projection={preset.projection} starts from the mask metric's mask: use "
                             "mask_metric=activation or magnitude (saliency is chosen inside the OBS projection)")
    if not (math.isfinite(preset.stable_tau()) and preset.stable_tau() >= 0):
        raise HoloServeError(f"projection_tau={preset.projection_tau}: use a number >= 0 (0: the mask moves freely; "
                             "larger keeps more of the mask metric's mask)")
    q = preset.equal_time_step_seconds
    if q is not None and not (math.isfinite(q) and q > 0):
        raise HoloServeError(f"equal_time_step_seconds={q}: use the default recipe's QAT seconds per step (> 0), "
                             "or leave it unset")
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
        raise HoloServeError(f"activation_ramp moves the activation during QAT, and --method {method} "
                             "has no QAT phase: "
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


def planned_work(request: CompressRequest, preset: Preset, dev_rows: int) -> float:
    """A run's work in overall progress units: its training steps, evaluations, calibration passes and
    projection, counted as compress/methods.py runs them (an estimate: the bar grows if it is short)."""
    p, r = preset, request
    steps = sum(n for _, n in planned_phases(r, p) if isinstance(n, int))
    trt = 1 if p.tensorrt_qat else 0
    masks = 1 if p.mask_metric == "activation" else 0
    project = 1 if p.projection != "nearest" else 0
    evals, calibrations, projections = {
        "oneshot": (4 + trt, masks + 1 + trt, project),
        "admm_guided": (4 + trt, masks + 1 + trt, 1),
        "admm": (5 + trt + (p.admm_cfg.init == "projection"), 2 * masks + 1 + int(p.admm_cfg.act_quant) + trt,
                 project * (1 + (p.admm_cfg.init == "projection"))),
        "magnitude": (4 + (1 if r.quant else 0), 1, 0),
        "ptq": (2, 1, 0),
    }.get(r.method, (1, 1, 0))
    eval_batches = math.ceil(dev_rows / p.eval_batch_size)
    return (steps + evals * eval_batches * planned_cost(p, "evaluation")
            + calibrations * planned_cost(p, "calibration") + projections * planned_cost(p, "projection"))


def planned_phases(request: CompressRequest, preset: Preset) -> list[tuple[str, int | str]]:
    """The training phases the request's method runs, in order, with their optimizer steps (as
    compress/methods.py runs them: one-shot and magnitude spend the ADMM + QAT budget in one phase)."""
    p, r = preset, request
    if r.method == "ptq":
        return []
    last = "qat" if r.quant else "masked"
    dense: list[tuple[str, int | str]] = [("dense", "reused --teacher" if r.teacher else p.dense.steps)]
    if r.method == "admm":
        return dense + [("admm", p.admm.steps), (last, p.qat.steps)]
    if r.method == "magnitude":
        return dense + [("masked", p.admm.steps + p.qat.steps)]
    # oneshot, admm_guided: the projection, then QAT for both budgets
    return dense + [(last, p.admm.steps + p.qat.steps)]


class CompressionPipeline:
    """One `holoserve compress` run: the request checked, the rows read into the run's context, the method's
    handler run on it, the checkpoint written."""

    def __init__(self, request: CompressRequest):
        self.request = request
        # phases are in epochs until the rows are read; load_data fixes their step counts
        self.preset: Preset = apply_overrides(get_preset(request.preset), list(request.overrides))
        self.method = get_method(request.method)
        request.validate()
        if self.preset.tensorrt_qat and not (request.quant and self.method.qat):
            raise HoloServeError(f"tensorrt_qat trains the TensorRT placement's quantizers during QAT, which --method "
                                 f"{request.method}{' --no-quant' if not request.quant else ''} does not run: use "
                                 "--method oneshot or admm with INT8, or leave tensorrt_qat off")
        check_preset_settings(self.preset, request.method)
        self.out = Path(request.out)
        self.state_dir = (Path(request.state_dir) if request.state_dir
                          else self.out.with_name(self.out.name + ".state"))
        if request.restart and self.state_dir.exists():
            shutil.rmtree(self.state_dir)
        self.t_start = time.perf_counter()
        self.procs = Processes(resolve_device(request.device))
        if not self.procs.main:  # one voice: the main process logs and shows progress
            logging.getLogger("holoserve").setLevel(logging.WARNING)
        torch.manual_seed(request.seed)

    # -- data
    def load_data(self, source: ModelSource) -> CompressionContext:
        """Read the rows, choose max_seq_length from them (compress.seqlen), tokenize, size the phases: the
        run's context."""
        p, r = self.preset, self.request
        tokenizer_dir = source.tokenizer_dir
        data = load_for_training(r.task, r.data or DataOptions(data_dir=r.data_dir), metric=r.metric, seed=r.seed,
                                 train_limit=r.train_limit, dev_limit=r.dev_limit)
        task = data.task
        if "held out" in str(data.info.get("dev")):
            log.info("no --dev file: %s", data.info["dev"])
        lengths = token_lengths(load_tokenizer(tokenizer_dir, UNBOUNDED), data.train)
        seq_length = choose_length(lengths, cap=p.max_seq_length, positions=model_positions(tokenizer_dir),
                                   fixed=r.max_seq_length)
        p = replace(p, max_seq_length=seq_length.value)
        tok = load_tokenizer(tokenizer_dir, p.max_seq_length)
        train = encode(tok, data.train, task.is_regression)
        dev = encode(tok, data.dev, task.is_regression)
        p = p.sized(len(train)).with_max_steps(r.max_steps)
        # what the phases that distil train on: the rows, plus perturbed copies only the teacher labels
        kd_train = train
        if p.distill.augment:
            specials = [i for i, t in tok.get_added_tokens_decoder().items() if t.special]
            kd_train = with_perturbed_copies(train, p.distill.augment, p.distill.augment_rate, r.seed + 11, specials)
            log.info("distillation also reads %d perturbed copies of the training rows (%d rows; token rate %.2f)",
                     p.distill.augment, len(kd_train) - len(train), p.distill.augment_rate)
        described = data.info.get("description") or data.info.get("source")
        log.info("%s: %d train rows, %d dev rows (%s)", task.name, len(train), len(dev), described)
        log.info("%s", seq_length.describe())
        phases = planned_phases(r, p)
        steps = ", ".join(f"{name} {n}" if isinstance(n, int) else f"{name} ({n})" for name, n in phases)
        log.info("--method %s, preset %s: %s (batch %d)", r.method, p.name, steps or "no training phase", p.batch_size)
        current_progress().add(planned_work(r, p, len(dev)))
        return CompressionContext(
            request=r, preset=p, task=task, train=train, kd_train=kd_train, dev=dev, tokenizer_dir=tokenizer_dir,
            vocab_size=tok.get_vocab_size(), seq_length=seq_length, data_info=data.info, state_dir=self.state_dir,
            procs=self.procs, record=RunRecord(), ends_with_qat=self.method.qat,
            base_model_dir=source.base_model_dir, base_model=source.base_model)

    # -- the run
    def run(self) -> Artifact:
        r = self.request
        # the overall bar: load_data adds the planned work once the rows (and so the step counts) are known
        with Progress(enabled=r.progress and self.procs.main, desc=f"compress ({r.method})"):
            source = self.method.source(r)
            ctx = self.load_data(source)
            return self.save(self.method.run(ctx), ctx)

    def save(self, result: CompressedModel, ctx: CompressionContext) -> Artifact:
        r, p, record = self.request, result.preset, ctx.record
        model, scales, amax = result.model, result.scales, result.amax
        model.to("cpu")
        training = {
            "method": r.method,
            "recipe": self.method.recipe(p, r.quant),  # what ran after the teacher, in words
            "quant": bool(scales),
            "distillation": result.distillation,
            "preset": p.name,
            "preset_config": p.to_dict(),
            "seed": r.seed,
            "train_rows": len(ctx.train),
            "data": ctx.data_info,
            "teacher": Path(r.teacher).name if r.teacher else None,
            "phases": record.phases,
            "wall_seconds": round(time.perf_counter() - self.t_start, 1),
            "machine": machine(),
            "device": str(ctx.device),
            "torch": torch.__version__,
        }
        if self.procs.world > 1:
            training["processes"] = self.procs.world
        if record.tensorrt_residuals:
            training["tensorrt_qat_residuals"] = record.tensorrt_residuals
        contents = CheckpointContents(
            task=ctx.task, base_model=result.base_model, max_seq_length=p.max_seq_length,
            sparse_layers=list(result.sparse_layers) or None, weight_scales=scales or None,
            act_amax=amax if scales else None, embedding_scales=record.embedding_scales if scales else None,
            metrics=result.metrics, training=training, sequence_length=ctx.seq_length.record())
        art = None
        with self.procs.main_first() as main:
            if main:
                art = save_checkpoint(model, ctx.tokenizer_dir, self.out, contents,
                                      overwrite=r.overwrite or self.out.exists())
        log.info("wrote %s (%s, %.0fs)", self.out, r.method, training["wall_seconds"])
        return art if art is not None else load_artifact(self.out)


def compress(request: CompressRequest) -> Artifact:
    return CompressionPipeline(request).run()
