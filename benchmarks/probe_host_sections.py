"""Where the host's time goes in the MoE layer's step, without a profiler: the step's parts wrapped in
wall-clock timers (inclusive: a part's time holds that of the parts it calls), timed over steps queued
behind a GPU sleep, so that no launch waits for the GPU.

    PYTHONPATH=src python benchmarks/probe_host_sections.py [--configs qwen3] [--recipes bf16 rowwise]

Prints, per recipe, the step's wall time (20 back to back), the host's time a step unwrapped (the least of 8 rounds of 4 steps) and wrapped,
then each part's calls a step, microseconds a call and a step (the least over rounds).
"""
import argparse
import functools
import time
from collections import defaultdict

import torch
from triton.runtime.jit import JITFunction

import dropless.nn.moe as moe_mod
import dropless.ops.grouped_mm_fp8 as fp8_mod
from dropless.bench.timing import back_to_back_ms
from dropless.kernels.direct_launch import DirectLaunch
from dropless.nn.grouped_linear import GroupedLinear
from dropless.nn.router import TopKRouter
from layer_step import layer_steps
from probe_launch_cost import per_call_us

TOTALS: dict[str, float] = defaultdict(float)
CALLS: dict[str, int] = defaultdict(int)


def timed(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TOTALS[name] += time.perf_counter() - t
            CALLS[name] += 1
    return wrapper


def wrap_all() -> None:
    TopKRouter.forward = timed("router", TopKRouter.forward)
    GroupedLinear.forward = timed("GroupedLinear.forward", GroupedLinear.forward)
    for name in ("sort_by_expert", "unpermute", "permute"):
        if hasattr(moe_mod, name):
            setattr(moe_mod, name, timed(name, getattr(moe_mod, name)))
    for name in list(moe_mod.ACTIVATIONS):
        moe_mod.ACTIVATIONS[name] = timed(f"activation {name}", moe_mod.ACTIVATIONS[name])
    for name in ("quantize", "quantize_permuted", "RAGGED_M", "RAGGED_K", "RAGGED_K_INTO", "take_fp8_copy",
                 "sum_copies"):
        setattr(fp8_mod, name, timed(f"fp8 {name}", getattr(fp8_mod, name)))
    fp8_mod.Fp8GroupedMM.forward = staticmethod(timed("Fp8GroupedMM.forward", fp8_mod.Fp8GroupedMM.forward))
    fp8_mod.Fp8GroupedMM.backward = staticmethod(timed("Fp8GroupedMM.backward", fp8_mod.Fp8GroupedMM.backward))
    DirectLaunch.__call__ = timed("launch DirectLaunch", DirectLaunch.__call__)
    JITFunction.run = timed("launch triton JIT", JITFunction.run)
    torch.autograd.grad = timed("autograd.grad (backward)", torch.autograd.grad)


def host_ms(step, rounds: int = 8, n: int = 4) -> float:
    """The least host time a step over ``rounds`` rounds of ``n`` steps queued behind a GPU sleep."""
    return per_call_us(step, True, rounds, n) / 1e3


def wall_ms(step, rounds: int = 3, n: int = 20) -> float:
    """The median over ``rounds`` of ``n`` steps run back to back, per step."""
    return sorted(back_to_back_ms(step, n) for _ in range(rounds))[rounds // 2]


def sections(step, rounds: int = 8, n: int = 4) -> dict[str, tuple[float, float]]:
    """Each part's (calls a step, least microseconds a step over the rounds)."""
    best: dict[str, float] = {}
    calls: dict[str, float] = {}
    for _ in range(rounds):
        TOTALS.clear()
        CALLS.clear()
        torch.cuda._sleep(int(2e8))
        for _ in range(n):
            step()
        torch.cuda.synchronize()
        for k, v in TOTALS.items():
            best[k] = min(best.get(k, float("inf")), v / n * 1e6)
            calls[k] = CALLS[k] / n
    return {k: (calls[k], best[k]) for k in best}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--configs", nargs="+", default=["qwen3"])
    p.add_argument("--recipes", nargs="+", default=["bf16", "rowwise"])
    args = p.parse_args()
    steps = {}
    for config in args.configs:
        built = layer_steps(config, [None if recipe == "bf16" else recipe for recipe in args.recipes])
        for recipe, step in built.items():
            steps[(config, recipe or "bf16")] = (step, host_ms(step), wall_ms(step))
    wrap_all()
    for (name, recipe), (step, plain, wall) in steps.items():
        for _ in range(3):
            step()
        wrapped = host_ms(step)
        print(f"\n{name} {recipe}: wall {wall:.3f} ms a step; host {plain:.3f} unwrapped, {wrapped:.3f} wrapped")
        print(f"{'part':34s} {'calls':>6s} {'us/call':>8s} {'us/step':>8s}")
        for part, (calls, us) in sorted(sections(step).items(), key=lambda kv: -kv[1][1]):
            print(f"{part:34s} {calls:6.1f} {us / calls:8.1f} {us:8.1f}")


if __name__ == "__main__":
    main()
