"""Where the host's time goes, by function, in a grouped GEMM's fwd+bwd step at qwen3-down (BF16, FP8 rowwise with
the weights cached and quantized in the call, ``torch._grouped_mm``) and in the Qwen3 layer's step (BF16, FP8
rowwise): cProfile over steps queued behind a GPU sleep, so that no launch waits for the GPU.

    PYTHONPATH=src python benchmarks/probe_host_profile.py OUT_DIR       (on a GPU: writes OUT_DIR/<case>.prof)
    python benchmarks/probe_host_profile.py --summary OUT_DIR/<case>.prof ...   (anywhere: the tables)

Each case prints its host time a step unprofiled (the least of 6 rounds of 5 steps). The summary gives, per
step, each function's own and cumulative microseconds (profiled: inflated by the profiler's cost on Python calls)
and calls, largest own time first.
"""
import cProfile
import os
import pstats
import sys

STEPS = {"gemm": 20, "layer": 10}  # steps profiled per case, by kind


def summary(path: str, top: int = 45) -> str:
    """The ``top`` functions of a dump by their own time: microseconds a step (own, cumulative) and calls."""
    name = os.path.basename(path).removesuffix(".prof")
    n = STEPS[name.split("_")[0]]
    stats = pstats.Stats(path)
    rows = sorted(((tt / n * 1e6, ct / n * 1e6, nc / n, f) for f, (_, nc, tt, ct, _) in stats.stats.items()),
                  key=lambda r: -r[0])
    lines = [f"{name}: {stats.total_tt / n * 1e3:.3f} ms a step profiled, {stats.total_calls / n:.0f} calls a step",
             f"{'own us':>8s} {'cum us':>8s} {'calls':>6s} function"]
    for own, cum, calls, (file, line, func) in rows[:top]:
        lines.append(f"{own:8.1f} {cum:8.1f} {calls:6.1f} {os.path.basename(file)}:{line}({func})")
    return "\n".join(lines)


def main(out: str) -> None:
    import torch

    from host_steps import gemm_steps, host_ms
    from layer_step import layer_steps

    def profile(name, step):
        for _ in range(3):
            step()
        host = host_ms(step, rounds=6)
        torch.cuda.synchronize()
        torch.cuda._sleep(int(1.5e9))
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(STEPS[name.split("_")[0]]):
            step()
        prof.disable()
        torch.cuda.synchronize()
        prof.dump_stats(os.path.join(out, f"{name}.prof"))
        print(f"{name}: host {host:.3f} ms a step", flush=True)

    steps = gemm_steps()
    for case in ("bf16", "rowwise_cached", "rowwise", "torch"):
        profile(f"gemm_{case}", steps[case])
    del steps
    for recipe, step in layer_steps("qwen3", [None, "rowwise"]).items():
        profile(f"layer_{recipe or 'bf16'}", step)


if __name__ == "__main__":
    if sys.argv[1] == "--summary":
        print("\n\n".join(summary(path) for path in sys.argv[2:]))
    else:
        main(sys.argv[1])
