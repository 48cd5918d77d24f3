"""Sustained throughput, power and clock of the ragged-M forward: each variant runs back to back for
SECONDS_EACH seconds (default 1.5, no L2 flush, as a training step runs its kernels), in ROUNDS (default
2) interleaved rounds, while nvidia-smi samples the SM clock and the board power every 50 ms.

    python benchmarks/probe_sustained.py [SHAPE/ROUTING,...]

At the benchmark's shapes an H100 runs at its power limit once a load lasts ~300 ms, so a kernel's
sustained speed is its work per clock times the clock its power draw allows; the table gives both,
and the energy per PFLOP. Used for benchmarks/NOTES.md (v7).
"""
import csv, datetime, os, statistics, subprocess, sys, tempfile
import numpy as np, torch
from dropless.bench.routing import group_sizes
from dropless.kernels.config import GemmConfig as G
from dropless.kernels.tuning import run_ragged_m
from probe_kernels import SHAPES

CONFIGS = {"gl_s3": G(128, 256, 64, num_warps=8, num_stages=3, gluon=True),
           "gl_s4": G(128, 256, 64, num_warps=8, num_stages=4, gluon=True),
           "gl_s4_g16": G(128, 256, 64, group_m=16, num_warps=8, num_stages=4, gluon=True),
           "gl_s4_g4": G(128, 256, 64, group_m=4, num_warps=8, num_stages=4, gluon=True)}
SECONDS = float(os.environ.get("SECONDS_EACH", 1.5))
ROUNDS = int(os.environ.get("ROUNDS", 2))


def now() -> str:
    return datetime.datetime.now().strftime("%H:%M:%S.%f")[:-3]


def back_to_back_ms(fn, seconds: float) -> tuple[float, str, str]:
    """Mean milliseconds of ``fn`` over ``seconds`` of back-to-back calls, and the window's wall-clock
    start and end."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(); fn(); end.record(); torch.cuda.synchronize()
    n = max(5, int(seconds * 1e3 / start.elapsed_time(end)))
    t0 = now()
    start.record()
    for _ in range(n):
        fn()
    end.record(); torch.cuda.synchronize()
    return start.elapsed_time(end) / n, t0, now()


def main() -> None:
    cases = sys.argv[1].split(",") if len(sys.argv) > 1 else ["mixtral-down/balanced"]
    log = tempfile.NamedTemporaryFile("w+", suffix=".csv")
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader",
                            "-lms", "50"], stdout=log)
    windows = []
    try:
        for case in cases:
            name, routing = case.split("/")
            E, M, K, N = SHAPES[name]
            g = torch.Generator(device="cuda").manual_seed(0)
            offsets = torch.tensor(np.cumsum(group_sizes(E, M, routing)), dtype=torch.int32, device="cuda")
            a = torch.randn(M, K, generator=g, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(E, K, N, generator=g, device="cuda", dtype=torch.bfloat16).mul_(K ** -0.5)
            dense_w = w[0].clone()
            out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            ref = torch._grouped_mm(a, w, offs=offsets)
            fns = {"torch": lambda: torch._grouped_mm(a, w, offs=offsets), "dense": lambda: torch.mm(a, dense_w)}
            for key, config in CONFIGS.items():
                out.fill_(float("nan"))
                run_ragged_m(a, w, offsets, out, config=config)
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                assert err < 1e-2, (case, key, err)
                fns[key] = lambda config=config: run_ragged_m(a, w, offsets, out, config=config)
            for _ in range(ROUNDS):
                for key, fn in fns.items():
                    ms, t0, t1 = back_to_back_ms(fn, SECONDS)
                    tflops = 2 * M * K * N / ms / 1e9
                    windows.append((case, key, tflops, t0, t1))
            del a, w, dense_w, out, ref
            torch.cuda.empty_cache()
    finally:
        smi.terminate()
        smi.wait()
    log.seek(0)
    samples = [(r[0].split()[-1][:12], float(r[1].split()[0]), float(r[2].split()[0]))
               for r in csv.reader(log) if len(r) >= 3]
    table: dict[tuple[str, str], dict[str, list[float]]] = {}
    for case, key, tflops, t0, t1 in windows:
        inside = [(mhz, watt) for t, mhz, watt in samples if t0 < t < t1]
        inside = inside[len(inside) // 4:]  # the clock settles at the start of a window
        row = table.setdefault((case, key), {"tflops": [], "mhz": [], "watt": []})
        row["tflops"].append(tflops)
        row["mhz"] += [m for m, _ in inside]
        row["watt"] += [p for _, p in inside]
    print("case variant: TFLOP/s (per round) | mean SM MHz | mean W | J per PFLOP")
    for (case, key), row in table.items():
        tflops, watt = statistics.mean(row["tflops"]), statistics.mean(row["watt"] or [float("nan")])
        print(f"{case:22s} {key:10s} {tflops:5.0f} ({' '.join(f'{x:.0f}' for x in row['tflops'])}) | "
              f"{statistics.mean(row['mhz'] or [0]):5.0f} | {watt:4.0f} | {watt / tflops * 1e3:5.0f}")


if __name__ == "__main__":
    main()
