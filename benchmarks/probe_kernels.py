"""Kernel probe: each tile configuration of a pass timed against dense and torch._grouped_mm in one run.

    python benchmarks/probe_kernels.py [SHAPE/ROUTING,...] [PASS,...]

PASS is fwd_nk (nn.Linear-layout weights), fwd_kn, dgrad, wgrad (into an nn.Linear-layout dw) or
wgrad_acc (added into an fp32 nn.Linear-layout main_grad). QUEUE=n in the environment sets the by-work
wgrad's queue depth (ragged_k_hopper.QUEUE); VARIANTS=a,b,... times only those configs. Group sizes are the benchmark's (dropless.bench.routing).
Every result is checked against torch._grouped_mm first; then dense, torch and every config are timed in
ROUNDS (default 3) interleaved rounds, each keeping its best median, so a slow spell of the machine does
not fall on one config. Prints TFLOP/s per config and writes probe_gluon.json to $OUT (or /tmp).
Used for the kernel notes in benchmarks/NOTES.md; `python -m dropless.bench gemm` is the benchmark.
"""
import json, os, sys
import numpy as np, torch
from triton.testing import do_bench
from dropless.bench.routing import group_sizes
from dropless.kernels.config import GemmConfig as G
from dropless.kernels.tuning import run_ragged_k, run_ragged_m

SHAPES = {
    "mixtral-up": (4, 16384, 4096, 14336), "mixtral-down": (4, 16384, 14336, 4096),
    "dsv3-up": (32, 32768, 7168, 4096), "dsv3-down": (32, 32768, 2048, 7168),
    "qwen3-up": (128, 65536, 2048, 1536), "qwen3-down": (128, 65536, 768, 2048),
    "gptoss-up": (32, 32768, 2880, 5760),
}


M_VARIANTS = {
    "tri_flat4": G(128, 256, 64, num_warps=8, num_stages=4, flatten=True),
    "tri_ws": G(128, 256, 64, num_warps=8, num_stages=3, warp_specialize=True, tma_store=True),
    "gl_s3": G(128, 256, 64, num_warps=8, num_stages=3, gluon=True),
    "gl_s4": G(128, 256, 64, num_warps=8, num_stages=4, gluon=True),
    "gl_s3_g4": G(128, 256, 64, group_m=4, num_warps=8, num_stages=3, gluon=True),
    "gl_s3_g16": G(128, 256, 64, group_m=16, num_warps=8, num_stages=3, gluon=True),
    "gl_k32s6": G(128, 256, 32, num_warps=8, num_stages=6, gluon=True),
}
ACC_VARIANTS = {
    "tri_flat4": G(64, 256, 128, num_warps=8, num_stages=4, flatten=True),
    "tri_s3": G(64, 128, 128, num_warps=8, num_stages=3, flatten=True, programs_per_sm=2),
    "gl_r32s8": G(32, 128, 128, num_warps=8, num_stages=8, gluon=True),
    "gl_r64s4": G(64, 128, 128, num_warps=8, num_stages=4, gluon=True),
    "gl_r32s8_bw": G(32, 128, 128, num_warps=8, num_stages=8, by_work=True, gluon=True),
    "gl_r64s4_bw": G(64, 128, 128, num_warps=8, num_stages=4, by_work=True, gluon=True),
}
K_VARIANTS = {
    "tri_lpt": G(64, 256, 128, num_warps=8, num_stages=3, by_work=True, tma_store=True),
    "gl_s3": G(64, 256, 128, num_warps=8, num_stages=3, gluon=True),
    "gl_r32": G(32, 256, 128, num_warps=8, num_stages=6, gluon=True),
    "gl_s3_bw": G(64, 256, 128, num_warps=8, num_stages=3, by_work=True, gluon=True),
    "gl_r32_bw": G(32, 256, 128, num_warps=8, num_stages=6, by_work=True, gluon=True),
}


ROUNDS = int(os.environ.get("ROUNDS", 3))


def best_of_rounds(fns):
    """TFLOP/s-ready times: each function's best median over ROUNDS rounds that visit them in turn."""
    times = {k: float("inf") for k in fns}
    for _ in range(ROUNDS):
        for k, fn in fns.items():
            times[k] = min(times[k], do_bench(fn, warmup=5, rep=30, return_mode="median"))
    return times


