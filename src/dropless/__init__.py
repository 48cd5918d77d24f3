"""dropless: fast dropless Mixture-of-Experts training on GPUs, with group sizes on the device."""

from dropless import integrations
from dropless.backend import get_backend, set_backend
from dropless.nn import GroupedLinear, MoE, TopKRouter
from dropless.ops import (
    QuantizedTensor,
    Recipe,
    geglu,
    grouped_mm,
    grouped_mm_wgrad,
    permute,
    quantize,
    quantize_weight,
    route,
    set_validation,
    swiglu,
    unpermute,
)

__version__ = "0.1.0"
__all__ = ["GroupedLinear", "MoE", "QuantizedTensor", "Recipe", "TopKRouter", "geglu", "integrations", "get_backend",
           "grouped_mm", "grouped_mm_wgrad", "permute", "quantize", "quantize_weight", "route", "set_backend",
           "set_validation", "swiglu", "unpermute"]
