"""One handler per compression method, registered by name (`holoserve compress --method NAME`).

A handler names the folder its tokenizer comes from (`source`), then gets the run's frozen context
(compress.context.CompressionContext: the rows, the dense teacher, resumable phases, calibration) and returns
a `CompressedModel`: the compressed model and what the checkpoint records about it. Adding a method is one
class here with `@register("name")`.

  oneshot    dense teacher -> one-shot projection onto 2:4 ∩ INT8 (masks by the preset's mask metric, kept
             weights OBS-compensated by default, preset projection) -> QAT with distillation for the steps ADMM + QAT
             spend. The default, and no ADMM; why: docs/results/2026-11-24-admm-search.md,
             docs/results/2026-11-25-obs-projection.md, docs/results/2026-11-27-admm-paired-quick.md
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
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from torch import nn

from holoserve import HoloServeError
from holoserve.core.artifact import MANIFEST
from holoserve.core.choices import COMPRESS_METHODS

from . import equal_time
from .admm import Admm, GuidedAdmm
from .config import Preset
from .context import (DEFAULT_MODEL_NAME, CompressedModel, CompressionContext, CompressRequest, ModelSource,
                      default_model_dir)
from .evaluate import format_metrics
from .layers import blend_ffn_activations, encoder_linear_names, get_linear, set_ffn_activation
from .quant import input_quantizers, tensorrt_quantizers
from .sparsify import attach_masks, finalize, hard_masks, nm_share, quantize_weights
from .trainer import train_phase

log = logging.getLogger("holoserve.compress")


METHODS: dict[str, type] = {}


def register(name: str) -> Callable[[type], type]:
    if name not in COMPRESS_METHODS:  # the CLI lists the names from holoserve.core.choices
        raise ValueError(f"method {name!r} is not in holoserve.core.choices.COMPRESS_METHODS")

    def add(cls: type) -> type:
        cls.name = name
        METHODS[name] = cls
        return cls

    return add


def get_method(name: str):
    if name not in METHODS:
        raise HoloServeError(f"unknown method {name!r}: choose one of {', '.join(METHODS)}")
    return METHODS[name]()


def _result(res, ctx: CompressionContext) -> dict[str, Any]:
    """A distilling phase's record; `teacher_only_rows`: the perturbed rows it also read (distill.augment)."""
    out = {"steps": res.steps, "seconds": round(res.seconds, 3), "loss": res.loss}
    if len(ctx.kd_train) > len(ctx.train):
        out["teacher_only_rows"] = len(ctx.kd_train) - len(ctx.train)
    return out


def _projection_words(p: Preset, quant: bool) -> str:
    """What the one-time projection does under preset `p`, in words (the manifest's `recipe`)."""
    masks = {"magnitude": "by |w|", "saliency": "by SparseGPT's saliency",
             "activation": "by |w|·‖x‖" + ("" if p.mask_activation_power == 1 else f"^{p.mask_activation_power:g}")}
    values = {"nearest": "kept as they are", "obs": "updated by OBS (SparseGPT) on the calibration inputs",
              "admm": "solved by layer-wise ADMM, the mask free to move",
              "admm_fixed_mask": "solved by layer-wise ADMM on that mask",
              "admm_stable": f"solved by layer-wise ADMM, the mask free to move (formed gradually, ALPS's rho, "
                             f"a hysteresis of {p.stable_tau():g} toward that mask)"}
    return (f"2:4{' ∩ INT8' if quant else ''} (masks {masks.get(p.mask_metric, p.mask_metric)}, kept weights "
            f"{values.get(p.projection, p.projection)}; projection={p.projection})")


def _training_words(p: Preset, quant: bool, guided: bool = False) -> str:
    """What trains after the projection, in words (the manifest's `recipe`)."""
    kd = "with distillation" if p.distill.enabled else "without distillation"
    what = "QAT" if quant else "a masked fine-tune"
    return f"{what} {kd}" + (" and the ADMM penalty kept on" if guided else "")


