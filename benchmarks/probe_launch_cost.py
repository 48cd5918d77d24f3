"""What one launch costs the host, with the GPU idle and with launches queued behind a GPU sleep, and the
MoE layer's step timed both ways (does queuing behind a sleep change what the host pays?).

    PYTHONPATH=src python benchmarks/probe_launch_cost.py

Per row, the least microseconds per call over 10 rounds of 200 calls: a Triton kernel of one pointer
launched through the JIT, a torch op (``x.add_(1)``), ``torch.empty``; each with the GPU idle at the
start of a round (synchronized before) and queued behind ~50 ms of ``torch.cuda._sleep``. Then the FP8
step (Qwen3, rowwise), its host time idle-started and behind a sleep.
"""
import time

import torch
import triton
import triton.language as tl

from layer_step import layer_steps


@triton.jit
def _touch(x):
    tl.store(x, tl.load(x) + 1)


def per_call_us(fn, behind_sleep: bool, rounds: int = 10, n: int = 200) -> float:
    """The least host microseconds a call of ``fn`` over ``rounds`` rounds of ``n`` calls, each round started
    with the GPU idle, and queued behind ~50 ms of GPU sleep if ``behind_sleep``."""
    best = float("inf")
    for _ in range(3):
        fn()
    for _ in range(rounds):
        torch.cuda.synchronize()
        if behind_sleep:
            torch.cuda._sleep(int(1e8))
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    torch.cuda.synchronize()
    return best


def main() -> None:
    x = torch.zeros(16, device="cuda")
    cases = {
        "triton JIT launch (1 pointer)": lambda: _touch[(1,)](x),
        "torch x.add_(1)": lambda: x.add_(1),
        "torch.empty(1024)": lambda: torch.empty(1024, device="cuda"),
    }
    print(f"{'call':34s} {'idle us':>8s} {'behind sleep us':>16s}")
    for name, fn in cases.items():
        print(f"{name:34s} {per_call_us(fn, False):8.1f} {per_call_us(fn, True):16.1f}")
    for recipe, step in layer_steps("qwen3", [None, "rowwise"]).items():
        idle = per_call_us(step, False, rounds=8, n=1) / 1e3
        queued = per_call_us(step, True, rounds=8, n=1) / 1e3
        print(f"qwen3 {recipe or 'bf16'} step host, ms: idle-started {idle:.3f}, behind a sleep {queued:.3f}")


if __name__ == "__main__":
    main()
