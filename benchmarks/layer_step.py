"""The layer step the layer probes time: ``bench moe``'s forward+backward of one config, one step per recipe on
shared weights and tokens, each warmed up on a side stream (so that a CUDA graph may capture it after).
"""
from collections.abc import Callable, Sequence

import torch

from dropless.bench.moe import _step
from dropless.bench.moe_layers import build_dropless, make_weights, select_configs


def layer_steps(config: str, recipes: Sequence[str | None], warmup: int = 5) -> dict[str | None, Callable[[], tuple]]:
    """``{recipe: step}`` for ``bench moe``'s layer at ``config`` (recipe None: BF16)."""
    cfg = select_configs([config], quick=False)[0]
    w = make_weights(cfg, torch.bfloat16, torch.device("cuda"))
    x = w.x.detach().requires_grad_()
    side = torch.cuda.Stream()
    steps = {}
    for recipe in recipes:
        step = _step(build_dropless(cfg, w, recipe), x, w.dy)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                step()
        torch.cuda.current_stream().wait_stream(side)
        steps[recipe] = step
    torch.cuda.synchronize()
    return steps
