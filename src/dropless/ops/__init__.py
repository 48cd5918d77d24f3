"""Public functional API: autograd, custom ops for torch.compile, argument checks, backend choice."""

from dropless.ops.activation import geglu, swiglu
from dropless.ops.checks import set_validation
from dropless.ops.grouped_mm import grouped_mm, grouped_mm_wgrad
from dropless.ops.permute import permute, unpermute
from dropless.ops.quantize import quantize, quantize_weight
from dropless.ops.routing import Routing, route
from dropless.quantized import QuantizedTensor, Recipe

__all__ = ["QuantizedTensor", "Recipe", "Routing", "geglu", "grouped_mm", "grouped_mm_wgrad", "permute", "quantize",
           "quantize_weight", "route", "set_validation", "swiglu", "unpermute"]
