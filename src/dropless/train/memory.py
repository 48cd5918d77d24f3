"""Will a run fit the GPU? An estimate of training memory, checked before anything is allocated."""

from __future__ import annotations

from dataclasses import dataclass

from dropless.train.errors import TrainError
from dropless.train.model import parameter_counts
from dropless.train.presets import PRESETS, ModelConfig

GIB = 2**30
# fp32 weights, gradients and AdamW's two moments, plus the bf16 copies autocast saves for backward.
BYTES_PER_PARAMETER = 4 + 4 + 8 + 2
# What the estimate leaves out (backward's temporaries, allocator fragmentation, GEMM workspaces).
MARGIN = 1.2
WORKSPACE = 1 * GIB


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one GPU needs to train a model with bf16 autocast, by part."""

    states: int
    activations: int

    @property
    def total(self) -> int:
        return int((self.states + self.activations) * MARGIN) + WORKSPACE


def activation_bytes_per_token(config: ModelConfig) -> int:
    """Bytes autograd keeps for backward per token and layer under bf16 autocast (fp32 residual stream).

    fp32: both norms' inputs and outputs and the router's input (5 d values). bf16: attention's
    projection input, q, k, v (and the roped q and k) and output (7 d values). Each of the top_k token
    copies in the MoE: its input and output (2 d) and the gate/up and activated hidden states
    (3 d_ff), in bf16. The router's fp32 scores and choices: a few values per expert.
    """
    d, k = config.d_model, config.top_k
    return 4 * 5 * d + 2 * 7 * d + 2 * k * (2 * d + 3 * config.d_ff) + 16 * config.num_experts + 64


def estimate_training_memory(config: ModelConfig, batch_size: int, seq_len: int) -> MemoryEstimate:
    """Memory to train ``config`` on ``batch_size`` sequences of ``seq_len`` tokens on one GPU."""
    total_params, _, _ = parameter_counts(config)
    tokens = batch_size * seq_len
    # bf16 logits, their fp32 copy and its gradient.
    logits = tokens * config.vocab_size * (2 + 4 + 4)
    activations = tokens * config.n_layers * activation_bytes_per_token(config) + logits
    return MemoryEstimate(BYTES_PER_PARAMETER * total_params, activations)


def check_fits(preset: str, config: ModelConfig, batch_size: int, seq_len: int, free_bytes: int,
               device_name: str) -> None:
    """Raise TrainError, with a batch size and the presets that would fit, if the run's estimate
    exceeds the GPU's ``free_bytes``."""
    need = estimate_training_memory(config, batch_size, seq_len)
    if need.total <= free_bytes:
        return
    fitting_batch = next((b for b in range(batch_size - 1, 0, -1)
                          if estimate_training_memory(config, b, seq_len).total <= free_bytes), None)
    smaller = [name for name, p in PRESETS.items() if name != preset
               and estimate_training_memory(p.model, batch_size, seq_len).total <= free_bytes]
    advice = [f"--batch-size {fitting_batch}"] if fitting_batch else []
    advice += [f"--preset {name}" for name in smaller]
    raise TrainError(
        f"preset {preset!r} with batch size {batch_size} x {seq_len} tokens needs about {need.total / GIB:.1f} GiB "
        f"of GPU memory (weights, gradients and AdamW states {need.states / GIB:.1f} GiB, activations "
        f"{need.activations / GIB:.1f} GiB), but {device_name} has {free_bytes / GIB:.1f} GiB free: "
        + (f"try {' or '.join(advice)}" if advice else "try a smaller preset or --seq-len"))