def rel(a, b): return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> None:
    if "QUEUE" in os.environ:
        from dropless.kernels import ragged_k_hopper
        ragged_k_hopper.QUEUE = int(os.environ["QUEUE"])
    which = sys.argv[1].split(",") if len(sys.argv) > 1 and sys.argv[1] else [
        f"{s}/{r}" for s in SHAPES for r in ("balanced", "skewed")]
    passes = sys.argv[2].split(",") if len(sys.argv) > 2 else ["fwd_nk", "fwd_kn", "dgrad", "wgrad"]
    rows = []
    for item in which:
        name, routing = item.split("/")
        E, M, K, N = SHAPES[name]
        sizes = group_sizes(E, M, routing)
        offs = torch.tensor(np.cumsum(sizes), dtype=torch.int32, device="cuda")
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        w_nk = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        flops = 2 * M * K * N
        for p in passes:
            if p.startswith("fwd"):
                w = w_nk.transpose(1, 2) if p == "fwd_nk" else w_nk.transpose(1, 2).contiguous()
                big = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
                dense = lambda: torch.mm(x, big)
                peer = lambda: torch._grouped_mm(x, w, offs=offs)
                out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
                mine = lambda cfg: run_ragged_m(x, w, offs, out, config=cfg)
                variants = M_VARIANTS
            elif p == "dgrad":
                big = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
                dense = lambda: torch.mm(dy, big)
                peer = lambda: torch._grouped_mm(dy, w_nk, offs=offs)
                out = torch.empty(M, K, device="cuda", dtype=torch.bfloat16)
                mine = lambda cfg: run_ragged_m(dy, w_nk, offs, out, config=cfg)
                variants = M_VARIANTS
            elif p == "wgrad_acc":
                xt = x.t().contiguous()
                dense = lambda: torch.mm(xt, dy)
                main_grad = torch.randn(E, N, K, device="cuda", dtype=torch.float32)
                peer_out = main_grad.clone()
                peer = lambda: peer_out.add_(torch._grouped_mm(x.t(), dy, offs=offs).transpose(1, 2))
                out = main_grad.clone().transpose(1, 2)
                ref_val = main_grad.transpose(1, 2) + torch._grouped_mm(x.t(), dy, offs=offs).float()
                mine = lambda cfg: run_ragged_k(x, dy, offs, out, 1, None, config=cfg)
                variants = ACC_VARIANTS
            else:
                xt = x.t().contiguous()
                dense = lambda: torch.mm(xt, dy)
                peer = lambda: torch._grouped_mm(x.t(), dy, offs=offs)
                out = torch.empty(E, N, K, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # nn.Linear layout
                mine = lambda cfg: run_ragged_k(x, dy, offs, out, 0, None, config=cfg)
                variants = K_VARIANTS
            ref = peer() if p != "wgrad_acc" else None
            if "VARIANTS" in os.environ:
                variants = {k: v for k, v in variants.items() if k in os.environ["VARIANTS"].split(",")}
            r = dict(shape=item, p=p)
            fns = {"dense": dense, "torch": peer}
            for vname, cfg in variants.items():
                try:
                    if p == "wgrad_acc":
                        out.copy_(main_grad.transpose(1, 2))
                        mine(cfg)
                        err = rel(out, ref_val)
                    else:
                        out.fill_(float("nan"))
                        mine(cfg)
                        err = rel(out, ref)
                    if err < 2e-2:
                        fns[vname] = lambda cfg=cfg: mine(cfg)
                    else:
                        print("WRONG", item, p, vname, err, flush=True); r[vname] = -1.0
                except Exception as e:  # noqa: BLE001
                    print("ERROR", item, p, vname, repr(e)[:300], flush=True); r[vname] = float("nan")
            r.update({k: flops / t / 1e9 for k, t in best_of_rounds(fns).items()})
            r = {k: r[k] for k in ("shape", "p", "dense", "torch", *variants)}
            rows.append(r)
            print(json.dumps({k: (round(v) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
        del x, dy, w_nk; torch.cuda.empty_cache()

    json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe_gluon.json"), "w"), indent=1)
    print("\nTFLOP/s; best gluon / dense, / torch, / best triton; best by-work gluon (_bw) / best other gluon;"
          " ragged-M 4 stages / 3")
    for r in rows:
        v = [k for k in r if k not in ("shape", "p", "dense", "torch")]
        gl_best = max(r[k] for k in v if k.startswith("gl")); tri = max((r[k] for k in v if k.startswith("tri")), default=float("nan"))
        by_work = [r[k] for k in v if k.startswith("gl") and k.endswith("_bw")]
        static = max(r[k] for k in v if k.startswith("gl") and not k.endswith("_bw"))
        print(f"{r['shape']:22s} {r['p']:6s} dense {r['dense']:4.0f} torch {r['torch']:4.0f} "
              + " ".join(f"{k} {r[k]:4.0f}" for k in v)
              + f" | {gl_best / r['dense']:.2f} {gl_best / r['torch']:.2f} {gl_best / tri:.2f}"
              + (f" | {max(by_work) / static:.2f}" if by_work else "")
              + (f" | s4/s3 {r['gl_s4'] / r['gl_s3']:.2f}" if "gl_s4" in r and "gl_s3" in r else ""))


if __name__ == "__main__":
    main()
