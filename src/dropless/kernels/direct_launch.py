"""Launch a jitted kernel through its compiled form, without the JIT's per-call binding.

Each call of a ``@triton.jit`` / ``@gluon.jit`` kernel binds its arguments and specializes every one
of them (a tensor descriptor's type string holds its shared-memory layout) before it finds the
compiled kernel: tens of microseconds of host time a launch. ``DirectLaunch`` keys the compiled
kernels itself: the first call of a key goes through the JIT (which compiles, launches and returns
the kernel), later calls launch the compiled kernel directly.

The key is what the JIT's specialization depends on: the constexpr values, each tensor descriptor's
dtype, block shape and layout, and for every other argument Triton's own specialization of it
(pointer alignment, integer width and divisibility).
"""

from __future__ import annotations

import ctypes
import functools
import threading
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
        device = torch.cuda.current_device()
        key = (device, *map(_specialization, self.params, values))
        compiled = self.compiled.get(key)
        if compiled is None:
            self.compiled[key] = self.kernel[grid](**args)
        else:
            _context_current(device)
            compiled[(*grid, 1, 1)[:3]](*values)  # the compiled kernel takes all three grid dimensions


def _specialization(param: KernelParam, value: Any) -> Any:
    """What the JIT's specialization of one argument depends on."""
    if param.is_constexpr:
        return value
    if isinstance(value, TensorDescriptor):
        return value.base.dtype, tuple(value.block_shape), value.layout
    return native_specialize_impl(BaseBackend, value, False, not param.do_not_specialize,
                                  not param.do_not_specialize_on_alignment)


_THREAD = threading.local()


def _context_current(device: int) -> None:
    """Make ``device``'s primary CUDA context current in this thread, once per thread and device.

    A compiled kernel's launch encodes its TMA descriptors through the driver API, which needs a
    current context. A thread that has made no CUDA runtime call yet has none: autograd's device
    thread, when a dropless op is the first CUDA work of a backward pass. (Triton's JIT sets the
    context when it loads a kernel, in the thread that compiles it.)
    """
    done = getattr(_THREAD, "devices", None)
    if done is None:
        done = _THREAD.devices = set()
    if device in done:
        return
    libcuda = _libcuda()
    context = ctypes.c_void_p()
    _check(libcuda.cuCtxGetCurrent(ctypes.byref(context)), "cuCtxGetCurrent")
    current = ctypes.c_int(-1)
    if context.value:
        _check(libcuda.cuCtxGetDevice(ctypes.byref(current)), "cuCtxGetDevice")
    if current.value != device:
        handle = ctypes.c_int()
        _check(libcuda.cuDeviceGet(ctypes.byref(handle), device), "cuDeviceGet")
        _check(libcuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), handle), "cuDevicePrimaryCtxRetain")
        _check(libcuda.cuCtxSetCurrent(context), "cuCtxSetCurrent")
    done.add(device)


@functools.cache
def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _check(result: int, call: str) -> None:
    if result != 0:
        raise RuntimeError(f"{call} failed with CUDA driver error {result}")
