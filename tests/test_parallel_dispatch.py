"""dropless.parallel.dispatch / combine on 2 and 4 CPU processes over gloo (and on 2 and 4 GPUs over
NCCL), against the same MoE step computed in one process from every rank's inputs (each rank draws all
ranks' inputs from one seed).

Cases: random routing, a rank with no tokens, every token to one expert (ranks that receive nothing),
top-k copies that land on the same rank, and bad input raised on every rank together. Each run is
bounded in time, so a hang fails the test."""

from __future__ import annotations

import pytest
import torch
from multiprocess import rank_device, run_ranks

import dropless
from dropless.parallel import combine, dispatch


def _inputs(world: int, tokens: list[int], E: int, k: int, d: int, routing: str, seed: int):
    """Every rank's x, topk_idx, topk_weights and output gradient, and the experts' weights."""
    gen = torch.Generator().manual_seed(seed)
    per_rank = []
    for r in range(world):
        T = tokens[r]
        x = torch.randn(T, d, generator=gen, dtype=torch.float64)
        if routing == "one_expert":
            idx = torch.zeros(T, k, dtype=torch.int64)
        elif routing == "same_rank":  # the k experts of a token all on one rank
            first = torch.randint(0, world, (T, 1), generator=gen) * (E // world)
            idx = first + torch.arange(k).view(1, k)
        else:
            idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]) if T else torch.empty(
                0, k, dtype=torch.int64)
        w = torch.rand(T, k, generator=gen, dtype=torch.float64)
        g = torch.randn(T, d, generator=gen, dtype=torch.float64)
        per_rank.append((x, idx, w, g))
    experts = torch.randn(E, d, d, generator=gen, dtype=torch.float64) / d ** 0.5
    return per_rank, experts


def _reference(per_rank, experts):
    """The single-process step: out[t] = sum_j w[t, j] * x[t] @ W[idx[t, j]], its gradients for every
    rank's x and w and for every expert's W, from the loss sum(out * g) over all ranks."""
    W = experts.clone().requires_grad_()
    leaves, loss = [], 0.0
    for x, idx, w, g in per_rank:
        x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = torch.einsum("tj,tjd->td", w, torch.einsum("td,tjde->tje", x, W[idx]))
        loss = loss + (out * g).sum()
        leaves.append((x, w, out.detach()))
    loss.backward()
    return [(out, x.grad, w.grad) for x, w, out in leaves], W.grad


