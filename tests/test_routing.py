"""Top-k routing (dropless.ops.routing.route) and the TopKRouter module against plain loops."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import KERNEL_DEVICE

import dropless

from dropless.nn.router import TopKRouter
from dropless.ops.permute import _invert, sort_by_expert
from dropless.ops.routing import route


def _loop_route(logits, top_k, score_func, renormalize, n_groups=None, topk_groups=None, bias=None, scale=1.0):
    """Token by token, expert by expert: the routing written the plainest way."""
    T, E = logits.shape
    ids, weights = [], []
    for t in range(T):
        row = logits[t].double()
        scores = torch.softmax(row, 0) if score_func == "softmax" else torch.sigmoid(row)
        choice = scores + (bias.double() if bias is not None else 0)
        allowed = list(range(E))
        if n_groups is not None:
            size = E // n_groups
            def group_score(g):
                vals = sorted(choice[g * size:(g + 1) * size].tolist(), reverse=True)
                return vals[0] + (vals[1] if score_func == "sigmoid" and size >= 2 else 0.0)
            groups = sorted(range(n_groups), key=group_score, reverse=True)[:topk_groups]
            allowed = [e for g in groups for e in range(g * size, (g + 1) * size)]
        chosen = sorted(allowed, key=lambda e: choice[e].item(), reverse=True)[:top_k]
        w = scores[chosen]
        if renormalize:
            w = w / w.sum()
        ids.append(chosen)
        weights.append((w * scale).tolist())
    return torch.tensor(ids), torch.tensor(weights, dtype=torch.float64)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("T,E,k", [(1, 1, 1), (7, 8, 2), (33, 64, 8), (20, 6, 6)])
def test_route_matches_loop(score_func, renormalize, T, E, k, backend):
    _, device = backend
    logits = torch.randn(T, E) * 3
    routing = route(logits.to(device), k, score_func=score_func, renormalize=renormalize, scale=1.5)
    ids, weights = _loop_route(logits, k, score_func, renormalize, scale=1.5)
    assert torch.equal(routing.expert_ids.cpu(), ids)
    torch.testing.assert_close(routing.weights.double().cpu(), weights, rtol=1e-5, atol=1e-6)
    assert routing.weights.dtype == torch.float32


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_group_limited_routing_matches_loop(score_func, backend):
    _, device = backend
    T, E, k, n_groups, topk_groups = 25, 16, 4, 4, 2
    logits = torch.randn(T, E) * 2
    bias = torch.randn(E) * 0.1
    routing = route(logits.to(device), k, score_func=score_func, n_groups=n_groups, topk_groups=topk_groups,
                    expert_bias=bias.to(device))
    ids, weights = _loop_route(logits, k, score_func, True, n_groups, topk_groups, bias)
    assert torch.equal(routing.expert_ids.cpu(), ids)
    torch.testing.assert_close(routing.weights.double().cpu(), weights, rtol=1e-5, atol=1e-6)


def _loop_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's k largest, largest first, ties to the lower index, NaN above every number."""
    def key(row, e):
        v = row[e].item()
        return (math.isnan(v), v if not math.isnan(v) else 0.0)
    return torch.tensor([sorted(range(scores.shape[1]), key=lambda e: key(row, e), reverse=True)[:k]
                         for row in scores], dtype=torch.int64).view(scores.shape[0], k)


def _scores64(logits: torch.Tensor, score_func: str) -> torch.Tensor:
    logits = logits.double()
    return torch.softmax(logits, -1) if score_func == "softmax" else torch.sigmoid(logits)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("T,E,k", [(1, 1, 1), (5, 3, 3), (70, 128, 8), (33, 160, 6), (9, 1024, 4)])
