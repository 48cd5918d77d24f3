"""Public functional API: autograd, custom ops for torch.compile, argument checks, backend choice."""

from dropless.ops.activation import geglu, swiglu
from dropless.ops.checks import set_validation
from dropless.ops.grouped_mm import grouped_mm, grouped_mm_wgrad
from dropless.ops.permute import permute, unpermute
from dropless.ops.routing import Routing, route

__all__ = ["Routing", "geglu", "grouped_mm", "grouped_mm_wgrad", "permute", "route", "set_validation", "swiglu",
           "unpermute"]
