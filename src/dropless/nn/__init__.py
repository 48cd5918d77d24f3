"""Modules built on the dropless ops."""

from dropless.nn.grouped_linear import GroupedLinear
from dropless.nn.moe import MoE, SharedExperts
from dropless.nn.router import TopKRouter

__all__ = ["GroupedLinear", "MoE", "SharedExperts", "TopKRouter"]
