"""Host time per call of each layer of the grouped_mm path, qwen3-down shape (balanced), on a GPU kept busy.

    DROPLESS_AUTOTUNE=0 python benchmarks/probe_host.py

Each line: microseconds of host time per call, averaged over 40 calls enqueued behind ~15 ms of GPU
work (so no launch waits for the GPU). The fwd+bwd steps run once through the eager path
(``dropless.grouped_mm``: the implementations without the dispatcher, ``ops.direct``) and once
through the ``torch.library`` custom op; then a cProfile of the raw Gluon launch. Used for
benchmarks/NOTES.md (v5, v6).
"""
import cProfile, io, pstats, sys, time
import torch
import dropless
from host_problem import E, K, M, N, big, dy, offs, w, wd, x, xd
from dropless.kernels import ragged_m_hopper as rmh
from dropless.kernels.tuning import run_ragged_m, run_ragged_k
from dropless.kernels.hopper import descriptor
from dropless.kernels.config import GemmConfig as G
ops = sys.modules["dropless.ops.grouped_mm"]
y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
cfg = G(128, 256, 64, num_warps=8, num_stages=3, gluon=True)
nsm = torch.cuda.get_device_properties(0).multi_processor_count


def host_us(f, n=40):
    f(); torch.cuda.synchronize()
    for _ in range(12): big @ big   # ~15 ms of GPU work queued ahead
    t = time.perf_counter()
    for _ in range(n): f()
    dt = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize(); return dt


a_desc = descriptor(xd, [128, 64]); b_desc = descriptor(wd, [1, 64, 256]); c_desc = descriptor(y, [128, 256])


def raw():
    rmh._ragged_m_hopper_kernel[(nsm,)](a_desc, b_desc, c_desc, y, y.stride(0), offs, M, N, K, E, BLOCK_M=128, BLOCK_N=256,
        BLOCK_K=64, GROUP_M=8, STAGES=3, E_POW2=256, B_NK=False, EPI_HALVES=False, num_warps=8)


def step(mm):
    out = mm(x, w, offs)
    return torch.autograd.grad(out, (x, w), dy)


def torch_mm(a, b, offsets):
    return torch._grouped_mm(a, b, offs=offsets)


parts = {
    "torch.empty": lambda: torch.empty(M, N, device="cuda", dtype=torch.bfloat16),
    "3 descriptors": lambda: (descriptor(xd, [128, 64]), descriptor(wd, [1, 64, 256]), descriptor(y, [128, 256])),
    "raw gluon launch": raw,
    "ragged_m_mm_hopper": lambda: rmh.ragged_m_mm_hopper(xd, wd, offs, y, cfg, nsm),
    "run_ragged_m": lambda: run_ragged_m(xd, wd, offs, y),
    "implementation ops._forward": lambda: ops._forward(xd, wd, offs),
    "custom op (no grad)": lambda: torch.ops.dropless.grouped_mm(xd, wd, offs),
    "dropless.grouped_mm (no grad)": lambda: dropless.grouped_mm(xd, wd, offs),
    "dropless.grouped_mm (grad)": lambda: dropless.grouped_mm(x, w, offs),
    "grouped_mm_wgrad": lambda: dropless.grouped_mm_wgrad(xd, dy, offs),
    "run_ragged_k": lambda: run_ragged_k(xd, dy, offs, torch.empty(E, K, N, device="cuda", dtype=torch.bfloat16), 0, None),
    "fwd+bwd step, eager path": lambda: step(dropless.grouped_mm),
    "fwd+bwd step, custom op": lambda: step(torch.ops.dropless.grouped_mm),
    "torch._grouped_mm": lambda: torch._grouped_mm(xd, wd, offs=offs),
    "torch._grouped_mm fwd+bwd step": lambda: step(torch_mm),
}
for k, f in parts.items():
    print(f"{k:32s} {host_us(f):8.1f} us", flush=True)
pr = cProfile.Profile(); pr.enable()
for _ in range(50): raw()
pr.disable(); torch.cuda.synchronize()
st = io.StringIO(); pstats.Stats(pr, stream=st).sort_stats("tottime").print_stats(14); print(st.getvalue()[:3500])
