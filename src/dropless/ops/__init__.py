"""Public functional API: autograd, custom ops for torch.compile, argument checks, backend choice."""

from dropless.ops.checks import set_validation
from dropless.ops.grouped_mm import grouped_mm, grouped_mm_wgrad

__all__ = ["grouped_mm", "grouped_mm_wgrad", "set_validation"]
