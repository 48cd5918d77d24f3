"""A fwd+bwd step against the sum of its passes, run back to back: dropless and torch._grouped_mm.

    python benchmarks/probe_step.py [SHAPE/ROUTING,...]

For each benchmark row (default: all fourteen), every pass (fwd, dgrad, wgrad) and the autograd step
``y = f(x, w); autograd.grad(y, (x, w), dy)`` of both methods, and a dense fwd, run back to back for
SECONDS_EACH seconds (default 0.5; no L2 flush, as a training step runs its kernels), in ROUNDS
(default 2) interleaved rounds at the H100's sustained clock. Prints each row's times, step over the
sum of the passes, and torch._grouped_mm's time over dropless's; then the geometric means of that
ratio for the fwd and the step. Used for benchmarks/NOTES.md (v8).
"""
import math, os, statistics, sys
import torch
import dropless
from dropless.bench.problem import make_problem
from dropless.bench.routing import group_sizes
from dropless.bench.shapes import select_shapes
from probe_sustained import back_to_back_ms

SECONDS = float(os.environ.get("SECONDS_EACH", 0.5))
ROUNDS = int(os.environ.get("ROUNDS", 2))


def passes(mm, wgrad, x, w, dy):
    """fwd, dgrad, wgrad and the autograd step of ``y = mm(x, w)``."""
    x_leaf, w_leaf, wt = x.detach().requires_grad_(), w.detach().requires_grad_(), w.transpose(1, 2)

    def step():
        y = mm(x_leaf, w_leaf)
        return (y, *torch.autograd.grad(y, (x_leaf, w_leaf), dy))

    return {"fwd": lambda: mm(x, w), "dgrad": lambda: mm(dy, wt), "wgrad": lambda: wgrad(x, dy), "step": step}


def main() -> None:
    shapes = {s.name: s for s in select_shapes(None, False)}
    cases = sys.argv[1].split(",") if len(sys.argv) > 1 else [f"{s}/{r}" for s in shapes for r in ("balanced", "skewed")]
    ratios = {"fwd": [], "step": []}
    print("row: ms of dropless (dl) and torch._grouped_mm (t) per pass | step / sum of passes | t / dl")
    for case in cases:
        name, routing = case.split("/")
        shape = shapes[name]
        p = make_problem(shape, group_sizes(shape.E, shape.M, routing), torch.bfloat16, torch.device("cuda"))
        fns = {}
        for tag, mm, wgrad in (("dl", lambda a, b: dropless.grouped_mm(a, b, p.offsets),
                                lambda a, b: dropless.grouped_mm_wgrad(a, b, p.offsets)),
                               ("t", lambda a, b: torch._grouped_mm(a, b, offs=p.offsets),
                                lambda a, b: torch._grouped_mm(a.t(), b, offs=p.offsets))):
            fns.update({f"{tag} {k}": f for k, f in passes(mm, wgrad, p.x, p.w, p.dy).items()})
        dense_w = p.w[0].clone()
        fns["dense fwd"] = lambda: torch.mm(p.x, dense_w)
        for fn in fns.values():
            fn()
        times = {k: [] for k in fns}
        for r in range(ROUNDS):
            for k in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                times[k].append(back_to_back_ms(fns[k], SECONDS)[0])
        ms = {k: statistics.mean(v) for k, v in times.items()}
        total = {tag: sum(ms[f"{tag} {k}"] for k in ("fwd", "dgrad", "wgrad")) for tag in ("dl", "t")}
        for k in ratios:
            ratios[k].append(ms[f"t {k}"] / ms[f"dl {k}"])
        print(f"{case:30s} " + " ".join(f"{k} {v:.3f}" for k, v in ms.items())
              + f" | step/sum dl {ms['dl step'] / total['dl']:.3f} t {ms['t step'] / total['t']:.3f}"
              + f" | t/dl fwd {ratios['fwd'][-1]:.3f} step {ratios['step'][-1]:.3f}"
              + f" | dl fwd/dense {ms['dense fwd'] / ms['dl fwd']:.3f}", flush=True)
        del p, fns, dense_w
        torch.cuda.empty_cache()
    for k, values in ratios.items():
        print(f"geomean t/dl {k}: {math.exp(sum(map(math.log, values)) / len(values)):.4f} over {len(values)} rows")


if __name__ == "__main__":
    main()
