"""Distillation losses from the dense teacher (GPUSQ-TLM style): labels + logits KL + hidden-state MSE."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import DistillConfig
from .data import labelled


def task_loss(logits: torch.Tensor, labels: torch.Tensor, regression: bool) -> torch.Tensor:
    """Cross-entropy (regression: MSE) over the rows with a real label; 0 when the batch has none
    (rows only the teacher labels, DistillConfig.augment)."""
    keep = labelled(labels)
    if not bool(keep.all()):
        if not bool(keep.any()):
            return logits.sum() * 0.0
        logits, labels = logits[keep], labels[keep]
    if regression:
        return F.mse_loss(logits.squeeze(-1), labels.float())
    return F.cross_entropy(logits, labels)


def logits_kd(student: torch.Tensor, teacher: torch.Tensor, temperature: float, regression: bool) -> torch.Tensor:
    if regression:
        return F.mse_loss(student, teacher)
    t = temperature
    return F.kl_div(F.log_softmax(student / t, -1), F.log_softmax(teacher / t, -1), log_target=True,
                    reduction="batchmean") * (t * t)


def hidden_mse(student: tuple[torch.Tensor, ...], teacher: tuple[torch.Tensor, ...],
               attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean over layers of the per-token MSE on non-padding positions."""
    m = attention_mask.unsqueeze(-1).to(student[0].dtype)
    denom = m.sum() * student[0].shape[-1]
    total = student[0].new_zeros(())
    for s, t in zip(student, teacher):
        total = total + (((s - t) ** 2) * m).sum() / denom
    return total / len(student)


def combined_loss(out, batch: dict, teacher_out, cfg: DistillConfig, regression: bool
                  ) -> tuple[torch.Tensor, dict[str, float]]:
    """Task loss, plus KD terms when a teacher output is given. Returns (loss, parts for logging)."""
    parts = {}
    loss = task_loss(out.logits, batch["labels"], regression)
    parts["task"] = float(loss.detach())
    if teacher_out is None or not cfg.enabled:
        return loss, parts
    loss = cfg.task_weight * loss
    if cfg.logits_weight:
        kd = logits_kd(out.logits, teacher_out.logits, cfg.temperature, regression)
        parts["kd"] = float(kd.detach())
        loss = loss + cfg.logits_weight * kd
    if cfg.hidden_weight and out.hidden_states is not None:
        hm = hidden_mse(out.hidden_states, teacher_out.hidden_states, batch["attention_mask"])
        parts["hid"] = float(hm.detach())
        loss = loss + cfg.hidden_weight * hm
    return loss, parts
