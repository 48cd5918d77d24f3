"""What splitting an EP rank's tokens into chunks costs the expert work alone, on one GPU.

    PYTHONPATH=src python benchmarks/probe_ep_chunks.py [--ranks 2 4] [--chunks 1 2] [--recipes bf16 rowwise]

An overlap of the expert exchange with the experts' products by token chunks (dispatch chunk i+1 while
chunk i's experts run) calls the experts once per chunk. This times the ``bench ep`` layer's one-GPU
reference (DeepSeek-V3's layer: E/P experts of a rank, 4096 tokens, top-8, one shared expert) fwd+bwd
with its tokens in 1, 2, ... chunks, each chunk a call of the layer, outputs concatenated, one backward
(autograd adds the chunks' expert weight gradients). The difference is what the overlap must hide
before it gains anything.
"""

from __future__ import annotations

import argparse

import torch

from dropless.bench.ep_layer import CONFIGS
from dropless.bench.timing import median_ms
from dropless.nn.moe import MoE


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--recipes", nargs="+", default=["bf16", "rowwise"])
    args = parser.parse_args()
    cfg, device = CONFIGS[0], torch.device("cuda")
    torch.manual_seed(0)
    x = torch.randn(cfg.T, cfg.d, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    print(f"{'P':>2} {'recipe':>8} " + " ".join(f"{f'{n} chunks ms':>14}" for n in args.chunks) + "  ratio to 1 chunk")
    for ranks in args.ranks:
        for recipe in args.recipes:
            layer = MoE(cfg.d, cfg.d_ff, cfg.E // ranks, cfg.k, score_func="sigmoid", routed_scaling=cfg.routed_scaling,
                        aux_loss_coef=0.0, num_shared_experts=1, shared_d_ff=cfg.shared_d_ff,
                        recipe=None if recipe == "bf16" else recipe, device=device, dtype=torch.bfloat16)
            inputs = [x, *layer.parameters()]

            def step(chunks: int) -> tuple:
                y = torch.cat([layer(part) for part in x.chunk(chunks)])
                return torch.autograd.grad(y, inputs, dy)

            times = [median_ms(lambda n=n: step(n), device, warmup=300, rep=400) for n in args.chunks]
            ratios = " ".join(f"{t / times[0]:.3f}" for t in times)
            print(f"{ranks:>2} {recipe:>8} " + " ".join(f"{t:>14.2f}" for t in times) + f"  {ratios}", flush=True)
            del layer, inputs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
