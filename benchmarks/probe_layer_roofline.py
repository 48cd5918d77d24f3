"""The MoE layer's fwd+bwd step against its floor, from ceilings measured in the same run (issue 20's layer bars).

    PYTHONPATH=src python benchmarks/probe_layer_roofline.py [--configs mixtral qwen3 dsv2lite] [--json PATH]

Ceilings, measured here: the dense GEMM of the layer's expert FLOPs (``bench moe``'s ``Dense`` step, whose
time is the bar's denominator) and the HBM bandwidth of a 2 GiB copy (bytes read + written over time).

The floor of the layer's step: its expert GEMMs at the dense step's rate (the dense step's time), the
router's GEMMs at the same rate, plus the bytes its other passes must move at the copy's bandwidth, each
tensor read or written once (``floor_bytes``). The ratio the floor allows, dense / floor, is the most any
implementation with these passes unfused can reach; a bar above it needs fusions that remove passes.

Prints, per layer: the measured step and dense step (their ratio is the bar's number), the step's kernel
time by kind from ``torch.profiler`` (expert GEMMs, other GEMMs, the rest), the time the GPU sits idle
between the step's kernels and the largest idle gaps (the kernels on either side), the step replayed
from a CUDA graph (the GPU's time without the host's), the floor's parts and the ratio it allows.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from dropless.bench.moe import Dense, _step
from dropless.bench.moe_layers import LayerConfig, build_dropless, make_weights, select_configs
from dropless.bench.timing import back_to_back_ms

DEV = torch.device("cuda")
EXPERT_GEMMS = ("ragged_m", "ragged_k")
OTHER_GEMMS = ("gemm", "xmma", "cutlass", "nvjet", "sm90_", "matmul")


def floor_bytes(cfg: LayerConfig, element: int = 2) -> dict[str, int]:
    """Bytes each pass outside the expert GEMMs must move at least, forward and backward (16-bit
    activations, fp32 router logits): T tokens of width d, R = T*k routed rows, expert width f, shared
    width s."""
    T, d, f, s, E = cfg.T, cfg.d, cfg.d_ff, cfg.shared_d_ff, cfg.E
    R = T * cfg.k
    tokens, rows = T * d * element, R * d * element
    gate_up, act = R * 2 * f * element, R * f * element
    shared_gate_up, shared_act = T * 2 * s * element, T * s * element
    return {
        "router fwd (x read, logits written)": tokens + T * E * 4,
        "permute fwd (x read, sorted rows written)": tokens + rows,
        "activation fwd (h read, a written)": gate_up + act,
        "combine fwd (expert rows read, y written)": rows + tokens,
        "shared activation fwd": shared_gate_up + shared_act,
        "shared add fwd": 3 * tokens if s else 0,
        "combine bwd (dy read, expert rows read, their gradient written)": tokens + 2 * rows,
        "activation bwd (h and da read, dh written)": 2 * gate_up + act,
        "shared activation bwd": 2 * shared_gate_up + shared_act,
        "permute bwd (sorted rows' gradient read, dx written)": rows + tokens,
        "router bwd (x read, dlogits read)": tokens + T * E * 4,
    }


def events_ms(fn: Callable[[], object], runs: int = 10, warmup: int = 3) -> float:
    """Mean time of ``fn`` over ``runs`` back-to-back calls after ``warmup``, from CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return back_to_back_ms(fn, runs)


def copy_gbps() -> float:
    """HBM bandwidth of a 2 GiB device copy, bytes read + written a second, in GB/s."""
    src = torch.empty(2**30, dtype=torch.int16, device=DEV).random_()
    dst = torch.empty_like(src)
    ms = events_ms(lambda: dst.copy_(src), runs=20)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def kernel_ms(step: Callable[[], object], steps: int = 3) -> tuple[dict[str, float], list[tuple[float, str]]]:
    """GPU kernel time a step by kind (expert GEMMs, other GEMMs, and the rest), and the rest's eight
    largest kernels by name: (ms a step, name)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kinds = {"expert GEMMs": 0.0, "other GEMMs": 0.0, "other kernels": 0.0}
    others: dict[str, float] = {}
    for event in prof.events():
        if event.device_type.name != "CUDA":
            continue
        name = event.name.lower()
        kind = ("expert GEMMs" if any(k in name for k in EXPERT_GEMMS)
                else "other GEMMs" if any(k in name for k in OTHER_GEMMS) else "other kernels")
        kinds[kind] += event.device_time / 1e3 / steps
        if kind == "other kernels":
            short = event.name.replace("void ", "").replace("at::native::", "")
            short = short.replace("(anonymous namespace)::", "")
            others[short[:110]] = others.get(short[:110], 0.0) + event.device_time / 1e3 / steps
    return kinds, sorted(((ms, name) for name, ms in others.items()), reverse=True)[:16]


def idle_gaps(step: Callable[[], object], top: int = 6) -> tuple[float, list[tuple[float, str, str]]]:
    """The GPU's idle time within one step (between its first kernel's start and its last one's end, the
    time no kernel or copy runs) and the ``top`` largest gaps: (us, the work before, the work after)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type.name == "CUDA")
    gaps, reach, before = [], spans[0][1], spans[0][2]
    for start, end, name in spans[1:]:
        if start > reach:
            gaps.append(((start - reach), before[:60], name[:60]))
        if end > reach:
            reach, before = end, name
    gaps.sort(reverse=True)
    return sum(g[0] for g in gaps) / 1e3, gaps[:top]


