"""dropless.parallel.dispatch / combine on 2 and 4 CPU processes over gloo (and on 2 and 4 GPUs over
NCCL), both backends ("nccl"; "symmetric_memory": shared memory between the CPU processes, torch
symmetric memory on GPUs), against the same MoE step computed in one process from every rank's inputs
(each rank draws all ranks' inputs from one seed).

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


def _step(rank, world, per_rank, experts, E, backend="nccl"):
    """This rank's dispatch, local experts and combine; returns outputs and gradients. The symmetric
    backend's rows past the received ones (left unwritten) go through the experts' stand-in untouched:
    combine must ignore them whatever they hold. The ranks hold different numbers of tokens."""
    local = E // world
    device = rank_device()
    x, idx, w, g = (t.to(device) for t in per_rank[rank])
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    W = experts[rank * local:(rank + 1) * local].clone().to(device).requires_grad_()
    rows, sizes, handle = dispatch(x, idx, w, num_experts=E, backend=backend)
    expected_sizes = sum(torch.bincount(p[1].reshape(-1), minlength=E) for p in per_rank)[rank * local:(rank + 1) * local]
    assert sizes.dtype == torch.int32 and sizes.tolist() == expected_sizes.tolist()
    received = int(sizes.sum())
    if backend == "symmetric_memory":
        # Rows for the most a rank can receive, with the token count the ranks agreed on (the most any had
        # when the buffers were made, however many this rank has).
        assert handle.max_tokens >= max(p[0].shape[0] for p in per_rank)
        assert rows.shape == (world * handle.max_tokens * idx.shape[1], x.shape[1])
        # Each token crosses once to each rank it sends copies to.
        pairs = sum(int(((p[1] // local) == rank).any(1).sum()) for p in per_rank)
        assert int(handle.staged) == pairs
    # Rows by local expert, each expert's in source-rank then (token, slot) order.
    expected_rows = [p[0][(p[1].reshape(-1) == rank * local + e).nonzero().flatten() // p[1].shape[1]]
                     for e in range(local) for p in per_rank]
    assert torch.equal(rows[:received].cpu(), torch.cat(expected_rows))
    bounds = torch.cumsum(sizes, 0).tolist()
    starts = [0] + bounds[:-1]
    y = torch.cat([rows[s:t] @ W[e] for e, (s, t) in enumerate(zip(starts, bounds))] + [rows[received:]])
    out = combine(y, handle)
    (out * g).sum().backward()
    return out.detach().cpu(), x.grad.cpu(), w.grad.cpu(), W.grad.cpu()


def _worker(rank, world, cases, backend="nccl"):
    """Each case against the one-process step: in fp64 with "nccl", in fp32 (its rows' widest dtype) with
    "symmetric_memory", against the fp64 step on the same fp32 values."""
    dtype = torch.float64 if backend == "nccl" else torch.float32
    tol = {} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
    for tokens, E, k, d, routing, seed in cases:
        per_rank, experts = _inputs(world, tokens, E, k, d, routing, seed)
        per_rank = [tuple(t.to(dtype) if t.is_floating_point() else t for t in p) for p in per_rank]
        experts = experts.to(dtype)
        ranks_ref, gW_ref = _reference([tuple(t.double() if t.is_floating_point() else t for t in p)
                                        for p in per_rank], experts.double())
        out_ref, gx_ref, gw_ref = (t.to(dtype) for t in ranks_ref[rank])
        out, gx, gw, gW = _step(rank, world, per_rank, experts, E, backend)
        local = E // world
        what = f"rank {rank}, {routing}, tokens {tokens}, {backend}"
        torch.testing.assert_close(out, out_ref, msg=f"out: {what}", **tol)
        torch.testing.assert_close(gx, gx_ref, msg=f"grad x: {what}", **tol)
        torch.testing.assert_close(gw, gw_ref, msg=f"grad w: {what}", **tol)
        torch.testing.assert_close(gW, gW_ref[rank * local:(rank + 1) * local].to(dtype), msg=f"grad W: {what}",
                                   **tol)


def _bad_input_worker(rank, world, case, backend="nccl"):
    """Bad input on the last rank raises on every rank. The symmetric backend checks ids and rows across
    ranks on the device, with validation on (every rank reads every rank's facts: on the CPU they raise
    at once, on GPUs at the next sync); a dtype it does not move raises before any exchange."""
    symmetric = backend == "symmetric_memory"
    dropless.set_validation(symmetric)
    x = torch.randn(3, 4)
    idx = torch.tensor([[0, 1], [1, 2], [2, 3]])
    last = rank == world - 1
    if case == "out_of_range" and last:
        idx[1, 0] = -1 if symmetric else 4
    if case == "dtype" and last:
        x = x.half() if symmetric else x.double()
    if case == "width" and last:
        x = torch.randn(3, 6 if symmetric else 5)
    if case == "fp64":
        x = x.double()
    checked_on_device = RuntimeError if symmetric else ValueError
    error, match = {"indivisible": (ValueError, "num_experts"),
                    "no_experts": (ValueError, "num_experts must be an int"),
                    "out_of_range": (checked_on_device, "topk_idx"),
                    "dtype": (checked_on_device, "one dtype and width"),
                    "width": (checked_on_device, "one dtype and width"), "fp64": (ValueError, "x must be one of"),
                    "max_tokens": (ValueError, "max_tokens")}[case]
    with pytest.raises(error, match=match):
        dispatch(x, idx, torch.rand(3, 2), num_experts={"indivisible": 3, "no_experts": 0}.get(case, 4),
                 backend=backend, max_tokens=2 if case == "max_tokens" else None)


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


@pytest.mark.parametrize("world, cases", [(2, CASES_2), (4, CASES_4)], ids=["2-ranks", "4-ranks"])
def test_symmetric_memory_dispatch_combine_match_one_process(world, cases):
    run_ranks(world, _worker, cases, "symmetric_memory")


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


@pytest.mark.gpu
@pytest.mark.parametrize("world, cases", [(2, CASES_2), (4, CASES_4)], ids=["2-gpus", "4-gpus"])
def test_symmetric_memory_dispatch_combine_match_one_process_on_gpus(world, cases):
    run_ranks(world, _worker, cases, "symmetric_memory", backend="nccl")


@pytest.mark.parametrize("case", ["indivisible", "no_experts", "out_of_range", "dtype", "width"])
def test_bad_input_raises_on_every_rank(case):
    run_ranks(2, _bad_input_worker, case)


@pytest.mark.parametrize("case", ["out_of_range", "dtype", "width", "fp64", "max_tokens"])
def test_symmetric_memory_bad_input_raises_on_every_rank(case):
    run_ranks(2, _bad_input_worker, case, "symmetric_memory")


def _fp8_worker(rank, world, recipe, ep_backend):
    """With a recipe the copies travel quantized: the received FP8 rows are the sender's quantization of
    each row, and the values returned beside them are their dequantization, with x's gradient path."""
    per_rank, _ = _inputs(world, [6, 9], 4, 2, 256, "random", 7)
    x, idx, w, _ = (t.to(rank_device()) for t in per_rank[rank])
    x = x.float().requires_grad_()
    options = {"backend": ep_backend, **({"max_tokens": 9} if ep_backend == "symmetric_memory" else {})}
    (values, rows_fp8), sizes, handle = dispatch(x, idx, w.float(), num_experts=4, recipe=recipe, **options)
    plain, _, _ = dispatch(x.detach(), idx, w.float(), num_experts=4, **options)
    n = int(sizes.sum())
    assert rows_fp8.data.dtype == torch.float8_e4m3fn and rows_fp8.dim == 1
    assert values.shape[0] == rows_fp8.data.shape[0] == rows_fp8.scale.shape[0] == plain.shape[0]
    expected = dropless.quantize(plain[:n], rows_fp8.recipe, dim=1)
    assert torch.equal(rows_fp8.data[:n].view(torch.uint8), expected.data.view(torch.uint8))
    assert torch.equal(rows_fp8.scale[:n], expected.scale)
    torch.testing.assert_close(values[:n], expected.dequantize(torch.float32))
    values[:n].sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))  # each token's k = 2 copies


@pytest.mark.parametrize("ep_backend", ["nccl", "symmetric_memory"])
@pytest.mark.parametrize("recipe", ["rowwise", "block128", "mxfp8"])
def test_fp8_dispatch(recipe, ep_backend):
    run_ranks(2, _fp8_worker, recipe, ep_backend)


@pytest.mark.gpu
@pytest.mark.parametrize("ep_backend", ["nccl", "symmetric_memory"])
@pytest.mark.parametrize("recipe", ["rowwise", "block128", "mxfp8"])
def test_fp8_dispatch_on_gpus(recipe, ep_backend):
    """The same on 2 GPUs, where the received rows' dequantization runs the row-bounded kernel."""
    run_ranks(2, _fp8_worker, recipe, ep_backend, backend="nccl")
