"""Model FLOPs utilization: the useful FLOPs of training against the GPU's peak bf16 throughput."""

from __future__ import annotations

from dropless.train.model import parameter_counts
from dropless.train.presets import ModelConfig

# Dense bf16 tensor-core peaks (no sparsity), FLOP/s, by a part of the device name; first match wins.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("A100", 312e12),
)


def peak_bf16_flops(device_name: str) -> float | None:
    """The dense bf16 peak of the GPU called ``device_name`` (``NVIDIA H100 80GB HBM3``), None if unknown."""
    return next((peak for part, peak in PEAK_BF16_FLOPS if part in device_name), None)


def training_flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """FLOPs of one token's forward and backward: ``6 * active parameters`` for the matmuls (embedding
    lookup left out, only the ``top_k`` experts a token uses counted) plus ``12 * n_layers * d_model *
    seq_len`` for attention's score and value products (PaLM's convention, causal mask not discounted)."""
    _, active, _ = parameter_counts(config)
    return 6 * active + 12 * config.n_layers * config.d_model * seq_len


def model_flops_utilization(tokens_per_s: float, config: ModelConfig, seq_len: int, device_name: str,
                            num_gpus: int = 1) -> float | None:
    """Fraction of ``num_gpus`` GPUs' peak spent on useful training FLOPs at ``tokens_per_s`` (all GPUs
    together); None for a GPU whose peak is not known."""
    peak = peak_bf16_flops(device_name)
    if peak is None:
        return None
    return tokens_per_s * training_flops_per_token(config, seq_len) / (peak * num_gpus)
