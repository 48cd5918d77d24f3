"""The problem the host probes (probe_host.py, probe_host_paths.py) time: qwen3-down, balanced routing.

x [M, K] and w [E, K, N] bf16 leaves that need gradients (xd, wd: their detached views), dy [M, N],
int32 device offsets, and an 8192^2 bf16 matrix whose products queue GPU work ahead of the timed calls.
"""
import numpy as np
import torch

from dropless.bench.routing import group_sizes

E, M, K, N = 128, 65536, 768, 2048
offs = torch.tensor(np.cumsum(group_sizes(E, M, "balanced")), dtype=torch.int32, device="cuda")
x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(E, K, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
xd, wd = x.detach(), w.detach()
big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