def clock_during(fn: Callable[[], object], runs: int = 20) -> float:
    """The SM clock in MHz (``nvidia-smi``) read while ``runs`` calls of ``fn`` queued back to back are
    running; NaN if it cannot be read."""
    for _ in range(runs):
        fn()
    try:
        query = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits",
                                "-i", str(torch.cuda.current_device())], capture_output=True, text=True, timeout=10)
        mhz = float(query.stdout.strip())
    except (OSError, ValueError, subprocess.SubprocessError):
        mhz = float("nan")
    torch.cuda.synchronize()
    return mhz


def replayed(step: Callable[[], object], stream: torch.cuda.Stream) -> dict[str, object]:
    """The step captured in a CUDA graph on ``stream`` (where every earlier step ran: autograd keeps the
    stream of a parameter's first gradient accumulation): its replay's ms, the SM clock while replays
    run, the GPU's idle ms within one replay and the replay's kernel time by kind (after a sustained
    warm-up); NaNs if it cannot be captured."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, stream=stream):
            step()
    except Exception as error:  # noqa: BLE001 - a failed capture is reported, the probe goes on
        print(f"  capture failed: {str(error).splitlines()[0]}")
        return {"ms": float("nan"), "clock_mhz": float("nan"), "idle_ms": float("nan"), "kernels_ms": {}}
    ms = events_ms(graph.replay)
    clock = clock_during(graph.replay)
    idle_ms, _ = idle_gaps(graph.replay)
    clock_during(graph.replay)
    kinds, _ = kernel_ms(graph.replay)
    del graph
    return {"ms": ms, "clock_mhz": clock, "idle_ms": idle_ms, "kernels_ms": kinds}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", nargs="+", default=["mixtral", "qwen3", "dsv2lite"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        run(args, stream)


def run(args: argparse.Namespace, stream: torch.cuda.Stream) -> None:
    gbps = copy_gbps()
    print(f"{torch.cuda.get_device_name()}; copy {gbps:.0f} GB/s")
    rows = []
    for cfg in select_configs(args.configs, quick=False):
        w = make_weights(cfg, torch.bfloat16, DEV)
        dense = Dense(cfg, w)
        dense_ms = events_ms(dense.step)
        dense_clock = clock_during(dense.step)
        x = w.x.detach().requires_grad_()
        step = _step(build_dropless(cfg, w), x, w.dy)
        step_ms = events_ms(step)
        step_clock = clock_during(step)
        kinds, others = kernel_ms(step)
        idle_ms, largest = idle_gaps(step)
        replay = replayed(step, stream)
        replay_ms = replay["ms"]
        parts = floor_bytes(cfg)
        memory_ms = sum(parts.values()) / (gbps * 1e9) * 1e3
        router_ms = dense_ms * (3 * 2 * cfg.T * cfg.d * cfg.E) / dense.flops
        floor_ms = dense_ms + router_ms + memory_ms
        row = dict(config=cfg.name, step_ms=step_ms, dense_ms=dense_ms, of_dense=dense_ms / step_ms,
                   dense_tflops=dense.flops / dense_ms / 1e9, copy_gbps=gbps, kernels_ms=kinds, idle_ms=idle_ms,
                   idle_gaps=largest, replay_ms=replay_ms, replay_idle_ms=replay["idle_ms"], other_kernels=others,
                   replay_kernels_ms=replay["kernels_ms"], replay_of_dense=dense_ms / replay_ms,
                   clock_mhz={"dense": dense_clock, "step": step_clock, "replay": replay["clock_mhz"]},
                   floor_bytes=parts, floor_memory_ms=memory_ms, floor_router_ms=router_ms, floor_ms=floor_ms,
                   floor_of_dense=dense_ms / floor_ms)
        rows.append(row)
        print(f"\n{cfg.name}: step {step_ms:.2f} ms, dense {dense_ms:.2f} ms ({row['dense_tflops']:.0f} TFLOP/s): "
              f"{row['of_dense']:.3f} of dense")
        print("  kernels a step: " + ", ".join(f"{k} {v:.2f} ms" for k, v in kinds.items())
              + f" (sum {sum(kinds.values()):.2f})")
        print(f"  GPU idle within a step {idle_ms:.2f} ms; largest gaps: "
              + "; ".join(f"{us:.0f} us {a} -> {b}" for us, a, b in largest[:3]))
        print(f"  replayed from a CUDA graph: {replay_ms:.2f} ms, {row['replay_of_dense']:.3f} of dense; "
              f"GPU idle within a replay {replay['idle_ms']:.2f} ms; kernels a replay (after a sustained warm-up): "
              + ", ".join(f"{k} {v:.2f} ms" for k, v in replay["kernels_ms"].items()))
        print("  SM clock while running (MHz): " + ", ".join(f"{k} {v:.0f}" for k, v in row["clock_mhz"].items()))
        print("  largest other kernels: " + "; ".join(f"{ms:.3f} {name}" for ms, name in others))
        print(f"  floor {floor_ms:.2f} ms = GEMMs at the dense rate {dense_ms:.2f} + router {router_ms:.2f} "
              f"+ {sum(parts.values()) / 1e9:.2f} GB at {gbps:.0f} GB/s {memory_ms:.2f}: "
              f"allows {row['floor_of_dense']:.3f} of dense")
        for name, nbytes in parts.items():
            if nbytes:
                print(f"    {nbytes / 1e6:8.0f} MB  {name}")
        del step, dense, w, x
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)


if __name__ == "__main__":
    main()
