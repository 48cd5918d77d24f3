"""The wgrad with one compute partition per warpgroup (ragged_k_warpgroup_partitions.py) against the
production Gluon wgrad, back to back. usage: probe_ragged_k_partitions.py SHAPE/ROUTING,..."""
import os, sys, statistics, torch
sys.path.insert(0, os.path.dirname(__file__)); sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import ragged_k_warpgroup_partitions as rk_sub
from probe_sustained import back_to_back_ms
from dropless.bench.shapes import select_shapes
from dropless.bench.routing import group_sizes
from dropless.bench.problem import make_problem
from dropless.kernels.config import GemmConfig as G
from dropless.kernels.launch import launch_info
from dropless.kernels.ragged_k_hopper import ragged_k_mm_hopper

VARIANTS = {"p32": G(32, 256, 128, num_warps=8, num_stages=6, by_work=True, gluon=True),
            "p64": G(64, 256, 128, num_warps=8, num_stages=3, by_work=True, gluon=True),
            "s32": dict(block_m=32, stages=6), "s32_L2": dict(block_m=32, stages=6, lead=2),
            "s32_L4": dict(block_m=32, stages=6, lead=4), "s64": dict(block_m=64, stages=3),
            "s64_L2": dict(block_m=64, stages=3, lead=2)}
ROUNDS = int(os.environ.get("ROUNDS", 2))
SECONDS = float(os.environ.get("SECONDS_EACH", 0.4))
nprog = launch_info(torch.device("cuda"), None).num_programs


def fn_for(name, a, b, off, out):
    v = VARIANTS[name]
    if isinstance(v, G):
        return lambda: ragged_k_mm_hopper(a, b, off, out, 0, None, v, nprog)
    return lambda: rk_sub.rk_sub(a, b, off, out, num_programs=nprog, **v)


def check_tricky():
    g = torch.Generator(device="cuda").manual_seed(1)
    for sizes, K, N in [([0, 1, 63, 64, 65, 200, 0, 300], 192, 320), ([0, 0, 700, 0], 128, 256),
                        ([5] * 40, 64, 512), ([129, 0, 1, 127, 383], 1024, 328)]:
        M = sum(sizes) + 37
        off = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
        a = torch.randn(M, K, generator=g, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(M, N, generator=g, device="cuda", dtype=torch.bfloat16)
        a[sum(sizes):] = float("nan"); b[sum(sizes):] = float("inf")
        ref = torch.zeros(len(sizes), K, N, device="cuda")
        s = 0
        for e, n in enumerate(sizes):
            ref[e] = a[s:s + n].float().t() @ b[s:s + n].float(); s += n
        for name in VARIANTS:
            out = torch.full((len(sizes), K, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            fn_for(name, a, b, off, out)(); torch.cuda.synchronize()
            err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            assert err < 1e-2 and not out.isnan().any(), (sizes, K, N, name, err)
    print("tricky cases: all variants match", flush=True)


check_tricky()
shapes = {s.name: s for s in select_shapes(None, False)}
summary = []
for case in sys.argv[1].split(","):
    name, routing = case.split("/")
    shape = shapes[name]
    p = make_problem(shape, group_sizes(shape.E, shape.M, routing), torch.bfloat16, torch.device("cuda"))
    dw = torch.empty(shape.E, shape.K, shape.N, device="cuda", dtype=torch.bfloat16)
    fns = {v: fn_for(v, p.x, p.dy, p.offsets, dw) for v in VARIANTS}
    fns["torch"] = lambda: torch._grouped_mm(p.x.t(), p.dy, offs=p.offsets)
    ref = fns["torch"]().float()
    for k, f in fns.items():
        if k == "torch":
            continue
        dw.fill_(float("nan")); f(); torch.cuda.synchronize()
        err = ((dw.float() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, (case, k, err)
    res = {k: [] for k in fns}
    for r in range(ROUNDS):
        for k in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            res[k].append(back_to_back_ms(fns[k], SECONDS)[0])
    m = {k: statistics.mean(v) for k, v in res.items()}
    for k, v in res.items():
        print(f"{case:28s} wgrad {k:8s} {m[k]:.4f} ms ({' '.join(f'{x:.4f}' for x in v)})", flush=True)
    best = min(m["p32"], m["p64"])
    summary.append(f"{case:30s} best-prod {best:.4f} torch/prod {m['torch'] / best:.3f} | "
                   + " ".join(f"{v}:{best / m[v]:.3f}" for v in VARIANTS if v.startswith("s")))
    del p, fns, dw, ref; torch.cuda.empty_cache()
print("\n".join(summary))
