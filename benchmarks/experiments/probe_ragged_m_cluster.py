"""The ragged-M kernel on 2-CTA clusters with multicast weight tiles (ragged_m_cluster_multicast.py) against
the production Gluon kernel, fwd and dgrad, back to back. usage: probe_ragged_m_cluster.py SHAPE/ROUTING,..."""
import os, sys, statistics, torch, triton
sys.path.insert(0, os.path.dirname(__file__)); sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import ragged_m_cluster_multicast as host
from probe_sustained import back_to_back_ms
from dropless.bench.shapes import select_shapes
from dropless.bench.routing import group_sizes
from dropless.bench.problem import make_problem
from dropless.kernels.config import GemmConfig as G
from dropless.kernels.launch import launch_info
from dropless.kernels.ragged_m_hopper import ragged_m_mm_hopper

VARIANTS = {"s3": G(128, 256, 64, num_warps=8, num_stages=3, gluon=True),
            "s4": G(128, 256, 64, num_warps=8, num_stages=4, gluon=True),
            "mc_s3_g8": dict(stages=3, group_m=8, remote=2), "mc_s4_g4": dict(stages=4, group_m=4, remote=2),
            "mc_s4_g8": dict(stages=4, group_m=8, remote=2),
            "local_remote_s4_g8": dict(stages=4, group_m=8, mcast=0, remote=2)}
if os.environ.get("ONLY"):
    VARIANTS = {k: v for k, v in VARIANTS.items() if k in os.environ["ONLY"].split(",")}
ROUNDS = int(os.environ.get("ROUNDS", 2))
SECONDS = float(os.environ.get("SECONDS_EACH", 0.4))
nprog = launch_info(torch.device("cuda"), None).num_programs
CLUSTERS = {}


def fn_for(name, a, b, off, out):
    v = VARIANTS[name]
    if isinstance(v, G):
        return lambda: ragged_m_mm_hopper(a, b, off, out, v, nprog)
    return lambda: host.run(a, b, off, out, clusters=CLUSTERS.get(name, nprog // 2), **v)


def max_clusters():
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2, 256, 512, device="cuda", dtype=torch.bfloat16)
    off = torch.tensor([256, 512], device="cuda", dtype=torch.int32)
    out = torch.empty(512, 512, device="cuda", dtype=torch.bfloat16)
    for name, v in VARIANTS.items():
        if isinstance(v, dict):
            args = host.args_for(a, w, off, out, **v)
            k, _, _ = host.compile_for(args)
            k._init_handles()
            n = triton.runtime.driver.active.utils.cuOccupancyMaxActiveClusters(k.function, k.metadata.shared, 2)
            CLUSTERS[name] = n
            print(name, "max active clusters", n, "shared", k.metadata.shared, "offsets", host.compile_for(args)[1:],
                  flush=True)


def check_tricky():
    g = torch.Generator(device="cuda").manual_seed(1)
    for sizes, K, N in [([0, 1, 63, 64, 65, 200, 0, 300], 192, 320), ([0, 0, 700, 0], 128, 256),
                        ([5] * 40, 64, 512), ([129, 0, 1, 127, 383], 4096, 328), ([256, 512, 0, 1024], 512, 768),
                        ([3000, 5, 129, 4000], 1024, 1024)]:
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
                for clusters in ([3, CLUSTERS.get(name, 66)] if name.startswith("mc") else [None]):
                    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
                    if clusters is None:
                        fn_for(name, a, w, off, out)()
                    else:
                        host.run(a, w, off, out, clusters=clusters, **VARIANTS[name])
                    torch.cuda.synchronize()
                    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                    assert err < 1e-2 and not out.isnan().any(), (sizes, K, N, nk, name, clusters, err,
                                                                  out.isnan().sum().item())
    print("tricky cases: all variants match", flush=True)


max_clusters()
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
