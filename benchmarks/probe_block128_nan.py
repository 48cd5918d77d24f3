"""The block128x128 weight quantizer against the reference, bit for bit, with poisoned outputs: for each
shape, input dtype and layout, the bytes left unwritten and the bytes written wrong, along K and along N
(benchmarks/NOTES.md, v26: from fp32 weights whose sizes are multiples of 16, Triton 3.6's bundled ptxas
12.8 compiled an fp8 transpose into wrong bytes; set ``TRITON_PTXAS_PATH`` to compare another ptxas).

    PYTHONPATH=src python benchmarks/probe_block128_nan.py
"""

import torch
from dropless import reference
from dropless.quantized import RECIPES
import dropless.kernels.quantize as kq

recipe = RECIPES["block128x128"]
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
POISON = 0x7F
total_bad = 0
for (E, K, N) in [(5, 96, 64), (5, 96, 128), (2, 256, 256), (1, 128, 128), (3, 100, 72), (4, 160, 96), (2, 64, 32), (2, 32, 96), (3, 224, 48)]:
    for dtype in (torch.float32, torch.bfloat16):
        for layout in ("kn", "nk"):
            stats = []
            for trial in range(3):
                w = torch.randn(E, K, N, device=dev, dtype=dtype) if layout == "kn" else torch.randn(E, N, K, device=dev, dtype=dtype).transpose(1, 2)
                data_k = torch.full((E, N, K), POISON, dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn).transpose(1, 2)
                data_n = torch.full((E, K, N), POISON, dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn)
                scale = torch.full((E, (K + 127) // 128, (N + 127) // 128), float("nan"), device=dev)
                kq.quantize_weight_3d(w, data_k, data_n, scale, scale, recipe)
                torch.cuda.synchronize() if dev.type == "cuda" else None
                rk, rs = reference.quantize(w.cpu(), recipe, 1)
                rn, _ = reference.quantize(w.cpu(), recipe, 2)
                gk = data_k.cpu().view(torch.uint8); gn = data_n.cpu().view(torch.uint8)
                rk8 = rk.view(torch.uint8); rn8 = rn.view(torch.uint8)
                unk = (gk != rk8) & (gk == POISON); wrk = (gk != rk8) & (gk != POISON)
                unn = (gn != rn8) & (gn == POISON); wrn = (gn != rn8) & (gn != POISON)
                sbad = int((scale.cpu() != rs).sum())
                stats.append((int(unk.sum()), int(wrk.sum()), int(unn.sum()), int(wrn.sum()), sbad))
                if (unk | wrk).any() and trial == 0:
                    idx = (unk | wrk).nonzero()
                    print(f"   K-bad positions e {sorted(set(idx[:,0].tolist()))} k {sorted(set(idx[:,1].tolist()))[:40]} n {sorted(set(idx[:,2].tolist()))[:40]}")
            bad = sum(sum(s) for s in stats)
            total_bad += bad
            print(f"E{E} K{K} N{N} {str(dtype)[6:]} {layout}: (unwritten K, wrong K, unwritten N, wrong N, scales) per trial {stats}" + ("  <-- BAD" if bad else ""))
print("TOTAL BAD", total_bad)
