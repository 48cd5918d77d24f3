"""Modules built on the dropless ops."""

from dropless.nn.grouped_linear import GroupedLinear

__all__ = ["GroupedLinear"]
