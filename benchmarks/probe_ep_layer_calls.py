"""Per-launch times of the quantization kernels and the FP8 ragged-M GEMM in one step of the ``bench ep``
layer (DeepSeek-V3-like, rowwise FP8, fwd+bwd), for each method, with each launch's grid, flags, bound
and operand shapes: where the symmetric-memory layer's worst-case-sized buffer costs time (v26).

    PYTHONPATH=src torchrun --nproc-per-node 2 benchmarks/probe_ep_layer_calls.py [METHOD ...]
"""
import sys, torch
import torch.distributed as dist
from dropless.bench import ep_layer
from dropless.bench.ep import _layer_step, process_group
import dropless.kernels.quantize as qk
import dropless.kernels.ragged_m_hopper as rmh

CALLS = []
RECORD = [False]


def _info(args):
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(f"{tuple(a.shape)}{'' if a.is_contiguous() else 's' + str(a.stride())}")
        elif isinstance(a, (int, bool)):
            out.append(str(a))
    return " ".join(out[:12])


class Wrapped:
    def __init__(self, name, kernel):
        self.name, self.kernel = name, kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kw):
            if not RECORD[0]:
                return launch(*args, **kw)
            b, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            b.record(); launch(*args, **kw); e.record()
            CALLS.append((self.name, grid, _info(args), b, e, args, kw))
        return run


class WrappedDirect:
    def __init__(self, name, inner):
        self.name, self.inner = name, inner

    def __call__(self, grid, **args):
        if not RECORD[0]:
            return self.inner(grid, **args)
        b, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        b.record(); self.inner(grid, **args); e.record()
        CALLS.append((self.name, grid, _info(list(args.values())), b, e, (), {}))


qk._ROWWISE = WrappedDirect("rowwise", qk._ROWWISE)
qk._tile_kernel = Wrapped("tile", qk._tile_kernel)
qk._slot_table_kernel = Wrapped("slot_table", qk._slot_table_kernel)
rmh._LAUNCH = WrappedDirect("ragged_m_hopper", rmh._LAUNCH)

with process_group() as ranks:
    cfg = ep_layer.CONFIGS[0]
    weights = ep_layer.make_weights(cfg, ranks.group, ranks.device, torch.bfloat16, 0)
    drawn = ep_layer.draw_routing(cfg, "balanced", ranks.group, ranks.device, 0)
    for method in sys.argv[1:] or ["dropless_ep_symmetric_memory", "dropless_ep"]:
        layer = ep_layer.build_layer(cfg, method, "rowwise", weights, drawn, ranks.group)
        step = _layer_step(layer, weights.x, weights.dy)
        for _ in range(3):
            step()
        torch.cuda.synchronize(); dist.barrier()
        CALLS.clear(); RECORD[0] = True
        step()
        RECORD[0] = False
        torch.cuda.synchronize()
        if ranks.rank == 0:
            total = 0.0
            print(f"== {method}")
            for name, grid, info, b, e, args, kw in CALLS:
                ms = b.elapsed_time(e); total += ms
                bound = ""
                if kw.get("BOUNDED"):
                    bt = [a for a in args if isinstance(a, torch.Tensor) and a.numel() == 1 and a.dtype in (torch.int32, torch.int64)]
                    bound = f" bound={bt[-1].item() if bt else '?'}"
                flags = " ".join(k for k in ("ALONG_R", "ALONG_C", "GROUPED", "BOUNDED", "AMAX_PASS", "GATHER") if kw.get(k))
                print(f"  {ms:7.3f} ms {name:16s} grid {grid} {flags}{bound} | {info[:150]}")
            print(f"  total {total:.3f} ms")
        del layer, step
        dist.barrier()
