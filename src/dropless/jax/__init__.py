"""dropless for JAX: the grouped GEMM kernels as jitted, differentiable JAX ops, a Flax MoE layer and
expert parallelism under ``shard_map``. Install with ``pip install dropless[jax]``.
"""

from dropless.jax.grouped_mm import grouped_mm, ragged_dot
from dropless.jax.language_model import MoELanguageModel
from dropless.jax.moe import MoE
from dropless.jax.parallel import DispatchHandle, combine, dispatch
from dropless.jax.patch import replace_ragged_dot
from dropless.jax.routing import Routing, route

__all__ = ["DispatchHandle", "MoE", "MoELanguageModel", "Routing", "combine", "dispatch", "grouped_mm", "ragged_dot",
           "replace_ragged_dot", "route"]
