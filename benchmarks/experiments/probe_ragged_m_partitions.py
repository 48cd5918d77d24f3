"""The ragged-M kernel with one compute partition per warpgroup (ragged_m_warpgroup_partitions.py) against
the production Gluon kernel, fwd and dgrad, back to back. usage: probe_ragged_m_partitions.py SHAPE/ROUTING,..."""
import os, sys, statistics, torch
sys.path.insert(0, os.path.dirname(__file__)); sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import ragged_m_warpgroup_partitions as rm_sub
from probe_sustained import back_to_back_ms
from dropless.bench.shapes import select_shapes
from dropless.bench.routing import group_sizes
from dropless.bench.problem import make_problem
from dropless.kernels.config import GemmConfig as G
from dropless.kernels.launch import launch_info
from dropless.kernels.ragged_m_hopper import ragged_m_mm_hopper

VARIANTS = {"s3": G(128, 256, 64, num_warps=8, num_stages=3, gluon=True),
            "s4": G(128, 256, 64, num_warps=8, num_stages=4, gluon=True),
            "sub_s3": dict(stages=3, epi_split=1, lead=0), "sub_s3_L2": dict(stages=3, epi_split=1, lead=2),
            "sub_s4": dict(stages=4, epi_split=2, lead=0), "sub_s4_L2": dict(stages=4, epi_split=2, lead=2),
            "sub_s4_L3": dict(stages=4, epi_split=2, lead=3),
            "k128_s2": G(128, 256, 128, num_warps=8, num_stages=2, gluon=True)}
if os.environ.get("ONLY"):
    VARIANTS = {k: v for k, v in VARIANTS.items() if k in os.environ["ONLY"].split(",")}
ROUNDS = int(os.environ.get("ROUNDS", 2))
SECONDS = float(os.environ.get("SECONDS_EACH", 0.4))
nprog = launch_info(torch.device("cuda"), None).num_programs


def fn_for(name, a, b, off, out):
    v = VARIANTS[name]
    if isinstance(v, G):
        return lambda: ragged_m_mm_hopper(a, b, off, out, v, nprog)
    return lambda: rm_sub.ragged_m_sub(a, b, off, out, num_programs=nprog, **v)


def check_tricky():
    g = torch.Generator(device="cuda").manual_seed(1)
    for sizes, K, N in [([0, 1, 63, 64, 65, 200, 0, 300], 192, 320), ([0, 0, 700, 0], 128, 256),
                        ([5] * 40, 64, 512), ([129, 0, 1, 127, 383], 4096, 328)]:
        M = sum(sizes) + 37
        off = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
        a = torch.randn(M, K, generator=g, device="cuda", dtype=torch.bfloat16)
        for nk in (False, True):
            w = torch.randn(len(sizes), N, K, generator=g, device="cuda", dtype=torch.bfloat16)
            w = w.transpose(1, 2) if nk else w.transpose(1, 2).contiguous()
            ref = torch.zeros(M, N, device="cuda")
            s = 0
            for e, n in enumerate(sizes):
                ref[s:s + n] = a[s:s + n].float() @ w[e].float(); s += n
            for name in VARIANTS:
                out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
                fn_for(name, a, w, off, out)(); torch.cuda.synchronize()
                err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                assert err < 1e-2 and not out.isnan().any(), (sizes, K, N, nk, name, err)
    print("tricky cases: all variants match", flush=True)


check_tricky()
shapes = {s.name: s for s in select_shapes(None, False)}
summary = []
for case in sys.argv[1].split(","):
    name, routing = case.split("/")
    shape = shapes[name]
    p = make_problem(shape, group_sizes(shape.E, shape.M, routing), torch.bfloat16, torch.device("cuda"))
    y = torch.empty(shape.M, shape.N, device="cuda", dtype=torch.bfloat16)
    dx = torch.empty(shape.M, shape.K, device="cuda", dtype=torch.bfloat16)
    wt = p.w.transpose(1, 2)
    fns = {}
    for v in VARIANTS:
        fns[f"fwd {v}"] = fn_for(v, p.x, p.w, p.offsets, y)
        fns[f"dgrad {v}"] = fn_for(v, p.dy, wt, p.offsets, dx)
    fns["fwd torch"] = lambda: torch._grouped_mm(p.x, p.w, offs=p.offsets)
    fns["dgrad torch"] = lambda: torch._grouped_mm(p.dy, wt, offs=p.offsets)
    ry = torch._grouped_mm(p.x, p.w, offs=p.offsets).float(); rdx = torch._grouped_mm(p.dy, wt, offs=p.offsets).float()
    for k, f in fns.items():
        if "torch" in k:
            continue
        out, ref = (y, ry) if k.startswith("fwd") else (dx, rdx)
        out.fill_(float("nan")); f(); torch.cuda.synchronize()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, (case, k, err)
    res = {k: [] for k in fns}
    for r in range(ROUNDS):
        for k in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            res[k].append(back_to_back_ms(fns[k], SECONDS)[0])
    m = {k: statistics.mean(v) for k, v in res.items()}
    for k, v in res.items():
        print(f"{case:28s} {k:16s} {m[k]:.4f} ms ({' '.join(f'{x:.4f}' for x in v)})", flush=True)
    for ps in ("fwd", "dgrad"):
        best = min(m[f"{ps} s3"], m[f"{ps} s4"])
        summary.append(f"{case:28s} {ps:5s} best-prod {best:.4f} torch/prod {m[f'{ps} torch'] / best:.3f} | "
                       + " ".join(f"{v}:{best / m[f'{ps} {v}']:.3f}" for v in VARIANTS if v not in ("s3", "s4")))
    del p, fns, y, dx, ry, rdx; torch.cuda.empty_cache()
print("\n".join(summary))
