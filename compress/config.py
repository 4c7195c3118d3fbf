"""Compression settings as dataclasses, with named presets (`quick`, `full`).

A preset fixes everything that changes accuracy or run time; the CLI may override a few knobs
(--max-steps, --train-limit, --seed, --max-seq-length). `quick` is the short recipe, sized for a CPU; `full`
is the best-accuracy recipe, sized for a GPU (why: docs/results/2026-11-24-quick-preset.md). Why each
default is what it is: the result pages linked beside it (docs/results/).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, is_dataclass, replace
from typing import Any

from holoserve.core.settings import field_types, parse_setting


@dataclass(frozen=True)
class PhaseConfig:
    lr: float
    # The budget is in epochs of the training set, so a preset fits a small task and a large one alike:
    # steps = ceil(epochs * train_rows / batch_size), at most `max_steps` (None: no cap).
    epochs: float = 1.0
    max_steps: int | None = None
    steps: int | None = None  # an exact optimizer-step count instead (0 skips the phase)
    warmup: float = 0.06  # share of steps with linear warm-up; then linear decay to 0
    weight_decay: float = 0.01


@dataclass(frozen=True)
class DistillConfig:
    enabled: bool = True
    task_weight: float = 1.0  # cross-entropy (or MSE) on the labels
    logits_weight: float = 1.0  # KL(teacher || student) at temperature T, scaled by T^2
    temperature: float = 2.0
    hidden_weight: float = 1.0  # MSE between student and teacher hidden states (non-padding tokens)
    # Perturbed copies of each training row that only the teacher labels (TinyBERT-style augmentation):
    # each copy replaces, deletes or swaps each non-special token with probability augment_rate (a third
    # each). They join the rows of every phase that distils (ADMM, QAT, masked fine-tune), with the KD
    # losses only; each phase keeps the step count sized from the real rows, so its cost is unchanged.
    augment: int = 0
    augment_rate: float = 0.15


ADMM_INITS = ("teacher", "projection")  # AdmmConfig.init: where W starts
PROJECTIONS = ("nearest", "obs", "admm", "admm_fixed_mask", "admm_stable")  # Preset.projection
# What Preset.projection_damp and Preset.projection_batches are when unset, per projection: (damping of the
# layer Hessians, calibration batches the projection is fitted on; None = Preset.calib_batches)
PROJECTION_FIT = {"nearest": (0.01, None), "obs": (0.01, None), "admm": (0.01, None), "admm_fixed_mask": (0.1, 64),
                  "admm_stable": (0.1, 64)}
# projection=admm_stable's Z-step hysteresis toward the mask metric's mask (Preset.projection_tau when unset),
# chosen by how many of its mask moves reproduce on other calibration batches (bench/accuracy/admm_checks.py m1)
STABLE_TAU = 0.0
STABLE_RAMP = 9  # its iterations over which the Z-step's sparsity ramps up to 2:4 (three checks)
# Preset.activation: the FFN activations a student may be given (each one the export, ONNX Runtime, OpenVINO
# and the torch-cuda backend compute; the config key is `hidden_act`, DistilBERT's `activation`)
STUDENT_ACTIVATIONS = ("gelu", "relu")
DEFAULT_ACTIVATION_RAMP = 0.5  # Preset.activation_ramp when unset, for methods that end with QAT


@dataclass(frozen=True)
class AdmmConfig:
    interval: int = 20  # W-steps between Z/U updates
    rho_start: float = 1e-3  # rho rises geometrically from rho_start to rho_end over the phase
    rho_end: float = 0.2  # (rho_end = rho_start: a constant rho)
    # How the W-step minimises the proximal term rho/2 ||W - Z + U||^2:
    #   "decoupled"  a plain gradient step after the AdamW step on the task/KD loss, like AdamW's weight
    #                decay: W -= penalty_lr * rho * (W - Z + U). Adam would normalise the penalty away.
    #   "loss"       added to the training loss, so AdamW minimises task + penalty together (ADMM-DS's way,
    #                with a small constant rho).
    penalty: str = "decoupled"
    penalty_lr: float = 1.0
    # Fake-quantize every encoder Linear's input during the ADMM phase too (ranges calibrated on the
    # teacher), so W is shaped for INT8 activations as well as for the 2:4 ∩ INT8 weight set.
    # Why on: docs/results/2026-11-24-admm-search.md
    act_quant: bool = True
    # Where W starts: "teacher" (the dense fine-tuned weights; Z = the nearest projection of them) or
    # "projection" (the teacher's hard projection onto the set, with the preset's mask metric and projection,
    # OBS by default, so W starts on the set with the compensated weights one-shot starts QAT from, and
    # ADMM lets the mask move while it trains).
    init: str = "teacher"  # one of ADMM_INITS (checked by pipeline.check_preset_settings before any training)
    # --method admm_guided (compress.admm.GuidedAdmm): QAT keeps the ADMM penalty, a constant rho (per step, on
    # the metric-weighted proximal term) with Z/U updated every `interval` steps until guide_until of the steps
    guide_rho: float = 1e-3
    guide_until: float = 0.8


@dataclass(frozen=True)
class Preset:
    name: str
    batch_size: int = 32
    eval_batch_size: int = 128
    max_seq_length: int = 64  # the most tokens per row; the length itself comes from the rows (compress/seqlen.py)
    dense: PhaseConfig = PhaseConfig(lr=1e-4, epochs=3, max_steps=500)
    # ADMM and QAT learning rates: why 1e-4, docs/results/2026-11-21-accuracy.md
    admm: PhaseConfig = PhaseConfig(lr=1e-4, epochs=2, max_steps=300)
    qat: PhaseConfig = PhaseConfig(lr=1e-4, epochs=2, max_steps=200)
    admm_cfg: AdmmConfig = AdmmConfig()
    distill: DistillConfig = DistillConfig()
    # How the one-shot and ADMM methods choose which 2 of every 4 weights to keep:
    #   "magnitude"   the 2 largest |w_ij|
    #   "activation"  the 2 largest |w_ij| * ||x_j|| ** mask_activation_power, x_j the layer's input channel j
    #                 over the calibration batches (power 1: Wanda's score, the mask closest to w in the
    #                 layer's output error; 0.5: RIA's exponent; 0: magnitude)
    #   "saliency"    SparseGPT's w_ij^2 / [H^-1]_jj^2, chosen inside the OBS projection (projection="obs" only)
    # (`--method magnitude` is the APEX ASP baseline and always uses magnitude.)
    # Why activation with power 0.5: docs/results/2026-11-24-activation-aware-masks.md
    mask_metric: str = "activation"
    mask_activation_power: float = 0.5
    # How the one-shot projection (and ADMM's final one) treats the weights it keeps:
    #   "nearest"  keep them as they are: the Frobenius-nearest point of 2:4 (then the INT8 grid)
    #   "obs"      update them by optimal-brain-surgeon steps on the calibration batches' input Hessians so
    #              each layer's output moves as little as it can (SparseGPT's sequential pass), then the grid
    #   "admm"     solve min ||X W - X V||^2 over V in 2:4 ∩ INT8 per layer by ADMM on the same Hessians, in the
    #              same sequential pass, the mask free to move from the mask metric's (the Z-step keeps the 2 of
    #              4 that metric ranks highest), then least squares on the final mask and the grid
    #              (compress.project.admm_prune; docs/results/2026-11-27-admm-layerwise.md)
    #   "admm_fixed_mask"  the same ADMM on the mask metric's mask, held fixed (the default's mask): the Z-step
    #              keeps that mask and rounds the kept values onto the row's INT8 grid; each row ends on the
    #              least-squares solve on the mask, rounded, or on an ADMM iterate, whichever fits better
    #              (compress.project.admm_on_mask); fitted with more damping and on more batches (below)
    #   "admm_stable"  ADMM with the mask free but stable: the Z-step favours the metric's mask by projection_tau
    #              (a hysteresis: 0 is "admm"'s free mask), its sparsity ramps up over the first iterations
    #              (Boža's gradual mask) and rho follows ALPS's schedule; fitted as admm_fixed_mask is
    # Why obs, and why the ADMM projections are not the default: docs/results/2026-11-25-obs-projection.md,
    # docs/results/2026-11-27-admm-paired-quick.md, docs/results/2026-11-28-admm-checks.md
    projection: str = "obs"
    # The obs/admm projections' fit: the damping added to each layer Hessian's diagonal (relative to its mean
    # diagonal; more damping pulls the solved weights toward the teacher's, less sharp a fit to the batches)
    # and the number of calibration batches the Hessians are summed over (the mask metric's input norms and
    # the activation ranges keep calib_batches). None: the projection's own (PROJECTION_FIT).
    projection_damp: float | None = None
    projection_batches: int | None = None
    projection_tau: float | None = None  # admm_stable's hysteresis (None: STABLE_TAU)
    # Equal wall time against the default projection, the paired benchmark's rule: with the default recipe's QAT
    # seconds per step, a projection other than obs gives up as many QAT steps as its extra seconds over the obs
    # projection (timed on a copy of the model in the same run) would train (compress/equal_time.py). None: off.
    equal_time_step_seconds: float | None = None
    calib_batches: int = 16  # training batches used to calibrate activation ranges (and the mask metric's norms)
    calib_percentile: float | None = 99.99  # None = plain max
    # The word-embedding table is the largest tensor the optimizer would update, and it is neither pruned
    # nor quantized: frozen, each step skips its update.
    freeze_word_embeddings: bool = True
    # Store the word-embedding table on a per-row INT8 grid when quantizing (applied at the hard
    # projection, so QAT adapts to it), so the exported table takes one byte per weight.
    # Why on: docs/results/2026-11-22-export.md
    quantize_embeddings: bool = True
    # QAT also fake-quantizes the tensors only the TensorRT placement quantizes: the Q/K/V projections,
    # the softmax output and each residual-Add input whose INT8 SQNR clears RESIDUAL_MIN_SQNR_DB (ranges
    # in the manifest; the export's "auto" then quantizes exactly those). ONNX Runtime keeps them in float.
    # Why off: docs/results/2026-11-21-accuracy.md (and docs/results/2026-11-24-tensorrt-placement.md)
    tensorrt_qat: bool = False
    # The student's FFN activation: None keeps the teacher's; "relu" replaces the (erf) GELU by ReLU, during
    # QAT (activation_ramp below) or before the projection, and the checkpoint's config.json says hidden_act
    # "relu" (still a plain Hugging Face model). ReLU can run as a GEMM post-op where GELU is a
    # polynomial per element. Why off: docs/results/2026-11-27-relu-ramp.md
    activation: str | None = None
    # With `activation` set: the share of the QAT steps over which the student's FFN moves from the teacher's
    # activation to `activation`, as (1 - a) * old(x) + a * new(x) with a rising linearly from 0 to 1. The
    # projection and calibration then see the teacher's activation; the rest of QAT (and the checkpoint) is
    # the new activation alone. 0 swaps it before the projection; None (the default) is DEFAULT_ACTIVATION_RAMP
    # for methods that end with QAT, 0 for the others. Why 0.5: docs/results/2026-11-27-relu-ramp.md
    activation_ramp: float | None = None
    # torch.compile the student's and the teacher's forward for training (dynamic shapes, so the length
    # groups' many sequence lengths share one compiled graph). The same losses and gradients as eager up to
    # float rounding (dropout draws its own random numbers). Why off: docs/usage.md, "compile=true".
    compile: bool = False
    group_size: int = 50  # batches per length-sorted mega-batch (length grouping)
    save_every: int = 200  # steps between mid-phase state saves
    notes: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def stable_tau(self) -> float:
        """projection=admm_stable's hysteresis: the preset's, else STABLE_TAU."""
        return STABLE_TAU if self.projection_tau is None else float(self.projection_tau)

    def projection_fit(self) -> tuple[float, int]:
        """(damping, calibration batches) the projection is fitted with: the preset's, else PROJECTION_FIT's."""
        damp, batches = PROJECTION_FIT.get(self.projection, (0.01, None))
        damp = damp if self.projection_damp is None else self.projection_damp
        batches = batches if self.projection_batches is None else self.projection_batches
        return damp, self.calib_batches if batches is None else batches

    def ramp_share(self, qat: bool) -> float:
        """The share of the QAT steps over which the FFN moves to `activation` (0: none, or swapped before the
        projection), for a method with (`qat`) or without a QAT phase."""
        if self.activation is None or not qat:
            return 0.0
        return DEFAULT_ACTIVATION_RAMP if self.activation_ramp is None else self.activation_ramp

    def sized(self, train_rows: int) -> "Preset":
        """This preset with every phase's step count fixed for a training set of `train_rows` rows."""
        from holoserve import HoloServeError

        per_epoch = max(1, math.ceil(train_rows / self.batch_size))

        def size(name: str, p: PhaseConfig) -> PhaseConfig:
            if p.steps is not None:
                if p.steps < 0:
                    raise HoloServeError(f"{name}.steps={p.steps}: a step count is 0 (skip the phase) or more")
                return p
            if p.epochs < 0 or (p.max_steps is not None and p.max_steps < 0):
                raise HoloServeError(f"{name}: epochs and max_steps must be 0 or more (got {p.epochs}, {p.max_steps})")
            steps = math.ceil(p.epochs * per_epoch) if p.epochs else 0
            if p.max_steps is not None:
                steps = min(steps, p.max_steps)
            return replace(p, steps=steps)

        return replace(self, dense=size("dense", self.dense), admm=size("admm", self.admm), qat=size("qat", self.qat))

    def with_max_steps(self, n: int | None) -> "Preset":
        """Cap every (sized) phase at `n` steps (--max-steps, for smoke runs)."""
        if not n:
            return self
        cap = lambda p: replace(p, steps=min(p.steps, n))  # noqa: E731
        return replace(self, dense=cap(self.dense), admm=cap(self.admm), qat=cap(self.qat))