@contextlib.contextmanager
def _quantizers(model: nn.Module, amax, layers, tensorrt: bool):
    """QAT's activation quantizers: every encoder Linear input, plus (with `tensorrt`) the extra
    tensors the TensorRT placement quantizes (Q/K/V, residual-Add inputs)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(input_quantizers(model, amax, layers))
        if tensorrt:
            stack.enter_context(tensorrt_quantizers(model, amax, layers))
        yield model


class _TeacherStudentMethod:
    """Methods that start from a base model: fine-tune the dense teacher, then compress a copy of it (the
    student)."""

    name = ""
    distills = False
    qat = False  # ends with QAT (_project_and_finetune), so preset tensorrt_qat can train the TensorRT placement

    def source(self, request: CompressRequest) -> ModelSource:
        base = Path(request.model) if request.model else default_model_dir()
        # a reused teacher carries the tokenizer it was trained with; else the base model's
        teacher_dir = Path(request.teacher) if request.teacher else None
        tokenizer_dir = teacher_dir if teacher_dir and (teacher_dir / "tokenizer.json").is_file() else base
        return ModelSource(tokenizer_dir, base, base.name if request.model else DEFAULT_MODEL_NAME)

    def compression_preset(self, preset: Preset) -> Preset:
        """The settings the compression (after the teacher) runs with: the run's own, unless the method fixes some."""
        return preset

    def recipe(self, p: Preset, quant: bool) -> str:
        """What the method ran after the dense teacher, in words, under compression preset `p` (the manifest's
        training.recipe)."""
        raise NotImplementedError

    def run(self, ctx: CompressionContext) -> CompressedModel:
        request, p = ctx.request, ctx.preset
        base = ctx.base_model_dir
        ctx.state_dir.mkdir(parents=True, exist_ok=True)
        ctx.check_state(ctx.fingerprint(method=request.method, quant=request.quant, preset=p.to_dict(),
                                        teacher=str(request.teacher) if request.teacher else None, base=base.name))
        teacher, dense_metrics, teacher_dir = ctx.teacher(base)
        student = ctx.student(teacher_dir)
        layers = encoder_linear_names(student)
        ctx = replace(ctx, preset=self.compression_preset(p))
        p = ctx.preset
        scales, amax, extra = self.compress(ctx, student, teacher, layers)
        compressed = ctx.dev_metrics(student, amax, layers if amax else None)
        log.info("[result] dense %s | compressed %s", format_metrics(dense_metrics), format_metrics(compressed))
        metrics = {"primary": ctx.task.primary_metric, "split": "dev", "dev_rows": len(ctx.dev),
                   "dense": dense_metrics, "compressed": compressed, **extra}
        if amax and p.tensorrt_qat:  # what model.trt.onnx computes (the export checks it against these numerics)
            metrics["compressed_tensorrt"] = ctx.dev_metrics(student, amax, layers, tensorrt=True)
            log.info("[result] with the TensorRT placement's extra quantizers: %s",
                     format_metrics(metrics["compressed_tensorrt"]))
        return CompressedModel(student, layers, scales, amax, metrics, preset=p, base_model=ctx.base_model,
                               sparse_layers=layers, distillation=self.distills and p.distill.enabled)

    def compress(self, ctx: CompressionContext, student: nn.Module, teacher: nn.Module, layers):
        raise NotImplementedError