def test_route_kernel_choice_matches_loop(T, E, k, score_func, triton_backend):
    """The kernel's choice: each row's k best scores, largest first, ties to the lower index, NaN above
    every number; strided logits read as they are."""
    logits = torch.randn(T, E) * 3
    # Ties (equal logits), NaN and -inf logits (scores of exactly 0) in some rows.
    logits[0, : E // 2] = 0.25
    if T > 2:
        logits[1, E // 3] = float("nan")
        logits[2, : E - 1] = float("-inf")
    expected = _loop_topk(_scores64(logits, score_func), k)
    routing = route(logits.to(KERNEL_DEVICE), k, score_func=score_func)
    assert routing.expert_ids.dtype == torch.int64 and routing.expert_ids.shape == (T, k)
    assert torch.equal(routing.expert_ids.cpu(), expected)
    strided = logits.t().contiguous().to(KERNEL_DEVICE).t()
    assert torch.equal(route(strided, k, score_func=score_func).expert_ids.cpu(), expected)


def _route_loss(routing, grad_weights, aux_coef, z_coef):
    return (routing.weights * grad_weights).sum() + aux_coef * routing.aux_loss + z_coef * routing.z_loss


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("options", [
    {}, {"scale": 2.5}, {"bias": True}, {"n_groups": 4, "topk_groups": 2, "bias": True}, {"n_groups": 8, "topk_groups": 3},
])
@pytest.mark.parametrize("T,E,k", [(37, 16, 4), (5, 24, 6)])
def test_route_kernels_match_torch_forward_and_backward(T, E, k, score_func, renormalize, options):
    """The Triton kernels against the PyTorch composition: ids, counts, weights, both losses and the
    logits' gradient (from the weights' and the losses'), every option."""
    options = dict(options)
    if options.pop("bias", False):
        options["expert_bias"] = torch.randn(E) * 0.05
    logits = torch.randn(T, E) * 2
    grad_weights = torch.randn(T, k)
    results = {}
    for name in ("reference", "triton"):
        dropless.set_backend(name)
        device = KERNEL_DEVICE if name == "triton" else torch.device("cpu")
        z = logits.to(device, copy=True).requires_grad_()
        kwargs = {key: (v.to(device) if isinstance(v, torch.Tensor) else v) for key, v in options.items()}
        routing = route(z, k, score_func=score_func, renormalize=renormalize, **kwargs)
        _route_loss(routing, grad_weights.to(device), 0.7, 0.3).backward()
        results[name] = (routing, z.grad)
    (ref, ref_grad), (out, out_grad) = results["reference"], results["triton"]
    assert torch.equal(out.expert_ids.cpu(), ref.expert_ids)
    assert torch.equal(out.tokens_per_expert.cpu(), ref.tokens_per_expert)
    assert out.tokens_per_expert.dtype == torch.int32 and out.weights.dtype == torch.float32
    torch.testing.assert_close(out.weights.cpu(), ref.weights, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.aux_loss.cpu(), ref.aux_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.z_loss.cpu(), ref.z_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out_grad.cpu(), ref_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("min_programs, block_elements", [(1, 4096), (4, 64), (256, 16)])
@pytest.mark.parametrize("T,E,k", [(120, 8, 2), (40, 128, 8), (77, 6, 3)])
def test_route_kernels_tiled_any_way_match_torch(T, E, k, min_programs, block_elements, triton_backend, monkeypatch):
    """However the rows are split over programs (many rows a program, or one; the partial sums read in
    one step or many: both follow ``_BLOCK_ELEMENTS``), the kernels give the PyTorch composition's ids,
    counts, sort, weights, losses and gradient."""
    from dropless.kernels import route as route_kernels

    logits = torch.randn(T, E) * 2
    logits[: T // 3, 1] += 4.0  # one expert most tokens take
    grad_weights = torch.randn(T, k)
    dropless.set_backend("reference")
    z_ref = logits.clone().requires_grad_()
    ref = route(z_ref, k)
    _route_loss(ref, grad_weights, 0.7, 0.3).backward()
    dropless.set_backend("triton")
    monkeypatch.setattr(route_kernels, "_MIN_PROGRAMS", min_programs)
    monkeypatch.setattr(route_kernels, "_BLOCK_ELEMENTS", block_elements)
    z = logits.to(KERNEL_DEVICE).requires_grad_()
    _poison_empty(monkeypatch)
    out = route(z, k, sort=True)
    _route_loss(out, grad_weights.to(KERNEL_DEVICE), 0.7, 0.3).backward()
    monkeypatch.undo()
    slots, sizes, offsets = sort_by_expert(ref.expert_ids, E)
    assert torch.equal(out.expert_ids.cpu(), ref.expert_ids)
    assert torch.equal(out.tokens_per_expert.cpu(), sizes) and torch.equal(out.offsets.cpu(), offsets)
    assert torch.equal(out.sorted_to_token_slot.cpu(), slots)
    torch.testing.assert_close(out.weights.cpu(), ref.weights, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.aux_loss.cpu(), ref.aux_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.z_loss.cpu(), ref.z_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(z.grad.cpu(), z_ref.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("uses", ["weights", "aux", "z"])
def test_route_kernel_gradient_of_each_output_alone(uses, triton_backend):
    """A gradient from one output only (the others' are None), checked against the reference backend."""
    logits = torch.randn(19, 12)
    grads = {}
    for name in ("reference", "triton"):
        dropless.set_backend(name)
        z = logits.to(KERNEL_DEVICE if name == "triton" else "cpu", copy=True).requires_grad_()
        routing = route(z, 3)
        out = {"weights": routing.weights.square().sum(), "aux": routing.aux_loss, "z": routing.z_loss}[uses]
        (grads[name],) = torch.autograd.grad(out, z)
    assert bool(grads["triton"].abs().sum() > 0)
    torch.testing.assert_close(grads["triton"].cpu(), grads["reference"], rtol=1e-4, atol=1e-7)


def _poison_empty(monkeypatch) -> None:
    """Every ``torch.empty`` until ``monkeypatch.undo()`` starts NaN (floats) or -7 (integers)."""
    real_empty = torch.empty

    def poisoned_empty(*shape, dtype=None, device=None, **kwargs):
        t = real_empty(*shape, dtype=dtype, device=device, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else -7)

    monkeypatch.setattr(torch, "empty", poisoned_empty)


def test_route_kernels_write_every_output(triton_backend, monkeypatch):
    """Every buffer the kernels allocate starts poisoned (NaN, or -7 for integers): every element read
    back was written."""
    T, E, k = 45, 40, 5
    logits = torch.randn(T, E).to(KERNEL_DEVICE).requires_grad_()
    _poison_empty(monkeypatch)
    routing = route(logits, k, score_func="sigmoid", expert_bias=torch.randn(E, device=KERNEL_DEVICE))
    (grad,) = torch.autograd.grad(routing.weights.sum() + routing.aux_loss + routing.z_loss, logits)
    monkeypatch.undo()
    assert bool(torch.isfinite(routing.weights).all()) and bool(torch.isfinite(grad).all())
    assert bool(((routing.expert_ids >= 0) & (routing.expert_ids < E)).all())
    assert int(routing.tokens_per_expert.sum()) == T * k
    assert torch.equal(routing.tokens_per_expert.cpu(),
                       torch.bincount(routing.expert_ids.flatten().cpu(), minlength=E).to(torch.int32))
    assert bool(torch.isfinite(routing.aux_loss)) and bool(torch.isfinite(routing.z_loss))


@pytest.mark.parametrize("E, dtype", [(1100, torch.float32), (16, torch.float64)])
def test_route_past_the_kernel_falls_back_to_torch(E, dtype, backend, monkeypatch):
    """Rows wider than the kernels hold, and fp64 rows, take the PyTorch ops on either backend."""
    _, device = backend

    def refuse(*_):
        raise AssertionError("the top-k kernel was called")

    monkeypatch.setattr("dropless.ops.routing.route_forward", refuse)
    logits = torch.randn(3, E, dtype=dtype) * 3
    routing = route(logits.to(device), 4)
    ids, _ = _loop_route(logits, 4, "softmax", True)
    assert torch.equal(routing.expert_ids.cpu(), ids)


def test_route_of_no_tokens(backend):
    _, device = backend
    logits = torch.randn(0, 8, device=device, requires_grad=True)
    routing = route(logits, 2)
    assert routing.expert_ids.shape == (0, 2) and routing.weights.shape == (0, 2)
    assert int(routing.tokens_per_expert.sum()) == 0 and float(routing.aux_loss) == 0.0


def test_expert_bias_steers_the_choice_not_the_weights():
    logits = torch.randn(10, 8)
    bias = torch.zeros(8)
    bias[3] = 100.0
    routing = route(logits, 2, score_func="sigmoid", renormalize=False, expert_bias=bias)
    assert bool((routing.expert_ids[:, 0] == 3).all())
    torch.testing.assert_close(routing.weights[:, 0], torch.sigmoid(logits[:, 3]))


def test_counts_and_losses():
    T, E, k = 40, 8, 2
    logits = torch.randn(T, E)
    routing = route(logits, k)
    counts = torch.bincount(routing.expert_ids.flatten(), minlength=E)
    assert torch.equal(routing.tokens_per_expert, counts.to(torch.int32))
    probs = torch.softmax(logits, -1)
    expected_aux = E * ((counts.float() / (T * k)) * probs.mean(0)).sum()
    torch.testing.assert_close(routing.aux_loss, expected_aux)
    torch.testing.assert_close(routing.z_loss, torch.logsumexp(logits, -1).square().mean())


def test_aux_loss_is_one_at_perfect_balance():
    E = 4
    logits = torch.zeros(E, E)
    logits.fill_diagonal_(5.0)  # token t prefers expert t: every expert gets one token
    routing = route(logits, 1)
    assert math.isclose(routing.aux_loss.item(), 1.0, rel_tol=1e-6)


def test_route_gradcheck_fp64():
    logits = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)

    def f(z):
        r = route(z, 2, score_func="softmax")
        return r.weights, r.aux_loss, r.z_loss

    assert torch.autograd.gradcheck(f, (logits,))


@pytest.mark.parametrize("kwargs,match", [
    ({"score_func": "relu"}, "score_func"),
    ({"n_groups": 3, "topk_groups": 1}, "n_groups"),
    ({"n_groups": 4, "topk_groups": 5}, "topk_groups"),
    ({"n_groups": 4, "topk_groups": 1, "top_k": 3}, "fewer than top_k"),
    ({"expert_bias": torch.zeros(5)}, r"expert_bias must have shape \[E=8\]"),
])
def test_route_rejects_bad_options(kwargs, match):
    top_k = kwargs.pop("top_k", 2)
    with pytest.raises(ValueError, match=match):
        route(torch.randn(4, 8), top_k, **kwargs)


@pytest.mark.parametrize("top_k", [0, 9])
def test_route_rejects_bad_top_k(top_k):
    with pytest.raises(ValueError, match="top_k"):
        route(torch.randn(4, 8), top_k)


@pytest.mark.parametrize("kwargs, pattern", [
    ({"top_k": 0}, r"^top_k must be in \[1, num_experts=8\], got 0$"),
    ({"top_k": 9}, r"^top_k must be in \[1, num_experts=8\], got 9$"),
    ({"num_experts": 0, "top_k": 1}, r"^num_experts must be at least 1, got 0$"),
    ({"d_model": 0}, r"^d_model must be at least 1, got 0$"),
    ({"score_func": "relu"}, r"^score_func must be one of \('softmax', 'sigmoid'\), got 'relu'$"),
])
def test_router_module_rejects_bad_options_at_construction(kwargs, pattern):
    options = {"d_model": 16, "num_experts": 8, "top_k": 2, **kwargs}
    with pytest.raises(ValueError, match=pattern):
        TopKRouter(options.pop("d_model"), options.pop("num_experts"), options.pop("top_k"), **options)


def test_router_module_counts_and_bias_update():
    torch.manual_seed(0)
    router = TopKRouter(16, 8, 2, score_func="sigmoid", expert_bias=True, bias_update_rate=0.01)
    with torch.no_grad():
        router.weight[5] += 3.0  # expert 5 wins most tokens
    x = torch.randn(64, 16).abs()
    routing = router(x)
    assert torch.equal(router.tokens_per_expert, routing.tokens_per_expert)
    load = routing.tokens_per_expert.float()
    router.update_expert_bias()
    expected = 0.01 * torch.sign(load.mean() - load)
    torch.testing.assert_close(router.expert_bias, expected)
    assert router.expert_bias[5] < 0
    assert int(router.load_since_update.sum()) == 0


def test_router_without_bias_refuses_update():
    with pytest.raises(RuntimeError, match="expert_bias=True"):
        TopKRouter(8, 4, 1).update_expert_bias()


def test_router_gradient_reaches_the_gate():
    router = TopKRouter(8, 4, 2, dtype=torch.float64)
    x = torch.randn(10, 8, dtype=torch.float64)
    routing = router(x)
    ((routing.weights ** 2).sum() + routing.aux_loss).backward()
    assert router.weight.grad is not None and bool(torch.isfinite(router.weight.grad).all())
    assert router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("case", ["spread", "one giant group", "grouped", "few tokens"])
def test_route_sort_matches_sort_by_expert(case, backend, monkeypatch):
    """``route(..., sort=True)``'s copies by expert (the kernels' counting sort on the Triton backend) are
    ``sort_by_expert``'s stable sort of the ids, with experts of no copies; the inverse it keeps for the
    gathers is the sort's inverse; every buffer starts poisoned."""
    _, device = backend
    T, E, k, options = {"spread": (300, 128, 8, {}), "one giant group": (77, 24, 3, {}),
                        "grouped": (45, 32, 4, {"n_groups": 4, "topk_groups": 2}), "few tokens": (2, 40, 6, {})}[case]
    logits = torch.randn(T, E) * 2
    if case == "one giant group":
        logits[:, 5] += 50.0  # every token's first choice
    _poison_empty(monkeypatch)
    routing = route(logits.to(device), k, sort=True, **options)
    monkeypatch.undo()
    slots, sizes, offsets = sort_by_expert(routing.expert_ids, E)
    assert routing.sorted_to_token_slot.dtype == torch.int32 and routing.offsets.dtype == torch.int32
    assert torch.equal(routing.sorted_to_token_slot, slots)
    assert torch.equal(routing.offsets, offsets) and torch.equal(routing.tokens_per_expert, sizes)
    if case == "one giant group":
        assert int(sizes[5]) == T
    if case == "few tokens":
        assert int((sizes == 0).sum()) >= E - T * k
    inverse = _invert(routing.sorted_to_token_slot)
    assert torch.equal(routing.sorted_to_token_slot[inverse.long()].cpu(), torch.arange(T * k, dtype=torch.int32))
    assert route(logits.to(device), k).sorted_to_token_slot is None


@pytest.mark.parametrize("sort", [False, True])
def test_route_kernels_compile_fullgraph(sort, triton_backend):
    """torch.compile traces the routing's custom ops (forward and backward) and gives eager's results."""
    torch._dynamo.reset()
    logits = torch.randn(21, 16, device=KERNEL_DEVICE)
    grad_weights = torch.randn(21, 4, device=KERNEL_DEVICE)

    def step(z):
        routing = route(z, 4, score_func="sigmoid", n_groups=4, topk_groups=2, sort=sort)
        loss = (routing.weights * grad_weights).sum() + routing.aux_loss + routing.z_loss
        return routing.expert_ids, routing.sorted_to_token_slot, loss

    results = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        z = logits.clone().requires_grad_()
        ids, slots, loss = fn(z)
        (grad,) = torch.autograd.grad(loss, z)
        results.append((ids, slots, loss.detach(), grad))
    (ids, slots, loss, grad), (ids_c, slots_c, loss_c, grad_c) = results
    assert torch.equal(ids, ids_c)
    assert (slots is None) == (not sort) and (slots_c is None) == (not sort)
    if sort:
        assert torch.equal(slots, slots_c)
    torch.testing.assert_close(loss_c, loss)
    torch.testing.assert_close(grad_c, grad)
