"""Equal wall time against the default projection (preset equal_time_step_seconds), the paired benchmark's rule.

A projection slower than the default's (obs) gets no extra training time from it: the run times the default
projection on a copy of the model, and QAT gives up round(extra seconds / step seconds) of its steps, the step
seconds being the default recipe's own QAT seconds per step. The reference time and the steps given up are kept in
the run's state folder, so a resumed run trains the same schedule.
"""
from __future__ import annotations

import copy
import json
import logging
from dataclasses import replace
from typing import Any

from torch import nn

from holoserve.core.files import atomic_write_json

from .config import PhaseConfig
from .context import CompressionContext

log = logging.getLogger("holoserve.compress")

STATE = "equal-time.json"


def applies(ctx: CompressionContext) -> bool:
    return ctx.preset.equal_time_step_seconds is not None and ctx.preset.projection != "obs"


def time_reference(ctx: CompressionContext, student: nn.Module, layers) -> None:
    """Before the run's own projection: the default projection's wall seconds on a copy of `student` (the same
    calibration batches and mask metric), unless an earlier start of this run measured them."""
    if not applies(ctx):
        return
    path = ctx.state_dir / STATE
    with ctx.procs.main_first() as main:
        if main and not path.is_file():
            reference = replace(ctx, preset=replace(ctx.preset, projection="obs", projection_damp=None,
                                                    projection_batches=None))
            own = ctx.record.phases.pop("projection", None)
            log.info("[equal-time] timing the default projection (obs) on a copy of the model: the reference whose "
                     "wall time this run's %s projection is held to", ctx.preset.projection)
            reference.project_masks(copy.deepcopy(student), layers)
            seconds = ctx.record.phases.pop("projection")["seconds"]
            if own is not None:
                ctx.record.phases["projection"] = own
            atomic_write_json(path, {"reference": "obs", "reference_seconds": seconds,
                                     "step_seconds": ctx.preset.equal_time_step_seconds})


def held_to_reference(ctx: CompressionContext, cfg: PhaseConfig) -> PhaseConfig:
    """After the run's own projection: `cfg` less the QAT steps its extra wall time paid for (recorded under the
    projection phase's "equal_time")."""
    if not applies(ctx):
        return cfg
    path, steps, own = ctx.state_dir / STATE, cfg.steps or 0, ctx.record.phases["projection"]
    with ctx.procs.main_first() as main:  # the others read it after the main process wrote it
        state: dict[str, Any] = json.loads(path.read_text())
        if main and "steps_given_up" not in state:
            over = max(0.0, own["seconds"] - state["reference_seconds"])
            state.update(projection_seconds=own["seconds"], seconds_over=round(over, 1),
                         steps_given_up=min(steps, round(over / state["step_seconds"])))
            atomic_write_json(path, state)
    given_up = int(state["steps_given_up"])
    own["equal_time"] = {**state, "qat_steps": steps - given_up}
    log.info("[equal-time] the %s projection took %.0fs against the default's %.0fs: QAT gives up %d of its %d steps "
             "(%.2fs each)", ctx.preset.projection, state["projection_seconds"], state["reference_seconds"], given_up,
             steps, state["step_seconds"])
    return replace(cfg, steps=steps - given_up)
