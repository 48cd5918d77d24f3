"""The fwd+bwd steps the host probes time, and their host time: a grouped GEMM at qwen3-down (BF16, FP8 rowwise
with the weights cached and quantized in the call, ``torch._grouped_mm``) on balanced routing."""
from collections.abc import Callable

import torch

import dropless
from dropless.bench.routing import group_sizes
from probe_launch_cost import per_call_us


def host_ms(step: Callable[[], object], n: int = 5, rounds: int = 8) -> float:
    """The least host milliseconds a step over ``rounds`` rounds of ``n`` steps, each round queued behind a
    GPU sleep so that no launch waits for the GPU."""
    return per_call_us(step, True, rounds, n) / 1e3


def gemm_steps() -> dict[str, Callable[[], tuple]]:
    """``{case: step}``: each step one forward and backward (``torch.autograd.grad``) of the same operands."""
    E, M, K, N = 128, 65536, 768, 2048
    offsets = torch.tensor(group_sizes(E, M, "balanced"), device="cuda").cumsum(0).to(torch.int32)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5).transpose(1, 2).requires_grad_()
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    pair = dropless.quantize_weight(w.detach(), "rowwise")
    return {
        "bf16": lambda: torch.autograd.grad(dropless.grouped_mm(x, w, offsets), (x, w), dy),
        "rowwise_cached": lambda: torch.autograd.grad(
            dropless.grouped_mm(x, w, offsets, recipe="rowwise", w_quantized=pair), (x, w), dy),
        "rowwise": lambda: torch.autograd.grad(dropless.grouped_mm(x, w, offsets, recipe="rowwise"), (x, w), dy),
        "torch": lambda: torch.autograd.grad(torch._grouped_mm(x, w, offs=offsets), (x, w), dy),
    }