PRESETS: dict[str, Preset] = {
    "quick": Preset(
        name="quick",
        notes="the short recipe, sized for a CPU: 3 epochs of dense fine-tune, then the admm and qat budgets, 2 "
              "epochs each, capped at 500, 300 and 200 steps (the default method, oneshot, spends both budgets on QAT)",
    ),
    "full": Preset(
        name="full",
        max_seq_length=128,
        dense=PhaseConfig(lr=5e-5, epochs=3, max_steps=6000),
        # ADMM and QAT at 1e-4, as in `quick`: why, docs/results/2026-11-24-accuracy-over-tasks.md
        admm=PhaseConfig(lr=1e-4, epochs=3, max_steps=6000),
        qat=PhaseConfig(lr=1e-4, epochs=2, max_steps=3000),
        admm_cfg=AdmmConfig(interval=50, rho_start=1e-3, rho_end=0.2),
        calib_batches=64,
        save_every=500,
        notes="best accuracy, sized for a GPU: 3 epochs of dense fine-tune, then the admm budget (3 epochs) and the "
              "qat budget (2), at most 6,000, 6,000 and 3,000 steps (the default method, oneshot, spends both budgets "
              "on QAT)",
    ),
}


def apply_overrides(preset: Preset, items: list[str] | None) -> Preset:
    """Override preset fields from "section.field=value" strings, e.g. "qat.lr=1e-4", "admm_cfg.rho_end=0.1"."""
    from holoserve import HoloServeError

    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep:
            raise HoloServeError(f"--set {item!r}: expected FIELD=VALUE, e.g. qat.lr=1e-4")
        path = key.strip().split(".")
        objs = [preset]
        for part in path[:-1]:
            if not hasattr(objs[-1], part):
                raise HoloServeError(f"--set {item!r}: preset has no section {part!r}")
            objs.append(getattr(objs[-1], part))
        leaf = path[-1]
        if not hasattr(objs[-1], leaf):
            raise HoloServeError(f"--set {item!r}: {type(objs[-1]).__name__} has no field {leaf!r}")
        typ = field_types(type(objs[-1]))[leaf]
        if is_dataclass(getattr(objs[-1], leaf)):
            raise HoloServeError(f"--set {item!r}: {leaf!r} is a section; set one of its fields, e.g. {key}.steps=...")
        try:
            val = parse_setting(raw, typ)
        except ValueError as e:
            raise HoloServeError(f"--set {item!r}: {raw!r} is not valid for {key.strip()} ({e})") from None
        new = replace(objs[-1], **{leaf: val})
        for parent, part in zip(reversed(objs[:-1]), reversed(path[:-1])):
            new = replace(parent, **{part: new})
        preset = new
    return preset


def get_preset(name: str):
    from holoserve import HoloServeError

    if name not in PRESETS:
        raise HoloServeError(f"unknown preset {name!r}: choose one of {', '.join(PRESETS)}")
    return PRESETS[name]
