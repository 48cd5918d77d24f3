"""The optimizer and learning-rate schedule of ``dropless train``: AdamW, linear warm-up, cosine decay."""

from __future__ import annotations

import math

import torch
from torch import nn

from dropless.train.presets import TrainConfig


def make_optimizer(model: nn.Module, config: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW over the model's parameters: weight decay on matrices and expert weights (2+ dims), none on
    norms. The fused CUDA implementation on a GPU, the default one elsewhere."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2),
                             fused=device.type == "cuda")


def lr_at(step: int, config: TrainConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warm-up over ``warmup_steps`` to ``lr``,
    then cosine decay to ``min_lr_ratio * lr`` at ``steps``."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    decay_steps = max(1, config.steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / decay_steps)
    floor = config.min_lr_ratio * config.lr
    return floor + 0.5 * (config.lr - floor) * (1 + math.cos(math.pi * progress))
