"""Where the decode-size rows of the GEMM benchmark lose to torch._grouped_mm (issue 20's decode bar).

    python benchmarks/probe_decode.py [--configs] [--profile]

For each decode shape with balanced and all-to-one routing: each pass timed as the benchmark times it
(``do_bench``, L2 flushed) and replayed from a CUDA graph (the GPU's time alone), with the tuned config
(``--configs``: and the forward and input gradient with each ragged-M config forced), against
torch._grouped_mm; and the fwd+bwd step three ways: as the benchmark times it, replayed from a CUDA graph,
and the host's time per step (queued behind a long matmul, so no call waits for the GPU). ``--profile``: cProfile of 50 dropless fwd+bwd steps at qwen3's down
projection, all-to-one. Prints a table; ``--json PATH`` writes the rows.
"""
import argparse, cProfile, io, json, pstats, time

import numpy as np
import torch

import dropless
from dropless.bench.routing import group_sizes
from dropless.bench.shapes import DECODE_SHAPES
from dropless.bench.timing import graphed_median_ms, median_ms
from dropless.kernels import tuning
from dropless.kernels.config import GemmConfig

CONFIGS = {
    "128x256/gluon": GemmConfig(128, 256, 64, num_warps=8, num_stages=3, gluon=True),
    "128x256/flat": GemmConfig(128, 256, 64, num_warps=8, num_stages=4, flatten=True),
    "128x128/x2": GemmConfig(128, 128, 64, num_warps=4, num_stages=3, flatten=True, programs_per_sm=2),
    "64x256": GemmConfig(64, 256, 64, num_warps=4, num_stages=4, flatten=True),
    "64x128": GemmConfig(64, 128, 32, num_warps=4, num_stages=3),
    "64x128x64/s4": GemmConfig(64, 128, 64, num_warps=4, num_stages=4, flatten=True),
}
dev = torch.device("cuda")
big = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)


def ms(fn):
    return median_ms(fn, dev, 25, 100)


def host_us(fn, n=40):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    for _ in range(6):
        big @ big  # ~6 ms of queued GPU work
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return host


def step_of(mm, x, w, dy):
    xl, wl = x.detach().requires_grad_(), w.detach().requires_grad_()
    return lambda: torch.autograd.grad(mm(xl, wl), (xl, wl), dy)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--configs", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for shape in DECODE_SHAPES:
        if shape.name.startswith("tiny"):
            continue
        E, M, K, N = shape.E, shape.M, shape.K, shape.N
        for routing in ("balanced", "all-to-one"):
            sizes = group_sizes(E, M, routing)
            offs = torch.tensor(np.cumsum(sizes), dtype=torch.int32, device=dev)
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            w = torch.randn(E, K, N, device=dev, dtype=torch.bfloat16) * K ** -0.5
            dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
            row = {"shape": shape.name, "routing": routing}
            for pass_, a, b in (("fwd", x, w), ("dgrad", dy, w.transpose(1, 2))):
                c = torch.empty(M, b.shape[2], device=dev, dtype=torch.bfloat16)
                row[f"{pass_} torch"] = ms(lambda: torch._grouped_mm(a, b, offs=offs))
                row[f"{pass_} tuned"] = ms(lambda: dropless.grouped_mm(a, b, offs))
                row[f"{pass_} torch graphed"] = graphed_median_ms(lambda: torch._grouped_mm(a, b, offs=offs), dev, 25, 100)
                row[f"{pass_} tuned graphed"] = graphed_median_ms(lambda: dropless.grouped_mm(a, b, offs), dev, 25, 100)
                for name, cfg in CONFIGS.items() if args.configs else ():
                    try:
                        row[f"{pass_} {name}"] = ms(lambda: tuning.run_ragged_m(a, b, offs, c, config=cfg))
                    except Exception as e:  # noqa: BLE001
                        row[f"{pass_} {name}"] = None
                        print(shape.name, pass_, name, type(e).__name__, str(e)[:120])
            row["fwd torch host"] = host_us(lambda: torch._grouped_mm(x, w, offs=offs)) / 1e3
            row["fwd dropless host"] = host_us(lambda: dropless.grouped_mm(x, w, offs)) / 1e3
            row["wgrad torch"] = ms(lambda: torch._grouped_mm(x.t(), dy, offs=offs))
            row["wgrad tuned"] = ms(lambda: dropless.grouped_mm_wgrad(x, dy, offs))
            row["wgrad torch graphed"] = graphed_median_ms(lambda: torch._grouped_mm(x.t(), dy, offs=offs), dev, 25, 100)
            row["wgrad tuned graphed"] = graphed_median_ms(lambda: dropless.grouped_mm_wgrad(x, dy, offs), dev, 25, 100)
            for name, mm in (("dropless", lambda a, b: dropless.grouped_mm(a, b, offs)),
                             ("torch", lambda a, b: torch._grouped_mm(a, b, offs=offs))):
                step = step_of(mm, x, w, dy)
                row[f"step {name} bench"] = ms(step)
                row[f"step {name} graphed"] = graphed_median_ms(step, dev, 25, 100)
                row[f"step {name} host"] = host_us(step) / 1e3
            rows.append(row)
            print(json.dumps({k: (round(v * 1e3, 1) if isinstance(v, float) else v) for k, v in row.items()}),
                  flush=True)
    cols = ["fwd torch", "fwd tuned", "fwd torch graphed", "fwd tuned graphed", "dgrad torch", "dgrad tuned",
            "dgrad torch graphed", "dgrad tuned graphed", "wgrad torch", "wgrad tuned", "wgrad torch graphed",
            "wgrad tuned graphed", "step torch bench", "step dropless bench",
            "step torch graphed", "step dropless graphed", "step torch host", "step dropless host", "fwd torch host", "fwd dropless host"]
    print("microseconds; step host = host time per fwd+bwd step")
    print(f"{'shape':28s} {'routing':10s} " + " ".join(f"{c[:14]:>14s}" for c in cols))
    for r in rows:
        print(f"{r['shape']:28s} {r['routing']:10s} " + " ".join(
            f"{r[c] * 1e3:14.1f}" if r.get(c) is not None else f"{'-':>14s}" for c in cols))
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=1)
    if args.profile:
        shape = next(s for s in DECODE_SHAPES if s.name == "qwen3-30b-a3b-decode-down")
        E, M, K, N = shape.E, shape.M, shape.K, shape.N
        offs = torch.tensor(np.cumsum(group_sizes(E, M, "all-to-one")), dtype=torch.int32, device=dev)
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        w = torch.randn(E, K, N, device=dev, dtype=torch.bfloat16)
        dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
        step = step_of(lambda a, b: dropless.grouped_mm(a, b, offs), x, w, dy)
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(50):
            step()
        prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
        print(s.getvalue()[:9000])
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumtime").print_stats(40)
        print(s.getvalue()[:9000])


if __name__ == "__main__":
    main()
