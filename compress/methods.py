"""One handler per compression method, registered by name (`holoserve compress --method NAME`).

A handler gets the job's shared machinery (compress.pipeline.Runner: data, the dense teacher,
resumable phases, calibration) and returns an `Outcome`: the compressed model and what the
checkpoint records about it. Adding a method is one class here with `@register("name")`.

  oneshot    dense teacher -> one-shot projection onto 2:4 ∩ INT8 (kept weights OBS-compensated, preset
             projection) -> QAT with distillation for the steps ADMM + QAT spend. The default: it measured best
             (docs/results/2026-11-24-admm-search.md, docs/results/2026-11-25-obs-projection.md)
  admm       dense teacher -> ADMM toward 2:4 ∩ INT8 (INT8 activations fake-quantized too) with
             distillation -> hard projection -> QAT
  admm_guided  dense teacher -> layer-wise ADMM projection onto 2:4 ∩ INT8 (projection="admm") -> QAT with
             distillation and the ADMM penalty kept on (Z/U carried to the end), the steps ADMM + QAT spend
  magnitude  one-shot magnitude 2:4 of the teacher -> masked fine-tune with distillation -> post-training
             INT8 (the APEX ASP recipe, the baseline ADMM has to beat, same step budget and distillation)
  ptq        post-training INT8 of an existing checkpoint or fine-tuned folder
"""
from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from torch import nn

from holoserve import HoloServeError
from holoserve.core.artifact import MANIFEST

from .admm import Admm, GuidedAdmm
from .layers import blend_ffn_activations, encoder_linear_names, get_linear, set_ffn_activation
from .quant import input_quantizers, tensorrt_quantizers
from .sparsify import attach_masks, finalize, hard_masks, nm_share, quantize_weights
from .trainer import train_phase

if TYPE_CHECKING:
    from .pipeline import Runner

log = logging.getLogger("holoserve.compress")


@dataclass
class Outcome:
    """A compressed model and what its checkpoint records."""

    model: nn.Module
    layers: list[str]  # the encoder Linears
    scales: dict[str, Any]  # per-channel INT8 weight scales by layer ({} without INT8)
    amax: dict[str, float] | None  # calibrated activation ranges (None without INT8)
    metrics: dict[str, Any]  # the manifest's metrics section
    sparse_layers: list[str] = field(default_factory=list)  # layers the manifest lists as 2:4
    distillation: bool = False


METHODS: dict[str, type] = {}


def register(name: str) -> Callable[[type], type]:
    def add(cls: type) -> type:
        cls.name = name
        METHODS[name] = cls
        return cls

    return add


def get_method(name: str):
    if name not in METHODS:
        raise HoloServeError(f"unknown method {name!r}: choose one of {', '.join(METHODS)}")
    return METHODS[name]()


def _fmt(metrics) -> str:
    return " ".join(f"{k}={v:.4f}" for k, v in metrics.items())


def _result(res, run: "Runner") -> dict[str, Any]:
    """A distilling phase's record; `teacher_only_rows`: the perturbed rows it also read (distill.augment)."""
    out = {"steps": res.steps, "seconds": round(res.seconds, 1), "loss": res.loss}
    if len(run.kd_train) > len(run.train):
        out["teacher_only_rows"] = len(run.kd_train) - len(run.train)
    return out


