"""The host's time a step with and without this version's host-path changes, in one process (processes differ
by more than the changes: v45): the Qwen3 layer's FP8 step and a grouped GEMM's FP8 fwd+bwd at qwen3-down, each
timed in turns with ``quantize``'s plans on and off and with the ``DirectLaunch`` launches of the routing,
permute and GLU kernels on and off (off: through the JIT, as before).

    PYTHONPATH=src:benchmarks python benchmarks/probe_host_switches.py [--rounds 6]

Per case and setting: the median, least and most over rounds of ``host_steps.host_ms``, the settings taken in
turns within each round.
"""
import argparse
import importlib
import statistics
from contextlib import contextmanager

from dropless.kernels import permute, route, swiglu
from dropless.kernels.quantize import _ROWWISE
from host_steps import gemm_steps, host_ms
from layer_step import layer_steps

quantize_ops = importlib.import_module("dropless.ops.quantize")
LAUNCHES = [permute._PERMUTE, permute._UNPERMUTE, swiglu._GLU, route._ROUTE, route._ROUTE_SUMS, route._SLOT_SCATTER,
            route._ROUTE_BACKWARD, _ROWWISE]


@contextmanager
def setting(plans: bool, direct: bool):
    """Plans off: every ``quantize`` takes the checked path. Direct off: those kernels launch through the JIT."""
    key = quantize_ops._plan_key
    if not plans:
        quantize_ops._plan_key = lambda *args: None
    for launch in LAUNCHES:
        launch.compiles = direct
    try:
        yield
    finally:
        quantize_ops._plan_key = key
        for launch in LAUNCHES:
            launch.compiles = True


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args()
    cases = {"gemm rowwise cached": gemm_steps()["rowwise_cached"],
             "layer rowwise": layer_steps("qwen3", ["rowwise"])["rowwise"]}
    settings = {"both on": (True, True), "plans off": (False, True), "direct off": (True, False),
                "both off": (False, False)}
    times = {(c, s): [] for c in cases for s in settings}
    for _ in range(args.rounds):
        for case, step in cases.items():
            for name, (plans, direct) in settings.items():
                with setting(plans, direct):
                    step()
                    times[(case, name)].append(host_ms(step, n=3, rounds=4))
    print(f"{'case':22s} {'setting':11s} {'host ms (median)':>17s} {'min':>7s} {'max':>7s}")
    for (case, name), ms in times.items():
        print(f"{case:22s} {name:11s} {statistics.median(ms):17.3f} {min(ms):7.3f} {max(ms):7.3f}")


if __name__ == "__main__":
    main()
