"""What a launch needs to know about the device it runs on: program count, TMA, interpreter."""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from dataclasses import dataclass

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

_TMA_ALIGN = 16  # bytes: TMA needs 16-byte aligned base addresses and strides


def interpreting() -> bool:
    """True when Triton kernels run on the CPU through ``TRITON_INTERPRET=1``."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass(frozen=True)
class LaunchInfo:
    """Per-device launch facts.

    num_programs: size of the persistent grid. tma: the device has the tensor memory accelerator
    (Hopper or newer, or the interpreter, which emulates it). upcast: dot operands are upcast to fp32
    first (the interpreter's bf16/fp16 ``tl.dot`` is unreliable).
    """

    num_programs: int
    tma: bool
    upcast: bool

    @staticmethod
    def precision(dtype: torch.dtype) -> str:
        """fp32 operands multiply in full fp32; 16-bit ones use the tensor cores natively."""
        return "ieee" if dtype == torch.float32 else "tf32"

    @staticmethod
    def tma_ok(t: torch.Tensor) -> bool:
        """A tensor can be read through a TMA descriptor: unit last stride, 16-byte aligned rest."""
        size = t.element_size()
        return (t.stride(-1) == 1 and t.data_ptr() % _TMA_ALIGN == 0
                and all((s * size) % _TMA_ALIGN == 0 for s in t.stride()[:-1]))

    @staticmethod
    def descriptor(t: torch.Tensor, block_shape: list[int]) -> TensorDescriptor:
        """A TMA descriptor of ``t`` for a Triton kernel, with t's device's context current in this thread
        (the launch encodes it through the driver)."""
        if t.is_cuda:
            make_context_current(t.get_device())
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block_shape)


_THREAD = threading.local()


def make_context_current(device: int) -> None:
    """Make ``device``'s primary CUDA context current in this thread, once per thread and device.

    A launch with host-side TMA descriptors encodes them through the driver API, which needs a current
    context. A thread that has made no CUDA runtime call yet has none: autograd's device thread, when a
    dropless op is the first CUDA work of a backward pass. (Triton's JIT sets the context when it loads
    a kernel, in the thread that compiles it.)
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


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host integers (``triton.cdiv`` is a constexpr function, with a wrapper on every call)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``), for host integers."""
    return 1 << max(n - 1, 0).bit_length()


def weight_nk(b: torch.Tensor) -> bool:
    """``b [E, K, N]`` (a weight, or its gradient) is a transposed view of ``[E, N, K]`` storage (K
    contiguous, nn.Linear layout)."""
    return b.stride(1) == 1 and b.stride(2) != 1


@functools.cache
def _triton_at_least(major: int, minor: int) -> bool:
    return tuple(int(part) for part in triton.__version__.split(".")[:2]) >= (major, minor)


@functools.cache
def _capability(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0]


def hopper_gluon_device(device: torch.device) -> bool:
    """Whether the Gluon kernels for Hopper run on ``device``: an sm_90 GPU, and Triton 3.6 or newer
    (their Gluon API)."""
    return device.type == "cuda" and _triton_at_least(3, 6) and _capability(device) == 9


def hopper_kernels_ok(*tensors: torch.Tensor, padded: bool = False) -> bool:
    """Whether the Gluon kernels for Hopper can take these operands: ``hopper_gluon_device``, all of one
    16-bit dtype, none empty, each readable by TMA as laid out (``padded``: once those TMA cannot read are
    copied into padded buffers, ``kernels/padded.py``)."""
    first = tensors[0]
    if first.dtype not in (torch.bfloat16, torch.float16) or not hopper_gluon_device(first.device):
        return False
    return all(t.dtype == first.dtype and t.numel() > 0 and (padded or LaunchInfo.tma_ok(t)) for t in tensors)


def hopper_wgrad_ok(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, padded: bool = False) -> bool:
    """Whether the Hopper weight-gradient kernel can take ``a``, ``b`` and the output ``c``: a and b as
    ``hopper_kernels_ok`` asks, c of their dtype or fp32, non-empty and TMA-able (or padded)."""
    return (hopper_kernels_ok(a, b, padded=padded) and c.dtype in (a.dtype, torch.float32) and c.numel() > 0
            and (padded or LaunchInfo.tma_ok(c)))


def hopper_fp8_wgrad_ok(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> bool:
    """Whether the Hopper weight-gradient kernel can take FP8 ``a [Mp, K]`` and ``b [Mp, N]`` quantized per
    group along the tokens (views of token-contiguous storage) and the output ``c [E, K, N]``: on
    ``hopper_gluon_device``, each transposed operand and c readable by TMA, c 16-bit or fp32, none empty."""
    return (a.dtype == b.dtype == torch.float8_e4m3fn and hopper_gluon_device(a.device)
            and c.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and min(a.numel(), b.numel(), c.numel()) > 0
            and LaunchInfo.tma_ok(a.t()) and LaunchInfo.tma_ok(b.t()) and LaunchInfo.tma_ok(c))


@functools.cache
def _launch_info(device: torch.device, no_tma: bool) -> LaunchInfo:
    """``launch_info`` of ``device``, kept: it is asked on every launch."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return LaunchInfo(num_programs=props.multi_processor_count, tma=props.major >= 9 and not no_tma, upcast=False)
    return LaunchInfo(num_programs=4, tma=not no_tma, upcast=True)


def launch_info(device: torch.device, tma: bool | None = None) -> LaunchInfo:
    """Launch facts for ``device``; ``tma=False`` forces the pointer path (``True`` is a request)."""
    if device.type != "cuda" and not interpreting():
        raise RuntimeError(
            f"Triton kernels need a CUDA tensor (got device {device}); set TRITON_INTERPRET=1 to run "
            "them on the CPU, or use the reference backend")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    return _launch_info(device, tma is False)
