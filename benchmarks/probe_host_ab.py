"""Host and wall time a step, a grouped GEMM's fwd+bwd at qwen3-down (``host_steps``: BF16, FP8 rowwise with the
weights cached and quantized in the call) and the Qwen3 layer's (BF16, FP8 rowwise), for whichever dropless
PYTHONPATH gives: one JSON line of ``[host ms, wall ms]`` per case. Two versions are compared by running it in
turns over each, an older one from ``git archive COMMIT src | tar -x -C OLD``:

    for v in OLD/src src OLD/src src; do PYTHONPATH=$v:benchmarks python benchmarks/probe_host_ab.py; done

host: ``host_steps.host_ms``; wall: the median of 3 rounds of 20 steps back to back.
"""
import json

import dropless
from dropless.bench.timing import back_to_back_ms
from host_steps import gemm_steps, host_ms
from layer_step import layer_steps


def wall_ms(step) -> float:
    return sorted(back_to_back_ms(step, 20) for _ in range(3))[1]


def main() -> None:
    out = {"src": dropless.__file__}
    steps = gemm_steps()
    for name in ("bf16", "rowwise_cached", "rowwise"):
        for _ in range(3):
            steps[name]()
        out[f"gemm {name.replace('_', ' ')}"] = (round(host_ms(steps[name]), 3), round(wall_ms(steps[name]), 3))
    del steps
    for recipe, step in layer_steps("qwen3", [None, "rowwise"]).items():
        out[f"layer {recipe or 'bf16'}"] = (round(host_ms(step, n=3), 3), round(wall_ms(step), 3))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
