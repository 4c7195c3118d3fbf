"""Several processes, one compression job: 🤗 Accelerate (DDP) when launched that way.

    accelerate launch --multi_gpu --num_processes 8 -m holoserve compress --train data.csv --out runs/x
    accelerate launch --multi_gpu --num_processes 2 -m holoserve compress --device cpu ...   # 2 CPU processes (gloo)

Every process reads the same rows and draws the same batch stream; each takes its own slice of each
batch and DDP averages the gradients, so the global batch, the step count and the schedules are those
of a single-process run. Weights stay identical on every process, so the ADMM projections, the masks,
the calibration and the evaluation are computed alike everywhere; only the main process writes
(training state, teacher, checkpoint) and the others wait for it. A single process needs no Accelerate.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from holoserve import HoloServeError


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


def launched() -> bool:
    """True under `accelerate launch` / torchrun with more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


class Processes:
    """The job's processes: one (no Accelerate) or a DDP group through Accelerate."""

    def __init__(self, device: torch.device):
        self.accelerator = None
        self.world, self.rank = 1, 0
        if launched():
            from accelerate import Accelerator

            self.accelerator = Accelerator(cpu=device.type == "cpu")
            self.world, self.rank = self.accelerator.num_processes, self.accelerator.process_index
        self.device = self.accelerator.device if self.accelerator is not None else device

    @property
    def main(self) -> bool:
        return self.rank == 0

    def wait(self) -> None:
        if self.accelerator is not None:
            self.accelerator.wait_for_everyone()

    @contextmanager
    def main_first(self):
        """Run the body on the main process (a write); the others wait until it is done."""
        try:
            yield self.main
        finally:
            self.wait()

    def wrap(self, model: nn.Module) -> nn.Module:
        """The model to call in training steps (DDP-wrapped with several processes)."""
        if self.accelerator is None:
            return model
        return self.accelerator.prepare_model(model)

    def backward(self, loss: torch.Tensor) -> None:
        if self.accelerator is None:
            loss.backward()
        else:
            self.accelerator.backward(loss)

    def shard(self, batch: dict[str, Any]) -> dict[str, Any]:
        """This process's rows of a global batch (all rows with one process)."""
        if self.world == 1:
            return batch
        n = next(iter(batch.values())).shape[0]
        if n < self.world:
            return batch  # a tiny last batch: every process takes it whole (same average gradient)
        return {k: v[self.rank::self.world] for k, v in batch.items()}

    def mean(self, value: float) -> float:
        """The mean of a number over the processes (the logged loss)."""
        if self.accelerator is None:
            return value
        t = torch.tensor([value], device=self.device)
        return float(self.accelerator.reduce(t, reduction="mean"))
