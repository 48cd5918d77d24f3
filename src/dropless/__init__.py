"""dropless: fast dropless Mixture-of-Experts training on GPUs, with group sizes on the device."""

from dropless.backend import get_backend, set_backend
from dropless.nn import GroupedLinear
from dropless.ops import grouped_mm, grouped_mm_wgrad, set_validation

__version__ = "0.1.0"
__all__ = ["GroupedLinear", "get_backend", "grouped_mm", "grouped_mm_wgrad", "set_backend", "set_validation"]
