"""One training loop for every phase (dense, ADMM, masked/QAT fine-tune), resumable mid-phase."""
from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Mapping

import torch
from torch import nn

from .config import DistillConfig, PhaseConfig, Preset
from .data import Encoded, to_device, train_batches
from .distill import combined_loss
from .distributed import Processes
from .sparsify import reapply_masks
from .state import load_optimizer, load_state, optimizer_tensors, restore_rng, rng_tensors, save_state

log = logging.getLogger("holoserve.compress")


def make_optimizer(model: nn.Module, cfg: PhaseConfig) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.dim() < 2 or "LayerNorm" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    try:  # fused AdamW (one kernel for every parameter's update) also runs on the CPU in recent torch
        return torch.optim.AdamW(groups, lr=cfg.lr, fused=True)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(groups, lr=cfg.lr)


def lr_at(cfg: PhaseConfig, step: int) -> float:
    warm = max(1, int(cfg.warmup * cfg.steps))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    return cfg.lr * max(0.0, (cfg.steps - step) / max(1, cfg.steps - warm))


PROFILE_STEPS_ENV = "HOLOSERVE_TRAIN_PROFILE_STEPS"  # profile this many steps of every phase, after PROFILE_SKIP
PROFILE_DIR_ENV = "HOLOSERVE_TRAIN_PROFILE_DIR"  # where each phase's profile goes (default: the working directory)
PROFILE_SKIP = 5  # warm-up steps before the profiled ones (allocator, autotuning, lazy init)


class StepProfiler:
    """Where a training step's time goes, for the steps HOLOSERVE_TRAIN_PROFILE_STEPS names (off by default).

    torch.profiler over those steps, CPU and (on a GPU) CUDA activity, written as `<phase>-profile.json`:
    wall time per step, the kernels' own device time per step and how many kernels a step launches (on a
    GPU: a step far longer than its kernels is bound by the host launching them), operator calls per step,
    and the time of each labelled part of the step (teacher, student forward, backward, optimizer)."""

    def __init__(self, name: str, device: torch.device, first_step: int, last_step: int):
        self.name, self.device = name, device
        n = int(os.environ.get(PROFILE_STEPS_ENV, "0") or 0)
        self.start = first_step + PROFILE_SKIP
        self.stop = min(self.start + n, last_step) if n > 0 else self.start
        self.prof = None
        self.t0 = 0.0

    def step_begins(self, step: int) -> None:
        if step == self.start and self.stop > self.start:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self._sync()
            self.prof = profile(activities=acts)
            self.prof.__enter__()
            self.t0 = time.perf_counter()

    def step_ends(self, step: int) -> None:
        if self.prof is None or step + 1 != self.stop:
            return
        self._sync()
        wall = time.perf_counter() - self.t0
        self.prof.__exit__(None, None, None)
        steps = self.stop - self.start
        device_us = kernels = cpu_ops = 0
        parts, top = {}, []
        for e in self.prof.key_averages():
            if str(getattr(e, "device_type", "")).endswith("CUDA"):
                us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
                device_us += us
                kernels += e.count
                top.append((us, e.key, e.count))
            elif e.key.startswith("step/"):
                parts[e.key[len("step/"):]] = round(e.cpu_time_total / 1000 / steps, 3)
            else:
                cpu_ops += e.count if e.key.startswith("aten::") else 0
        report = {"phase": self.name, "device": str(self.device), "steps": steps,
                  "wall_ms_per_step": round(wall * 1000 / steps, 3),
                  "host_ms_per_step_by_part": parts, "aten_ops_per_step": round(cpu_ops / steps, 1)}
        if self.device.type == "cuda":
            report.update({"kernel_ms_per_step": round(device_us / 1000 / steps, 3),
                           "kernels_per_step": round(kernels / steps, 1),
                           "top_kernels": [{"name": k[:120], "ms_per_step": round(us / 1000 / steps, 4),
                                            "calls_per_step": round(c / steps, 1)}
                                           for us, k, c in sorted(top)[::-1][:12]]})
        out = Path(os.environ.get(PROFILE_DIR_ENV) or ".") / f"{self.name}-profile.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        from holoserve.core.files import atomic_write_json

        atomic_write_json(out, report)
        log.info("[%s] profile of %d steps: %s ms per step (%s) -> %s", self.name, steps, report["wall_ms_per_step"],
                 ", ".join(f"{k} {v}" for k, v in parts.items()), out)
        self.prof = None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _can_compile(device: torch.device) -> None:
    """torch.compile needs a C++ compiler on the CPU and Triton on a GPU: say so before the first step fails
    deep inside the compiler."""
    import importlib.util
    import shutil

    from holoserve import HoloServeError

    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        raise HoloServeError("--set compile=true on a GPU needs Triton (pip install triton, as PyTorch's CUDA "
                             "wheels bring it), or train without compile=true")
    if device.type == "cpu" and not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        raise HoloServeError("--set compile=true on the CPU needs a C++ compiler (e.g. apt-get install g++), "
                             "or train without compile=true")


def _part(name: str):
    """A labelled range of a training step, for StepProfiler (next to free when no profiler runs)."""
    return torch.profiler.record_function(f"step/{name}")


@dataclass
class PhaseResult:
    steps: int
    seconds: float
    loss: float | None  # mean training loss over the last 50 steps; None when the phase ran no steps
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainOptions:
    """How a training phase trains, besides its steps and rows: the loss, what constrains the weights, the hooks
    around each step, and where it reports."""

    regression: bool = False  # MSE on a score instead of cross-entropy on classes
    teacher: nn.Module | None = None  # the model whose outputs the student distils (with `distill`)
    distill: DistillConfig | None = None
    admm: Any = None  # compress.admm.Admm or GuidedAdmm: the penalty steps and Z/U updates
    masks: Mapping[str, torch.Tensor] | None = None  # fixed 2:4 masks re-applied after every step
    context: Callable[[], ContextManager] | None = None  # entered around the phase (e.g. activation fake-quant)
    progress: bool = True
    procs: Processes | None = None  # several processes (compress/distributed.py); None: this one alone
    on_step: Callable[[int], None] | None = None  # runs before each step's forward pass