@register("admm")
class AdmmMethod(_TeacherStudentMethod):
    distills = True
    qat = True

    def recipe(self, p: Preset, quant: bool) -> str:
        kd = "with distillation" if p.distill.enabled else "without distillation"
        start = " (W from the teacher's projection)" if p.admm_cfg.init == "projection" else ""
        return (f"ADMM fine-tune toward 2:4{' ∩ INT8' if quant else ''} {kd}{start}, then the hard projection onto "
                f"{_projection_words(p, quant)}, then {_training_words(p, quant)}")

    def compress(self, ctx: CompressionContext, student: nn.Module, teacher: nn.Module, layers):
        request, p = ctx.request, ctx.preset

        def admm_phase():
            start = None
            if p.admm_cfg.init == "projection":  # W starts on the set, from one-shot's compensated projection
                finalize(student, ctx.project_masks(student, layers), quant=request.quant)
                start = ctx.dev_metrics(student)
                log.info("[admm] starts from the teacher's hard projection (%s): dev %s", p.projection,
                         format_metrics(start))
            admm = Admm(student, layers, p.admm_cfg, p.admm.steps, quant=request.quant,
                        importance=ctx.mask_importance(student, layers))
            quantized_inputs = None
            if p.admm_cfg.act_quant and request.quant:  # INT8 activations in the same constraint (ranges: teacher's)
                amax = ctx.calibrate(student, layers, tensorrt=False)  # the TensorRT ranges come after projection
                quantized_inputs = lambda: input_quantizers(student, amax, layers)  # noqa: E731
            res = train_phase("admm", student, p.admm, ctx.kd_train, p, request.seed + 1, ctx.state_dir,
                              ctx.train_options(teacher=teacher, distill=p.distill, admm=admm,
                                                context=quantized_inputs))
            resid = admm.residual()
            pre = ctx.dev_metrics(student)
            moves = admm.mask_moves
            result = {**_result(res, ctx), "residual": resid, "rho_final": admm.rho, "z_updates": admm.k,
                      "penalty": p.admm_cfg.penalty, "init": p.admm_cfg.init, "dev_before_projection": pre,
                      **({"dev_at_start": start} if start is not None else {}),
                      # share of the 2:4 mask that changed at each Z-update (first, median, last)
                      "mask_moves": [round(x, 5) for x in (moves[0], sorted(moves)[len(moves) // 2], moves[-1])]
                      if moves else []}
            ctx.log_phase("admm", result, pre, student, layers, rho=admm.rho, resid=f"{resid:.4f}")
            return result

        ctx.run_phase("admm", student, layers, admm_phase)
        return _project_and_finetune(ctx, student, teacher, layers, p.qat)


def _project_and_finetune(ctx: CompressionContext, student: nn.Module, teacher: nn.Module, layers, cfg,
                          guided: bool = False):
    """Hard projection onto 2:4 (∩ INT8) — the mask is frozen from here on — then QAT (or a masked
    fine-tune without INT8) with distillation for `cfg`'s steps. With `guided`, QAT keeps ADMM on instead of a
    frozen mask (compress.admm.GuidedAdmm: Z and U from the projection on, the masks at the end are Z's).
    Returns (scales, amax, extra metrics)."""
    request, p = ctx.request, ctx.preset
    equal_time.time_reference(ctx, student, layers)
    masks = ctx.project_masks(student, layers)
    cfg = equal_time.held_to_reference(ctx, cfg)
    finalize(student, masks, quant=request.quant)
    if request.quant:
        ctx.quantize_embeddings(student)
    projected = ctx.dev_metrics(student)
    log.info("[project] hard 2:4%s projection (%s): dev %s | 2:4=%.1f%%", " ∩ INT8" if request.quant else "",
             p.projection, format_metrics(projected), nm_share(student, layers) * 100)
    amax = ctx.calibrate(student, layers) if request.quant else None
    name = "qat" if request.quant else "masked"
    share = p.ramp_share(qat=True)
    ramping = share > 0  # the student still has the teacher's FFN activation
    ramp_steps = max(1, math.ceil(share * cfg.steps)) if ramping and cfg.steps else 0

    guide = None

    def qat_phase():
        nonlocal guide
        if guided:  # Z-steps choose masks by the metric that chose the projection's (the teacher's input norms)
            guide = GuidedAdmm(student, layers, masks, p.admm_cfg, cfg.steps, quant=request.quant,
                               importance=ctx.mask_importance(teacher, layers))
        else:
            attach_masks(student, masks, quant=request.quant)
        quantized_inputs = (lambda: _quantizers(student, amax, layers, p.tensorrt_qat)) if amax else None
        on_step = None
        if ramp_steps:  # the FFN activation moves from the teacher's to p.activation over the first ramp_steps
            blends = blend_ffn_activations(student, p.activation)
            log.info("[%s] the FFN activation moves to %s over the first %d of %d steps", name, p.activation,
                     ramp_steps, cfg.steps)

            def on_step(step: int) -> None:
                for b in blends:
                    b.set_alpha((step + 1) / ramp_steps)

        res = train_phase(name, student, cfg, ctx.kd_train, p, request.seed + 2, ctx.state_dir,
                          ctx.train_options(teacher=teacher, distill=p.distill, masks=None if guided else masks,
                                            context=quantized_inputs, on_step=on_step, admm=guide))
        if ramping:
            set_ffn_activation(student, p.activation)
        final_masks = guide.masks() if guide is not None else masks
        finalize(student, final_masks, quant=request.quant)
        metrics = ctx.dev_metrics(student, amax, layers if amax else None)
        result = _result(res, ctx)
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
        ctx.log_phase(name, result, metrics, student, layers)
        return result

    saved_amax = ctx.saved(f"{name}-done")
    meta = ctx.run_phase(name, student, layers, qat_phase, meta_extra=lambda: {"amax": amax})
    if ramping:  # also when the phase was done before (its saved weights were trained to the new activation)
        set_ffn_activation(student, p.activation)
    if saved_amax is not None and meta.get("amax"):
        amax = meta["amax"]
    if guided:  # the masks the phase ended with (Z's): exactly the non-zeros of its saved, finalized weights
        masks = {k: get_linear(student, k).weight.detach() != 0 for k in layers}
    scales = {}
    if request.quant:  # weights are exact already; this recomputes their scales from the saved values
        scales = finalize(student, masks, quant=True)
        ctx.quantize_embeddings(student)
    return scales, amax, {"after_projection": projected}


@register("oneshot")
class OneShotMethod(_TeacherStudentMethod):
    """The default method (why: docs/results/2026-11-24-admm-search.md): the teacher projected once onto
    2:4 ∩ INT8, then QAT with distillation for every step ADMM + QAT would spend, so the two compare at the
    same budget."""

    distills = True
    qat = True

    def recipe(self, p: Preset, quant: bool) -> str:
        return f"one-shot projection onto {_projection_words(p, quant)}, then {_training_words(p, quant)}"

    def compress(self, ctx: CompressionContext, student: nn.Module, teacher: nn.Module, layers):
        p = ctx.preset
        ctx.record.phases["admm"] = {"steps": 0, "skipped": "one-shot projection instead"}
        return _project_and_finetune(ctx, student, teacher, layers, replace(p.qat, steps=p.admm.steps + p.qat.steps))


@register("admm_guided")
class AdmmGuidedMethod(_TeacherStudentMethod):
    """ADMM end to end: the teacher projected by the layer-wise ADMM solve (projection="admm", whatever the
    preset says), then QAT with distillation and the ADMM penalty kept on (compress.admm.GuidedAdmm), one LR
    schedule over the steps ADMM + QAT spend, as oneshot."""

    distills = True
    qat = True

    def compression_preset(self, preset: Preset) -> Preset:
        return replace(preset, projection="admm")

    def recipe(self, p: Preset, quant: bool) -> str:
        return f"one-time projection onto {_projection_words(p, quant)}, then {_training_words(p, quant, True)}"

    def compress(self, ctx: CompressionContext, student: nn.Module, teacher: nn.Module, layers):
        p = ctx.preset
        ctx.record.phases["admm"] = {"steps": 0, "skipped": "layer-wise ADMM projection, then ADMM-guided QAT"}
        return _project_and_finetune(ctx, student, teacher, layers, replace(p.qat, steps=p.admm.steps + p.qat.steps),
                                     guided=True)


@register("magnitude")
class MagnitudeMethod(_TeacherStudentMethod):
    distills = True

    def recipe(self, p: Preset, quant: bool) -> str:
        kd = "with distillation" if p.distill.enabled else "without distillation"
        return f"one-shot magnitude 2:4, a masked fine-tune {kd}" + (", then post-training INT8" if quant else "")

    def compress(self, ctx: CompressionContext, student: nn.Module, teacher: nn.Module, layers):
        """APEX ASP recipe: one-shot magnitude 2:4 of the fine-tuned model, masked fine-tune (with the same
        distillation as the other methods; preset distill.enabled=false for ASP's plain fine-tune), then PTQ INT8."""
        request, p = ctx.request, ctx.preset
        masks = hard_masks(student, layers)
        finalize(student, masks, quant=False)
        one_shot = ctx.dev_metrics(student)
        log.info("[prune] one-shot magnitude 2:4: dev %s", format_metrics(one_shot))
        steps = p.admm.steps + p.qat.steps  # the same budget the ADMM method spends after the teacher
        cfg = replace(p.dense, steps=steps)

        def masked_phase():
            attach_masks(student, masks, quant=False)
            res = train_phase("masked", student, cfg, ctx.kd_train, p, request.seed + 1, ctx.state_dir,
                              ctx.train_options(teacher=teacher, distill=p.distill, masks=masks))
            finalize(student, masks, quant=False)
            result = _result(res, ctx)
            ctx.log_phase("masked", result, ctx.dev_metrics(student), student, layers)
            return result

        ctx.run_phase("masked", student, layers, masked_phase)
        extra: dict[str, Any] = {"one_shot": one_shot}
        if not request.quant:
            return {}, None, extra
        extra["sparse_fp32"] = ctx.dev_metrics(student)
        scales = quantize_weights(student, layers, masks)
        ctx.quantize_embeddings(student)
        amax = ctx.calibrate(student, layers)
        ctx.record.phases["ptq"] = {"calib_batches": p.calib_batches}
        return scales, amax, extra


@register("ptq")
class PtqMethod:
    """Post-training INT8 of an existing model (a HoloServe checkpoint or a fine-tuned HF folder)."""

    name = "ptq"
    qat = False

    def recipe(self, p: Preset, quant: bool) -> str:
        return "post-training INT8 of an existing model (its masks, if any, kept)"

    def source(self, request: CompressRequest) -> ModelSource:
        """The model to quantize; its tokenizer reads the rows, so the task is known before the model loads."""
        if not request.model:
            raise HoloServeError("--method ptq needs --model: a HoloServe checkpoint or a fine-tuned HF folder")
        return ModelSource(Path(request.model))

    def run(self, ctx: CompressionContext) -> CompressedModel:
        src = Path(ctx.request.model)
        source_manifest = None
        if (src / MANIFEST).is_file():
            from .checkpoint import load_model

            model, art = load_model(src)
            model.to(ctx.device)
            source_manifest = art.manifest
            if art.task_name != ctx.task.name:
                raise HoloServeError(f"{src} is a {art.task_name} checkpoint, not {ctx.task.name}")
            if art.quantized:
                raise HoloServeError(f"{src} is already INT8; post-training quantization needs an fp32 model")
            base_model = source_manifest.base_model
        else:
            model = ctx.load_classifier(src)
            base_model = src.name
        model.eval()
        layers = encoder_linear_names(model)
        sparse = list(source_manifest.sparsity.layers) if source_manifest and source_manifest.sparsity else []
        source_metrics = ctx.dev_metrics(model)
        masks = {name: (model.get_submodule(name).weight != 0) for name in sparse} if sparse else None
        if masks:  # keep a pruned model's zeros exactly: the mask is its non-zeros (at most 2 of every 4)
            masks = {k: hard_masks(model, [k])[k] & v for k, v in masks.items()}
        scales = quantize_weights(model, layers, masks)
        ctx.quantize_embeddings(model)
        amax = ctx.calibrate(model, layers)
        compressed = ctx.dev_metrics(model, amax, layers)
        dense = (source_manifest.metrics.dense if source_manifest else None) or source_metrics
        log.info("[ptq] source %s | int8 %s", format_metrics(source_metrics), format_metrics(compressed))
        metrics = {"primary": ctx.task.primary_metric, "split": "dev", "dev_rows": len(ctx.dev),
                   "dense": dense, "source_fp32": source_metrics, "compressed": compressed}
        ctx.record.phases["ptq"] = {"calib_batches": ctx.preset.calib_batches, "source": src.name}
        return CompressedModel(model, layers, scales, amax, metrics, preset=ctx.preset, base_model=base_model,
                               sparse_layers=sparse)
