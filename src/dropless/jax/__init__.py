"""dropless for JAX: the grouped GEMM kernels as jitted, differentiable JAX ops, a Flax MoE layer and
expert parallelism under ``shard_map``. Install with ``pip install dropless[jax]``.
"""

from dropless.jax.grouped_mm import grouped_mm, ragged_dot

__all__ = ["grouped_mm", "ragged_dot"]
