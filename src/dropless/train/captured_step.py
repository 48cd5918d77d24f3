"""A training step captured in one CUDA graph and replayed (``dropless train --cuda-graph``).

A small model's step spends part of its time on the host: its Python and several hundred kernel
launches. Nothing in a dropless step waits for the host, so the whole step (forward, backward, gradient
clipping, the optimizer and the expert-bias update) can be captured once and then replayed: each later
step is a copy of the batch into the graph's input buffers, the learning rate written into the
optimizer's device tensors, and one launch.

The first ``WARMUP_STEPS`` steps run eagerly (the kernels' compilation and tuning, the optimizer's state,
the allocator's first sizes), on a side stream, as a capture needs. The step after them is
captured, then replayed; so are all steps after it. Every step, warm-up included, is a real training step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

WARMUP_STEPS = 3

Outputs = tuple[torch.Tensor, ...]


class CapturedStep:
    """``step(inputs, targets) -> tensors`` run eagerly ``WARMUP_STEPS`` times, then from one CUDA graph.

    ``optimizer``'s learning rates become fp32 tensors on ``device`` (written before each step, read by the
    graph) and its groups capturable. The tensors returned are the graph's own outputs: each replay
    writes over them, so read them (or queue work on them) before the next step.
    """

    def __init__(self, step: Callable[[torch.Tensor, torch.Tensor], Outputs], optimizer: torch.optim.Optimizer,
                 device: torch.device) -> None:
        self._step = step
        self._optimizer = optimizer
        self._device = device
        self._calls = 0
        self._graph: torch.cuda.CUDAGraph | None = None
        self._inputs: torch.Tensor | None = None
        self._targets: torch.Tensor | None = None
        self._outputs: Outputs = ()
        self._side = torch.cuda.Stream(device)
        for group in optimizer.param_groups:
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)
            group["capturable"] = True

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor, lr: float) -> Outputs:
        for group in self._optimizer.param_groups:
            group["lr"].fill_(lr)
        if self._inputs is None:
            # The graph's input buffers, which the warm-up steps use too: a compiled model guards on its
            # inputs' strides (the batch's are a slice's), and one that saw other strides while warming
            # up would compile again inside the capture.
            self._inputs, self._targets = inputs.clone(), targets.clone()
        else:
            self._inputs.copy_(inputs)
            self._targets.copy_(targets)
        if self._graph is not None:
            self._graph.replay()
            return self._outputs
        self._calls += 1
        if self._calls <= WARMUP_STEPS:
            # On a stream of their own, as a capture needs: a parameter's gradient accumulation that first
            # ran on the legacy default stream ran there again during the capture, which cannot join it.
            main = torch.cuda.current_stream(self._device)
            self._side.wait_stream(main)
            with torch.cuda.stream(self._side):
                outputs = self._step(self._inputs, self._targets)
            main.wait_stream(self._side)
            for t in outputs:
                t.record_stream(main)
            return outputs
        graph = torch.cuda.CUDAGraph()
        # Captured on the warm-up's stream, so that each gradient accumulation runs on the stream that
        # first ran it (autograd warns where the two differ).
        with torch.cuda.graph(graph, stream=self._side):
            self._outputs = self._step(self._inputs, self._targets)
        self._graph = graph
        graph.replay()
        return self._outputs