def train_phase(
    name: str,
    model: nn.Module,
    cfg: PhaseConfig,
    data: Encoded,
    preset: Preset,
    seed: int,
    state_dir: Path | None,
    options: TrainOptions = TrainOptions(),
) -> PhaseResult:
    """Run `cfg.steps` optimizer steps of phase `name`, resuming from `state_dir/<name>-progress` if present.

    With several processes (compress/distributed.py) each takes its slice of every batch and DDP
    averages the gradients; only the main process writes the progress state. `options.on_step(step)` runs
    before each step's forward pass (a schedule that depends on the step alone, so a resumed phase follows it
    too)."""
    o = options
    regression, teacher, distill, admm, masks = o.regression, o.teacher, o.distill, o.admm, o.masks
    context, progress, procs, on_step = o.context, o.progress, o.procs, o.on_step
    from holoserve.core.progress import current as current_progress

    procs = procs or Processes(next(model.parameters()).device)
    opt = make_optimizer(model, cfg)
    start, elapsed, losses = 0, 0.0, []
    if state_dir is not None and (saved := load_state(state_dir, f"{name}-progress")) is not None:
        tensors, meta = saved
        model.load_state_dict({k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")})
        load_optimizer(opt, tensors)
        restore_rng(tensors)
        if admm is not None:
            admm.load_state(tensors, meta["admm"])
        start, elapsed, losses = int(meta["step"]), float(meta["seconds"]), list(meta.get("losses", []))
        log.info("[%s] resuming at step %d/%d", name, start, cfg.steps)

    def checkpoint(step: int, seconds: float) -> None:
        if state_dir is None:
            return
        if not procs.main:
            procs.wait()
            return
        tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
        tensors.update(optimizer_tensors(opt))
        tensors.update(rng_tensors())
        meta: dict[str, Any] = {"phase": name, "step": step, "seconds": seconds, "losses": losses[-50:]}
        if admm is not None:
            tensors.update(admm.state_tensors())
            meta["admm"] = admm.state_meta()
        save_state(state_dir, f"{name}-progress", tensors, meta)
        procs.wait()

    want_hidden = bool(teacher is not None and distill and distill.enabled and distill.hidden_weight)
    if teacher is not None:
        teacher.eval()
    model.train()
    net = procs.wrap(model)  # the DDP wrapper with several processes; the model itself with one
    device = next(model.parameters()).device
    run_teacher = teacher
    if preset.compile:
        if procs.world > 1:
            log.warning("[%s] compile=true is for one process; %d processes train eagerly", name, procs.world)
        else:
            _can_compile(device)
            net = torch.compile(net, dynamic=True)
            run_teacher = torch.compile(teacher, dynamic=True) if teacher is not None else None
            log.info("[%s] student%s compiled (torch.compile, dynamic shapes): the first steps compile", name,
                     " and teacher" if teacher is not None else "")
    stream = train_batches(data, preset.batch_size, seed, preset.group_size, start_step=start)
    t0 = time.perf_counter() - elapsed
    # this phase's bar (or plain lines when stderr is not a terminal), under the job's overall bar
    bar = current_progress().phase(name, cfg.steps, initial=start, enabled=progress and procs.main)
    ctx = context() if context is not None else contextlib.nullcontext()
    profiler = StepProfiler(name, device, start, cfg.steps)
    with ctx:
        for step in range(start, cfg.steps):
            profiler.step_begins(step)
            with _part("data"):
                batch = to_device(procs.shard(next(stream)), device, non_blocking=True)
            for g in opt.param_groups:
                g["lr"] = lr_at(cfg, step)
            if on_step is not None:
                on_step(step)
            inputs = {k: v for k, v in batch.items() if k != "labels"}
            t_out = None
            if teacher is not None:
                with torch.no_grad(), _part("teacher"):
                    t_out = run_teacher(**inputs, output_hidden_states=want_hidden)
            with _part("student_forward"):
                out = net(**inputs, output_hidden_states=want_hidden)
                loss, parts = combined_loss(out, batch, t_out, distill or DistillConfig(enabled=False), regression)
                penalty = admm.penalty_loss() if admm is not None else None
            with _part("backward"):
                opt.zero_grad(set_to_none=True)
                procs.backward(loss if penalty is None else loss + penalty)
            with _part("optimizer"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                if admm is not None:
                    admm.penalty_step()
                    if (step + 1) % admm.cfg.interval == 0:
                        admm.update()
                if masks is not None:
                    reapply_masks(model, masks)
            with _part("loss_to_host"):
                losses.append(float(loss.detach()))
            profiler.step_ends(step)
            post = {"loss": f"{sum(losses[-50:]) / len(losses[-50:]):.4f}"}
            if admm is not None:
                post["rho"] = f"{admm.rho:.2g}"
            bar.update(1, **post)
            if (state_dir is not None and preset.save_every and (step + 1) % preset.save_every == 0
                    and step + 1 < cfg.steps):
                checkpoint(step + 1, time.perf_counter() - t0)
    bar.close()
    tail = losses[-50:]  # empty for a skipped (0-step) phase: no loss, not NaN (the manifest is strict JSON)
    return PhaseResult(steps=cfg.steps, seconds=time.perf_counter() - t0, loss=sum(tail) / len(tail) if tail else None)
