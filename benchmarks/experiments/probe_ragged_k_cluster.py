"""The wgrad on 2-CTA clusters with multicast dy blocks (ragged_k_cluster_multicast.py) against the production
Gluon wgrad, back to back. usage: probe_ragged_k_cluster.py SHAPE/ROUTING,..."""
import os, sys, statistics, torch, triton
sys.path.insert(0, os.path.dirname(__file__)); sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import ragged_k_cluster_multicast as host
from probe_sustained import back_to_back_ms
from dropless.bench.shapes import select_shapes
from dropless.bench.routing import group_sizes
from dropless.bench.problem import make_problem
from dropless.kernels.config import GemmConfig as G
from dropless.kernels.launch import launch_info
from dropless.kernels.ragged_k_hopper import ragged_k_mm_hopper

VARIANTS = {"lpt": G(32, 256, 128, num_warps=8, num_stages=6, by_work=True, gluon=True),
            "static": G(32, 256, 128, num_warps=8, num_stages=6, gluon=True),
            "mc": dict(), "coupled": dict(mcast=0), "mc_g4": dict(group_m=4), "mc_m64": dict(bm=64, stages=3)}
ROUNDS = int(os.environ.get("ROUNDS", 2))
SECONDS = float(os.environ.get("SECONDS_EACH", 0.4))
nprog = launch_info(torch.device("cuda"), None).num_programs
CLUSTERS = {}


def fn_for(name, a, b, off, out):
    v = VARIANTS[name]
    if isinstance(v, G):
        return lambda: ragged_k_mm_hopper(a, b, off, out, 0, None, v, nprog)
    return lambda: host.run(a, b, off, out, clusters=CLUSTERS.get(name, nprog // 2), **v)


def max_clusters():
    a = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(512, 512, device="cuda", dtype=torch.bfloat16)
    off = torch.tensor([256, 512], device="cuda", dtype=torch.int32)
    out = torch.empty(2, 256, 512, device="cuda", dtype=torch.bfloat16)
    for name, v in VARIANTS.items():
        if isinstance(v, dict):
            k, ready, empty = host.compile_for(host.args_for(a, b, off, out, **v))
            k._init_handles()
            n = triton.runtime.driver.active.utils.cuOccupancyMaxActiveClusters(k.function, k.metadata.shared, 2)
            CLUSTERS[name] = min(n, nprog // 2)
            print(name, "max active clusters", n, "shared", k.metadata.shared, "barriers at", ready, empty, flush=True)


def check_tricky():
    g = torch.Generator(device="cuda").manual_seed(1)
    for sizes, K, N in [([0, 1, 31, 32, 33, 200, 0, 300], 384, 320), ([0, 0, 700, 0], 256, 256),
                        ([5] * 40, 128, 512), ([129, 0, 1, 127, 383], 2048, 328), ([3000, 5, 129, 4000], 768, 1024)]:
        M = sum(sizes) + 37
        off = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
        a = torch.randn(M, K, generator=g, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(M, N, generator=g, device="cuda", dtype=torch.bfloat16)
        ref = torch.zeros(len(sizes), K, N, device="cuda")
        s = 0
        for e, n in enumerate(sizes):
            ref[e] = a[s:s + n].float().t() @ b[s:s + n].float(); s += n
        for name in VARIANTS:
            for clusters in ([3, CLUSTERS.get(name, 66)] if isinstance(VARIANTS[name], dict) else [None]):
                out = torch.full((len(sizes), K, N), float("nan"), device="cuda", dtype=torch.bfloat16)
                if clusters is None:
                    fn_for(name, a, b, off, out)()
                else:
                    host.run(a, b, off, out, clusters=clusters, **VARIANTS[name])
                torch.cuda.synchronize()
                err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                assert err < 1e-2 and not out.isnan().any(), (sizes, K, N, name, clusters, err, out.isnan().sum().item())
    print("tricky cases: all variants match", flush=True)


max_clusters()
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
    ref = torch._grouped_mm(p.x.t(), p.dy, offs=p.offsets).float()
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
        print(f"{case:28s} {k:8s} {m[k]:.4f} ms ({' '.join(f'{x:.4f}' for x in v)})", flush=True)
    summary.append(f"{case:28s} lpt {m['lpt']:.4f} ms torch/lpt {m['torch'] / m['lpt']:.3f} | "
                   + " ".join(f"{v}:{m['lpt'] / m[v]:.3f}" for v in VARIANTS if v != "lpt"))
    del p, fns, dw, ref; torch.cuda.empty_cache()
print("\n".join(summary))
