"""Launch a jitted kernel through its compiled form, without the JIT's per-call binding.

Each call of a ``@triton.jit`` / ``@gluon.jit`` kernel binds its arguments and specializes every one
of them (a tensor descriptor's type string holds its shared-memory layout) before it finds the
compiled kernel: tens of microseconds of host time a launch. ``DirectLaunch`` keys the compiled kernels itself: the first call of a key goes through the JIT
(which compiles, launches and returns the kernel), later calls launch the compiled kernel directly.

The key is what the JIT's specialization depends on: the constexpr values, each tensor descriptor's
dtype, block shape and layout, and for every other argument Triton's own specialization of it
(pointer alignment, integer width and divisibility).
"""

from __future__ import annotations

from typing import Any

import torch
from triton.backends.compiler import BaseBackend
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import JITFunction, KernelParam, native_specialize_impl


class DirectLaunch:
    """Launches of ``kernel`` with all its arguments given by name (constexprs and options included)."""

    def __init__(self, kernel: JITFunction) -> None:
        self.kernel = kernel
        self.params = list(kernel.params)
        self.compiled: dict[tuple, Any] = {}

    def __call__(self, grid: tuple[int, ...], **args: Any) -> None:
        values = [args[param.name] for param in self.params]
        key = (torch.cuda.current_device(), *map(_specialization, self.params, values))
        compiled = self.compiled.get(key)
        if compiled is None:
            self.compiled[key] = self.kernel[grid](**args)
        else:
            compiled[(*grid, 1, 1)[:3]](*values)  # the compiled kernel takes all three grid dimensions


def _specialization(param: KernelParam, value: Any) -> Any:
    """What the JIT's specialization of one argument depends on."""
    if param.is_constexpr:
        return value
    if isinstance(value, TensorDescriptor):
        return value.base.dtype, tuple(value.block_shape), value.layout
    return native_specialize_impl(BaseBackend, value, False, not param.do_not_specialize,
                                  not param.do_not_specialize_on_alignment)