@contextlib.contextmanager
def _quantizers(model: nn.Module, amax, layers, tensorrt: bool):
    """QAT's activation quantizers: every encoder Linear input, plus (with `tensorrt`) the extra
    tensors the TensorRT placement quantizes (Q/K/V, residual-Add inputs)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(input_quantizers(model, amax, layers))
        if tensorrt:
            stack.enter_context(tensorrt_quantizers(model, amax, layers))
        yield model


class _FromTeacher:
    """Methods that start from a base model: fine-tune the dense teacher, then compress a copy of it."""

    name = ""
    distills = False
    qat = False  # ends with QAT (_project_and_finetune), so preset tensorrt_qat can train the TensorRT placement

    def run(self, run: "Runner") -> Outcome:
        job, p = run.job, run.preset
        base = Path(job.model) if job.model else run.default_model_dir()
        run.base_name = run.default_model_name if not job.model else base.name
        # a reused teacher carries the tokenizer it was trained with; else the base model's
        teacher_dir = Path(job.teacher) if job.teacher else None
        run.load_data(teacher_dir if teacher_dir and (teacher_dir / "tokenizer.json").is_file() else base)
        run.state.mkdir(parents=True, exist_ok=True)
        run.check_state(run.fingerprint(method=job.method, quant=job.quant, preset=p.to_dict(),
                                        teacher=str(job.teacher) if job.teacher else None, base=base.name))
        teacher, dense_metrics, teacher_dir = run.teacher(base)
        student = run.student(teacher_dir)
        layers = encoder_linear_names(student)
        scales, amax, extra = self.compress(run, student, teacher, layers)
        compressed = run.dev_metrics(student, amax, layers if amax else None)
        log.info("[result] dense %s | compressed %s", _fmt(dense_metrics), _fmt(compressed))
        metrics = {"primary": run.task.primary_metric, "split": "dev", "dev_rows": len(run.dev),
                   "dense": dense_metrics, "compressed": compressed, **extra}
        if amax and p.tensorrt_qat:  # what model.trt.onnx computes (the export checks it against these numerics)
            metrics["compressed_tensorrt"] = run.dev_metrics(student, amax, layers, tensorrt=True)
            log.info("[result] with the TensorRT placement's extra quantizers: %s",
                     _fmt(metrics["compressed_tensorrt"]))
        return Outcome(student, layers, scales, amax, metrics, sparse_layers=layers,
                       distillation=self.distills and p.distill.enabled)

    def compress(self, run: "Runner", student: nn.Module, teacher: nn.Module, layers):
        raise NotImplementedError


@register("admm")
class AdmmMethod(_FromTeacher):
    distills = True
    qat = True

    def compress(self, run: "Runner", student: nn.Module, teacher: nn.Module, layers):
        job, p = run.job, run.preset
        reg = run.task.is_regression

        def admm_phase():
            start = None
            if p.admm_cfg.init == "projection":  # W starts on the set, from one-shot's compensated projection
                finalize(student, run.project_masks(student, layers), quant=job.quant)
                start = run.dev_metrics(student)
                log.info("[admm] starts from the teacher's hard projection (%s): dev %s", p.projection, _fmt(start))
            admm = Admm(student, layers, p.admm_cfg, p.admm.steps, quant=job.quant,
                        importance=run.mask_importance(student, layers))
            ctx = None
            if p.admm_cfg.act_quant and job.quant:  # INT8 activations in the same constraint (ranges: teacher's)
                amax = run.calibrate(student, layers, tensorrt=False)  # the TensorRT ranges come after projection
                ctx = lambda: input_quantizers(student, amax, layers)  # noqa: E731
            res = train_phase("admm", student, p.admm, run.kd_train, p, job.seed + 1, run.state, regression=reg,
                              teacher=teacher, distill=p.distill, admm=admm, context=ctx, progress=job.progress,
                              procs=run.procs)
            resid = admm.residual()
            pre = run.dev_metrics(student)
            moves = admm.mask_moves
            result = {**_result(res, run), "residual": resid, "rho_final": admm.rho, "z_updates": admm.k,
                      "penalty": p.admm_cfg.penalty, "init": p.admm_cfg.init, "dev_before_projection": pre,
                      **({"dev_at_start": start} if start is not None else {}),
                      # share of the 2:4 mask that changed at each Z-update (first, median, last)
                      "mask_moves": [round(x, 5) for x in (moves[0], sorted(moves)[len(moves) // 2], moves[-1])]
                      if moves else []}
            run.log_phase("admm", result, pre, student, layers, rho=admm.rho, resid=f"{resid:.4f}")
            return result

        run.run_phase("admm", student, layers, admm_phase)
        return _project_and_finetune(run, student, teacher, layers, p.qat)


def _project_and_finetune(run: "Runner", student: nn.Module, teacher: nn.Module, layers, cfg, guided: bool = False):
    """Hard projection onto 2:4 (∩ INT8) — the mask is frozen from here on — then QAT (or a masked
    fine-tune without INT8) with distillation for `cfg`'s steps. With `guided`, QAT keeps ADMM on instead of a
    frozen mask (compress.admm.GuidedAdmm: Z and U from the projection on, the masks at the end are Z's).
    Returns (scales, amax, extra metrics)."""
    job, p = run.job, run.preset
    reg = run.task.is_regression
    masks = run.project_masks(student, layers)
    finalize(student, masks, quant=job.quant)
    if job.quant:
        run.quantize_embeddings(student)
    projected = run.dev_metrics(student)
    log.info("[project] hard 2:4%s projection (%s): dev %s | 2:4=%.1f%%", " ∩ INT8" if job.quant else "", p.projection,
             _fmt(projected), nm_share(student, layers) * 100)
    amax = run.calibrate(student, layers) if job.quant else None
    name = "qat" if job.quant else "masked"
    share = p.ramp_share(qat=True)
    ramping = share > 0  # the student still has the teacher's FFN activation
    ramp_steps = max(1, math.ceil(share * cfg.steps)) if ramping and cfg.steps else 0

    guide = None

    def qat_phase():
        nonlocal guide
        if guided:  # Z-steps choose masks by the metric that chose the projection's (the teacher's input norms)
            c = p.admm_cfg
            guide = GuidedAdmm(student, layers, masks, rho=c.guide_rho, interval=c.interval, total_steps=cfg.steps,
                               until=c.guide_until, quant=job.quant, importance=run.mask_importance(teacher, layers))
        else:
            attach_masks(student, masks, quant=job.quant)
        ctx = (lambda: _quantizers(student, amax, layers, p.tensorrt_qat)) if amax else None
        on_step = None
        if ramp_steps:  # the FFN activation moves from the teacher's to p.activation over the first ramp_steps
            blends = blend_ffn_activations(student, p.activation)
            log.info("[%s] the FFN activation moves to %s over the first %d of %d steps", name, p.activation,
                     ramp_steps, cfg.steps)

            def on_step(step: int) -> None:
                for b in blends:
                    b.set_alpha((step + 1) / ramp_steps)

        res = train_phase(name, student, cfg, run.kd_train, p, job.seed + 2, run.state, regression=reg,
                          teacher=teacher, distill=p.distill, masks=None if guided else masks, context=ctx,
                          progress=job.progress, procs=run.procs, on_step=on_step, admm=guide)
        if ramping:
            set_ffn_activation(student, p.activation)
        final_masks = guide.masks() if guide is not None else masks
        finalize(student, final_masks, quant=job.quant)
        metrics = run.dev_metrics(student, amax, layers if amax else None)
        result = _result(res, run)
        if guide is not None:
            moves = guide.mask_moves
            result.update({"admm_guided": True, "rho": guide.rho, "z_updates": guide.k,
                           "mask_changed_vs_projection": round(sum(int((final_masks[k] != masks[k]).sum())
                                                                   for k in layers)
                                                               / sum(masks[k].numel() for k in layers), 5),
                           "mask_moves": [round(x, 5) for x in (moves[0], sorted(moves)[len(moves) // 2],
                                                                moves[-1])] if moves else []})
        if ramp_steps:
            result["activation_ramp_steps"] = ramp_steps
        run.log_phase(name, result, metrics, student, layers)
        return result

    saved_amax = run.saved(f"{name}-done")
    meta = run.run_phase(name, student, layers, qat_phase, meta_extra=lambda: {"amax": amax})
    if ramping:  # also when the phase was done before (its saved weights were trained to the new activation)
        set_ffn_activation(student, p.activation)
    if saved_amax is not None and meta.get("amax"):
        amax = meta["amax"]
    if guided:  # the masks the phase ended with (Z's): exactly the non-zeros of its saved, finalized weights
        masks = {k: get_linear(student, k).weight.detach() != 0 for k in layers}
    scales = {}
    if job.quant:  # weights are exact already; this recomputes their scales from the saved values
        scales = finalize(student, masks, quant=True)
        run.quantize_embeddings(student)
    return scales, amax, {"after_projection": projected}


@register("oneshot")
class OneShotMethod(_FromTeacher):
    """The default method (it measured best): the teacher projected once onto 2:4 ∩ INT8, then QAT with
    distillation for every step ADMM + QAT would spend, so the two compare at the same budget."""

    distills = True
    qat = True

    def compress(self, run: "Runner", student: nn.Module, teacher: nn.Module, layers):
        p = run.preset
        run.phases["admm"] = {"steps": 0, "skipped": "one-shot projection instead"}
        return _project_and_finetune(run, student, teacher, layers, replace(p.qat, steps=p.admm.steps + p.qat.steps))


@register("admm_guided")
class AdmmGuidedMethod(_FromTeacher):
    """ADMM end to end, the candidate default (issue: it becomes `--method admm` once it measures level with
    oneshot): the teacher projected by the layer-wise ADMM solve (projection="admm", whatever the preset says),
    then QAT with distillation and the ADMM penalty kept on (compress.admm.GuidedAdmm), one LR schedule over
    the steps ADMM + QAT spend, as oneshot."""

    distills = True
    qat = True

    def compress(self, run: "Runner", student: nn.Module, teacher: nn.Module, layers):
        p = run.preset
        run.preset = replace(p, projection="admm")
        run.phases["admm"] = {"steps": 0, "skipped": "layer-wise ADMM projection, then ADMM-guided QAT"}
        return _project_and_finetune(run, student, teacher, layers, replace(p.qat, steps=p.admm.steps + p.qat.steps),
                                     guided=True)


@register("magnitude")
class MagnitudeMethod(_FromTeacher):
    distills = True

    def compress(self, run: "Runner", student: nn.Module, teacher: nn.Module, layers):
        """APEX ASP recipe: one-shot magnitude 2:4 of the fine-tuned model, masked fine-tune (with the same
        distillation as the other methods; preset distill.enabled=false for ASP's plain fine-tune), then PTQ INT8."""
        job, p = run.job, run.preset
        masks = hard_masks(student, layers)
        finalize(student, masks, quant=False)
        one_shot = run.dev_metrics(student)
        log.info("[prune] one-shot magnitude 2:4: dev %s", _fmt(one_shot))
        steps = p.admm.steps + p.qat.steps  # the same budget the ADMM method spends after the teacher
        cfg = replace(p.dense, steps=steps)

        def masked_phase():
            attach_masks(student, masks, quant=False)
            res = train_phase("masked", student, cfg, run.kd_train, p, job.seed + 1, run.state,
                              regression=run.task.is_regression, teacher=teacher, distill=p.distill, masks=masks,
                              progress=job.progress, procs=run.procs)
            finalize(student, masks, quant=False)
            result = _result(res, run)
            run.log_phase("masked", result, run.dev_metrics(student), student, layers)
            return result

        run.run_phase("masked", student, layers, masked_phase)
        extra: dict[str, Any] = {"one_shot": one_shot}
        if not job.quant:
            return {}, None, extra
        extra["sparse_fp32"] = run.dev_metrics(student)
        scales = quantize_weights(student, layers, masks)
        run.quantize_embeddings(student)
        amax = run.calibrate(student, layers)
        run.phases["ptq"] = {"calib_batches": p.calib_batches}
        return scales, amax, extra


@register("ptq")
class PtqMethod:
    """Post-training INT8 of an existing model (a HoloServe checkpoint or a fine-tuned HF folder)."""

    name = "ptq"
    qat = False

    def run(self, run: "Runner") -> Outcome:
        job = run.job
        if not job.model:
            raise HoloServeError("--method ptq needs --model: a HoloServe checkpoint or a fine-tuned HF folder")
        src = Path(job.model)
        source_manifest = None
        run.load_data(src)  # the task (labels, outputs) is known from the rows before the model loads
        if (src / MANIFEST).is_file():
            from .checkpoint import load_model

            model, art = load_model(src)
            model.to(run.device)
            source_manifest = art.manifest
            if art.task_name != run.task.name:
                raise HoloServeError(f"{src} is a {art.task_name} checkpoint, not {run.task.name}")
            if art.quantized:
                raise HoloServeError(f"{src} is already INT8; post-training quantization needs an fp32 model")
            run.base_name = source_manifest.base_model
        else:
            model = run.hf(src)
            run.base_name = src.name
        model.eval()
        layers = encoder_linear_names(model)
        sparse = list(source_manifest.sparsity.layers) if source_manifest and source_manifest.sparsity else []
        source_metrics = run.dev_metrics(model)
        masks = {name: (model.get_submodule(name).weight != 0) for name in sparse} if sparse else None
        if masks:  # keep a pruned model's zeros exactly: the mask is its non-zeros (at most 2 of every 4)
            masks = {k: hard_masks(model, [k])[k] & v for k, v in masks.items()}
        scales = quantize_weights(model, layers, masks)
        run.quantize_embeddings(model)
        amax = run.calibrate(model, layers)
        compressed = run.dev_metrics(model, amax, layers)
        dense = (source_manifest.metrics.dense if source_manifest else None) or source_metrics
        log.info("[ptq] source %s | int8 %s", _fmt(source_metrics), _fmt(compressed))
        metrics = {"primary": run.task.primary_metric, "split": "dev", "dev_rows": len(run.dev),
                   "dense": dense, "source_fp32": source_metrics, "compressed": compressed}
        run.phases["ptq"] = {"calib_batches": run.preset.calib_batches, "source": src.name}
        return Outcome(model, layers, scales, amax, metrics, sparse_layers=sparse)