def _step(rank, world, per_rank, experts, E):
    """This rank's dispatch, local experts and combine; returns outputs and gradients."""
    local = E // world
    device = rank_device()
    x, idx, w, g = (t.to(device) for t in per_rank[rank])
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    W = experts[rank * local:(rank + 1) * local].clone().to(device).requires_grad_()
    rows, sizes, handle = dispatch(x, idx, w, num_experts=E)
    expected_sizes = sum(torch.bincount(p[1].reshape(-1), minlength=E) for p in per_rank)[rank * local:(rank + 1) * local]
    assert sizes.dtype == torch.int32 and sizes.tolist() == expected_sizes.tolist()
    # Rows by local expert, each expert's in source-rank then (token, slot) order.
    expected_rows = [p[0][(p[1].reshape(-1) == rank * local + e).nonzero().flatten() // p[1].shape[1]]
                     for e in range(local) for p in per_rank]
    assert torch.equal(rows.cpu(), torch.cat(expected_rows) if expected_rows else rows.cpu())
    bounds = torch.cumsum(sizes, 0).tolist()
    starts = [0] + bounds[:-1]
    y = torch.cat([rows[s:t] @ W[e] for e, (s, t) in enumerate(zip(starts, bounds))]) if local else rows
    out = combine(y, handle)
    (out * g).sum().backward()
    return out.detach().cpu(), x.grad.cpu(), w.grad.cpu(), W.grad.cpu()


def _worker(rank, world, cases):
    for tokens, E, k, d, routing, seed in cases:
        per_rank, experts = _inputs(world, tokens, E, k, d, routing, seed)
        ranks_ref, gW_ref = _reference(per_rank, experts)
        out_ref, gx_ref, gw_ref = ranks_ref[rank]
        out, gx, gw, gW = _step(rank, world, per_rank, experts, E)
        local = E // world
        what = f"rank {rank}, {routing}, tokens {tokens}"
        torch.testing.assert_close(out, out_ref, msg=f"out: {what}")
        torch.testing.assert_close(gx, gx_ref, msg=f"grad x: {what}")
        torch.testing.assert_close(gw, gw_ref, msg=f"grad w: {what}")
        torch.testing.assert_close(gW, gW_ref[rank * local:(rank + 1) * local], msg=f"grad W: {what}")


def _bad_input_worker(rank, world, case):
    x = torch.randn(3, 4)
    idx = torch.tensor([[0, 1], [1, 2], [2, 3]])
    last = rank == world - 1
    if case == "out_of_range" and last:
        idx[1, 0] = 4
    if case == "dtype" and last:
        x = x.double()
    if case == "width" and last:
        x = torch.randn(3, 5)
    E = 3 if case == "indivisible" else 4
    match = {"indivisible": "num_experts", "out_of_range": "topk_idx", "dtype": "one dtype and width",
             "width": "one dtype and width"}[case]
    with pytest.raises(ValueError, match=match):
        dispatch(x, idx, torch.rand(3, 2), num_experts=E)


CASES_2 = [
    ([7, 11], 4, 2, 8, "random", 0),
    ([0, 9], 4, 2, 8, "random", 1),  # a rank with no tokens
    ([6, 5], 4, 1, 8, "one_expert", 2),  # rank 1 receives nothing
    ([8, 3], 8, 2, 8, "same_rank", 3),
]
CASES_4 = [
    ([5, 0, 13, 7], 8, 2, 8, "random", 4),
    ([4, 4, 4, 4], 8, 2, 8, "same_rank", 5),
    ([3, 2, 0, 6], 4, 1, 8, "one_expert", 6),
]


@pytest.mark.parametrize("world, cases", [(2, CASES_2), (4, CASES_4)], ids=["2-ranks", "4-ranks"])
def test_dispatch_combine_match_one_process(world, cases):
    run_ranks(world, _worker, cases)


def _kernel_backend_worker(rank, world, cases):
    """The Triton backend (Triton's interpreter on CPU processes), whose unpermute kernel takes no fp64
    rows: the weighted sums of these fp64 rows take the reference's torch ops, as on a GPU."""
    dropless.set_backend("triton")
    _worker(rank, world, cases)


def test_dispatch_combine_on_the_kernel_backend_match_one_process():
    run_ranks(2, _kernel_backend_worker, CASES_2[:2])


@pytest.mark.gpu
@pytest.mark.parametrize("world, cases", [(2, CASES_2), (4, CASES_4)], ids=["2-gpus", "4-gpus"])
def test_dispatch_combine_match_one_process_over_nccl(world, cases):
    run_ranks(world, _worker, cases, backend="nccl")


@pytest.mark.parametrize("case", ["indivisible", "out_of_range", "dtype", "width"])
def test_bad_input_raises_on_every_rank(case):
    run_ranks(2, _bad_input_worker, case)


def _fp8_worker(rank, world, recipe):
    """With a recipe the copies travel quantized: the received FP8 rows are the sender's quantization of
    each row, and the values returned beside them are their dequantization, with x's gradient path."""
    per_rank, _ = _inputs(world, [6, 9], 4, 2, 64, "random", 7)
    x, idx, w, _ = per_rank[rank]
    x = x.float().requires_grad_()
    (values, rows_fp8), sizes, handle = dispatch(x, idx, w.float(), num_experts=4, recipe=recipe)
    plain, _, _ = dispatch(x.detach(), idx, w.float(), num_experts=4)
    assert rows_fp8.data.dtype == torch.float8_e4m3fn and rows_fp8.dim == 1
    expected = dropless.quantize(plain, rows_fp8.recipe, dim=1)
    assert torch.equal(rows_fp8.data.view(torch.uint8), expected.data.view(torch.uint8))
    torch.testing.assert_close(values, expected.dequantize(torch.float32))
    values.sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))  # each token's k = 2 copies


@pytest.mark.parametrize("recipe", ["rowwise", "block128", "mxfp8"])
def test_fp8_dispatch(recipe):
    run_ranks(2, _fp8_worker, recipe)
