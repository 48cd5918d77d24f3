"""Launch a jitted kernel through its compiled form, without the JIT's per-call binding.

Each call of a ``@triton.jit`` / ``@gluon.jit`` kernel binds its arguments and specializes every one
of them (a tensor descriptor's type string holds its shared-memory layout) before it finds the
compiled kernel: tens of microseconds of host time a launch. ``DirectLaunch`` keys the compiled
kernels itself: the first call of a key goes through the JIT (which compiles, launches and returns
the kernel), later calls launch the compiled kernel directly, the way the JIT does once it has it.

Two keys: the JIT's own (what its specialization depends on: the constexpr values, each tensor
descriptor's dtype, block shape and layout, and for every other argument Triton's specialization of it:
pointer alignment, integer width and divisibility), and a cheaper one made on every call that is at
least as fine (the constexpr and integer values themselves, each tensor's dtype and 16-byte alignment,
each descriptor's dtype, block shape and layout), which maps to the compiled kernel of the first.
Under Triton's interpreter (``TRITON_INTERPRET=1``, where kernels are not compiled) every call goes
through the kernel's own launch.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from triton import knobs
from triton.backends.compiler import BaseBackend
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import JITFunction, KernelParam, native_specialize_impl

from dropless.kernels.launch import make_context_current


# Per-call keys kept at most (integer arguments such as M are in them, so a caller whose sizes keep
# changing would add keys without end); past it the table starts again.
_MAX_CALL_KEYS = 4096


class DirectLaunch:
    """Launches of ``kernel`` with all its arguments given by name (constexprs and options included)."""

    def __init__(self, kernel: JITFunction) -> None:
        self.kernel = kernel
        # An interpreted kernel (TRITON_INTERPRET=1) has no compiled form, nor the JIT's parameters.
        self.compiles = isinstance(kernel, JITFunction)
        self.params = list(kernel.params) if self.compiles else []
        self._values = operator.itemgetter(*(p.name for p in self.params)) if self.compiles else None
        self._runtime = [i for i, p in enumerate(self.params) if not p.is_constexpr]
        self._constants: dict[tuple[str, ...], operator.itemgetter] = {}
        self.compiled: dict[tuple, Any] = {}
        self._by_call: dict[tuple, Any] = {}

    def _constant_values(self, args: dict[str, Any]) -> tuple:
        """The names and values of the constexprs and compile options (num_warps, ...): every argument
        that is not a runtime one."""
        names = tuple(args)
        constants = self._constants.get(names)
        if constants is None:
            runtime = {self.params[i].name for i in self._runtime}
            constants = self._constants[names] = operator.itemgetter(*sorted(args.keys() - runtime))
        return names, constants(args)

    def clear(self) -> None:
        """Forget every compiled kernel (the JIT's own cache still holds them)."""
        self.compiled.clear()
        self._by_call.clear()

    def __call__(self, grid: tuple[int, ...], call_key: tuple | None = None, **args: Any) -> None:
        """Launch on ``grid``. ``call_key``: the caller's own per-call key, which must determine every
        argument's specialization and the compile options (shapes, strides, dtypes, the 16-byte alignment
        of each pointer, the constexprs' sources); without it one is made from the arguments."""
        if not self.compiles:
            self.kernel[grid](**args)
            return
        values = self._values(args)
        device = torch.cuda.current_device()
        make_context_current(device)
        if call_key is None:
            call_key = (self._constant_values(args), *[_call_key(values[i]) for i in self._runtime])
        call_key = (device, call_key)
        compiled = self._by_call.get(call_key)
        if compiled is None:
            if len(self._by_call) >= _MAX_CALL_KEYS:
                self._by_call.clear()
            constant_values = self._constant_values(args)
            key = (device, constant_values, *map(_specialization, self.params, values))
            compiled = self.compiled.get(key)
            if compiled is None:
                self.compiled[key] = self._by_call[call_key] = self.kernel[grid](**args)
                return
            self._by_call[call_key] = compiled
        grid = (*grid, 1, 1)
        if _hooked():
            compiled[grid[:3]](*values)
            return
        compiled.run(grid[0], grid[1], grid[2], torch._C._cuda_getCurrentRawStream(device), compiled.function,
                     compiled.packed_metadata, None, None, None, *values)


def _hooked() -> bool:
    """Whether launch hooks are set (a profiler's): then launches go through the compiled kernel's
    runner, which calls them."""
    runtime = knobs.runtime
    return bool(runtime.launch_enter_hook.calls or runtime.launch_exit_hook.calls)


def _call_key(value: Any) -> Any:
    """A runtime argument's part of the per-call key: at least as fine as Triton's specialization of it."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, TensorDescriptor):
        return value.base.dtype, tuple(value.block_shape), value.layout
    return type(value), value


def _specialization(param: KernelParam, value: Any) -> Any:
    """What the JIT's specialization of one argument depends on."""
    if param.is_constexpr:
        return value
    if isinstance(value, TensorDescriptor):
        return value.base.dtype, tuple(value.block_shape), value.layout
    return native_specialize_impl(BaseBackend, value, False, not param.do_not_specialize,
                                  not param.do_not_specialize_on_alignment)
