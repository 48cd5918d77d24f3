"""FP8 grouped GEMMs: the forward, dgrad and ragged-K wgrad of ``grouped_mm`` on FP8 operands.

    y[s_e:t_e]  = (x * sx)[s_e:t_e] @ (w[e] * sw)          x quantized along K, w[e] along K
    dx[s_e:t_e] = (dy * sdy)[s_e:t_e] @ (w[e] * sw')^T     dy along N, w[e] along N
    dw[e]       = (x * sx')[s_e:t_e]^T @ (dy * sdy')[s_e:t_e]  both along the tokens, blocks per group

FP32 accumulation, output in the activations' dtype (bf16 when the activations come quantized). The
weight is quantized in both orientations by one kernel (``quantize_weight``); a caller that keeps the
pair for as long as the weight does not change (``GroupedLinear`` does, per weight version) pays that
once per optimizer step. The three products are ``torch.library`` custom ops on raw tensors (data,
scale, recipe name), so ``torch.compile`` traces the autograd function that composes them; nothing
reads group sizes on the host. The wgrad's operands are quantized per group along the tokens, every
group starting at a 128-aligned row of their ``[Mp, K]`` / ``[Mp, N]`` data (``dropless.quantized``), so
its kernel reads them through TMA whatever the recipe. Where both orientations of x (forward) or dy
(backward) are needed, the copy along the tokens is made after the product that reads the other is
done, so the two never coexist, and where dy is over four times as wide as x (a wide gate/up projection)
the weight gradient takes dy's columns in runs of K, each quantized when its product runs, so that the
copy the backward holds at its peak (with the weight gradient) is no larger than x's. Rows past the
last group (a buffer sized for the most rows a rank can receive) are neither quantized
(``quantize(..., tail=False)``) nor multiplied: the products write their zeros only.
"""

from __future__ import annotations

import functools

import torch

from dropless import reference
from dropless.backend import use_triton
from dropless.kernels.launch import cdiv, weight_nk
from dropless.kernels.ragged_k import ACCUMULATE_ALL, ACCUMULATE_FLAGGED, NO_ACCUMULATE
from dropless.ops.direct import DirectOp
from dropless.ops.fp8_launch import launch_ragged_k_fp8, launch_ragged_m_fp8
from dropless.ops.fp8_gradient import take_fp8_copy
from dropless.ops.permute import quantize_permuted, sum_copies
from dropless.ops.quantize import check_quantized, quantize, quantize_weight
from dropless.quantized import GROUP_ALIGN, QuantizedTensor, Recipe, get_recipe, operand_recipes


def swap_weight(q: QuantizedTensor) -> QuantizedTensor:
    """A quantized weight ``[E, K, N]`` seen as ``[E, N, K]`` (views, no copy): quantized along N, it is
    the right-hand operand of the dgrad product, quantized along dim 1."""
    return QuantizedTensor(q.data.transpose(1, 2), q.scale.transpose(1, 2), q.recipe, 3 - q.dim)


def _operands(a_data, a_scale, b_data, b_scale, recipe: str, offsets, token_dim: bool):
    """The QuantizedTensors of a product's raw operands, as the GEMM recipe ``recipe`` lays them out."""
    act, weights = operand_recipes(get_recipe(recipe))
    if token_dim:
        # The raw data tells M only rounded up to GROUP_ALIGN (Mp - GROUP_ALIGN * E), the bound the kernel
        # clamps groups to, from which the scale rows follow too; the product reads no token past
        # offsets[-1], so that stands for M.
        tokens = a_data.shape[0] - GROUP_ALIGN * offsets.shape[0]
        return (QuantizedTensor(a_data, a_scale, act, 0, offsets, tokens),
                QuantizedTensor(b_data, b_scale, act, 0, offsets, tokens))
    return QuantizedTensor(a_data, a_scale, act, 1), QuantizedTensor(b_data, b_scale, weights, 1)


def _ragged_m(a_data: torch.Tensor, a_scale: torch.Tensor, b_data: torch.Tensor, b_scale: torch.Tensor,
              offsets: torch.Tensor, recipe: str, out_dtype: torch.dtype, tail: bool = True) -> torch.Tensor:
    """The product's ``[M, N]`` rows; ``tail=False``: the rows past ``offsets[-1]`` hold anything (the
    reference backend still writes them as zeros)."""
    a, b = _operands(a_data, a_scale, b_data, b_scale, recipe, offsets, token_dim=False)
    if not use_triton(a_data.device):
        return reference.grouped_mm(a.dequantize(torch.float32), b.dequantize(torch.float32), offsets).to(out_dtype)
    y = torch.empty(a_data.shape[0], b_data.shape[2], dtype=out_dtype, device=a_data.device)
    if a_data.shape[1] == 0:
        y.zero_()
    elif y.numel() > 0:
        launch_ragged_m_fp8(a, b, offsets, y, tail=tail)
    return y


def _ragged_m_fake(a_data, a_scale, b_data, b_scale, offsets, recipe, out_dtype, tail=True):
    return a_data.new_empty(a_data.shape[0], b_data.shape[2], dtype=out_dtype)


def _ragged_k_into(a_data: torch.Tensor, a_scale: torch.Tensor, b_data: torch.Tensor, b_scale: torch.Tensor,
                   offsets: torch.Tensor, recipe: str, out: torch.Tensor, flags: torch.Tensor | None,
                   accumulate: bool) -> None:
    a, b = _operands(a_data, a_scale, b_data, b_scale, recipe, offsets, token_dim=True)
    if not use_triton(a_data.device):
        dw = reference.grouped_mm_wgrad(a.dequantize(torch.float32), b.dequantize(torch.float32), offsets)
        reference.accumulate_into(out, dw, flags if flags is not None else accumulate)
        return
    mode = ACCUMULATE_FLAGGED if flags is not None else ACCUMULATE_ALL if accumulate else NO_ACCUMULATE
    if out.numel() > 0:
        launch_ragged_k_fp8(a, b, offsets, out, mode, flags)


def _ragged_k_into_fake(a_data, a_scale, b_data, b_scale, offsets, recipe, out, flags, accumulate) -> None:
    return None


def _ragged_k(a_data: torch.Tensor, a_scale: torch.Tensor, b_data: torch.Tensor, b_scale: torch.Tensor,
              offsets: torch.Tensor, recipe: str, out_dtype: torch.dtype, transposed: bool) -> torch.Tensor:
    """``dw [E, K, N]``, or its transpose ``[E, N, K]`` (contiguous) if ``transposed``."""
    E, K, N = offsets.shape[0], a_data.shape[1], b_data.shape[1]
    dw = torch.empty((E, N, K) if transposed else (E, K, N), dtype=out_dtype, device=a_data.device)
    _ragged_k_into(a_data, a_scale, b_data, b_scale, offsets, recipe, dw.transpose(1, 2) if transposed else dw,
                   None, False)
    return dw


def _ragged_k_fake(a_data, a_scale, b_data, b_scale, offsets, recipe, out_dtype, transposed):
    E, K, N = offsets.shape[0], a_data.shape[1], b_data.shape[1]
    return a_data.new_empty((E, N, K) if transposed else (E, K, N), dtype=out_dtype)


RAGGED_M = DirectOp.define("fp8_ragged_m", _ragged_m, _ragged_m_fake)
RAGGED_K = DirectOp.define("fp8_ragged_k", _ragged_k, _ragged_k_fake)
RAGGED_K_INTO = DirectOp.define("fp8_ragged_k_into", _ragged_k_into, _ragged_k_into_fake, mutates_args=("out",))


def quantized_mm(xq: QuantizedTensor, wq: QuantizedTensor, offsets: torch.Tensor, recipe: Recipe,
                 out_dtype: torch.dtype, tail: bool = True) -> torch.Tensor:
    """Forward product of operands already quantized (x along K, w ``[E, K, N]`` along K); no autograd."""
    return RAGGED_M(xq.data, xq.scale, wq.data, wq.scale, offsets, recipe.name, out_dtype, tail)


def quantized_wgrad(xq: QuantizedTensor, dyq: QuantizedTensor, offsets: torch.Tensor, recipe: Recipe,
                    out: torch.Tensor | None, flags: torch.Tensor | None, accumulate: bool,
                    out_dtype: torch.dtype, transposed: bool = False) -> torch.Tensor:
    """``dw[e] = x_e^T dy_e`` of operands quantized along the tokens per group: written into (or added
    to) ``out``, or returned as a new ``[E, K, N]`` tensor (its ``[E, N, K]`` transpose if ``transposed``)."""
    if out is None:
        return RAGGED_K(xq.data, xq.scale, dyq.data, dyq.scale, offsets, recipe.name, out_dtype, transposed)
    RAGGED_K_INTO(xq.data, xq.scale, dyq.data, dyq.scale, offsets, recipe.name, out, flags, accumulate)
    return out


def _gathered_activation(x: torch.Tensor, act: Recipe, offsets: torch.Tensor, slots: torch.Tensor, top_k: int,
                         along_tokens: bool) -> tuple[QuantizedTensor, QuantizedTensor | None]:
    """permute's rows of x (``x[slots // top_k]``) quantized along K (one kernel reads each token once and
    writes its FP8 copies) and, where asked, per group along the tokens (each row read by index); the
    permuted rows in x's dtype are never made."""
    along_k = quantize_permuted(x, slots, offsets, top_k, act)
    along = quantize(x, act, dim=0, offsets=offsets, rows=slots // top_k, tail=False) if along_tokens else None
    return along_k, along


class Fp8GroupedMM(torch.autograd.Function):
    """``y = grouped x @ w`` in FP8 with the weight's two quantized orientations given.

    forward(x [M, K], w [E, K, N], offsets, wk_data, wk_scale, wn_data, wn_scale, recipe, main_grad,
    accumulate): x in bf16/fp16/fp32, w the (unquantized) weight the gradient is for; ``main_grad``
    (an fp32 ``[E, K, N]`` view) receives the weight gradient in place instead of ``w``'s gradient,
    added for the experts whose ``accumulate`` flag is set (a bool ``[E]`` tensor). ``xq_data, xq_scale``
    (optional): x already quantized along K with the recipe's activation recipe, by the kernel that
    produced x (``swiglu(h, recipe=...)``); the forward then reads them instead of quantizing x along
    K. x is still what the weight gradient quantizes along the tokens.

    ``slots, top_k`` (optional, ``dropless.permute``'s ``sorted_to_token_slot`` and k): x is the ``[T, K]``
    tokens and row p of the product is token ``slots[p] // top_k`` (permute's rows, never made): x is
    quantized along K once, its FP8 rows and scales gathered, and quantized along the tokens reading
    the rows by index; x's gradient sums each token's copies in fp32 (``sum_copies``).

    ``tail=False``: y's rows past ``offsets[-1]``, and x's gradient's, are left unwritten (a caller that
    reads none of them, such as a worst-case-sized receive buffer).
    """

    @staticmethod
    def forward(ctx, x, w, offsets, wk_data, wk_scale, wn_data, wn_scale, recipe, main_grad, accumulate,
                xq_data=None, xq_scale=None, slots=None, top_k=None, tail=True):
        act, _ = operand_recipes(recipe)
        wants_wgrad = ctx.needs_input_grad[1] or main_grad is not None
        if slots is not None:
            xq, xt = _gathered_activation(x, act, offsets, slots, top_k, wants_wgrad)
        else:
            xq = quantize(x, act, dim=1, offsets=offsets, tail=False) if xq_data is None else None
            xt = None
        if xq is not None:
            xq_data, xq_scale = xq.data, xq.scale
        y = RAGGED_M(xq_data, xq_scale, wk_data, wk_scale, offsets, recipe.name, x.dtype, tail)
        del xq, xq_data, xq_scale
        if wants_wgrad and xt is None:
            # Saved as FP8 along the tokens (half the bytes of x), quantized after the product is done with
            # x's copy along K, so the two never coexist. Two calls outran one launch writing both copies
            # from one read of x (v23).
            xt = quantize(x, act, dim=0, offsets=offsets, tail=False)
        ctx.slots, ctx.tokens, ctx.tail = slots, x.shape[0], tail
        ctx.recipe = recipe
        ctx.wants_wgrad = wants_wgrad
        ctx.main_grad = main_grad
        ctx.w_nk = weight_nk(w)
        ctx.w_dtype = w.dtype
        ctx.w_shape = tuple(w.shape)
        saved = (xt.data, xt.scale) if xt is not None else (None, None)
        ctx.save_for_backward(offsets, wn_data, wn_scale, accumulate, *saved)
        return y

    @staticmethod
    def backward(ctx, dy):
        offsets, wn_data, wn_scale, accumulate, xt_data, xt_scale = ctx.saved_tensors
        recipe = ctx.recipe
        act, weights = operand_recipes(recipe)
        dyq = take_fp8_copy(dy, act)
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            if dyq is None:
                dyq = quantize(dy, act, dim=1, offsets=offsets, tail=False)
            wn = swap_weight(QuantizedTensor(wn_data, wn_scale, weights, 2))
            dx = RAGGED_M(dyq.data, dyq.scale, wn.data, wn.scale, offsets, recipe.name, dy.dtype, ctx.tail)
            if ctx.slots is not None:
                dx = sum_copies(dx, ctx.slots, offsets, ctx.tokens)
        del dyq  # freed before the weight gradient's copies are made
        if ctx.wants_wgrad:
            xt = QuantizedTensor(xt_data, xt_scale, act, 0, offsets, dy.shape[0])
            runs = column_runs(xt.shape[1], dy.shape[1])
            if ctx.main_grad is not None:
                wgrad_by_columns(xt, dy, offsets, recipe, ctx.main_grad, accumulate, True, runs)
            elif ctx.needs_input_grad[1] and len(runs) > 1:
                E, K, N = ctx.w_shape
                dw = torch.empty((E, N, K) if ctx.w_nk else (E, K, N), dtype=ctx.w_dtype, device=dy.device)
                dw = dw.transpose(1, 2) if ctx.w_nk else dw
                wgrad_by_columns(xt, dy, offsets, recipe, dw, None, False, runs)
            elif ctx.needs_input_grad[1]:
                dyt = quantize(dy, act, dim=0, offsets=offsets, tail=False)
                dw = quantized_wgrad(xt, dyt, offsets, recipe, None, None, False, ctx.w_dtype, ctx.w_nk)
                dw = dw.transpose(1, 2) if ctx.w_nk else dw
        return dx, dw, *([None] * 13)


def column_chunks(K: int, N: int) -> list[tuple[int, int]]:
    """Column ranges of dy for the weight gradient: all N at once, unless dy is over four times as wide
    as x (N > 4 K, a wide gate/up projection: its copy quantized along the tokens, M N bytes, would then be
    over twice the bf16 x that a BF16 backward holds beside the weight gradient at its peak); then runs of
    K columns rounded down to a multiple of 128 (at least 128), of one width, each copy no larger than x's
    FP8 copy. Each run costs a quantization and a product launch, which narrower dy does not pay."""
    if N <= 4 * K:
        return [(0, N)] if N else []
    step = cdiv(cdiv(N, cdiv(N, max(K // GROUP_ALIGN * GROUP_ALIGN, GROUP_ALIGN))), GROUP_ALIGN) * GROUP_ALIGN
    return [(n0, min(n0 + step, N)) for n0 in range(0, N, step)]


def column_runs(K: int, N: int) -> list[tuple[int, int]]:
    """``column_chunks``, or all N at once in a compiled graph, which plans its own buffers (and whose
    inductor takes no custom op writing into a slice of a tensor)."""
    return [(0, N)] if torch.compiler.is_compiling() else column_chunks(K, N)


def wgrad_by_columns(xt: QuantizedTensor, dy: torch.Tensor, offsets: torch.Tensor, recipe: Recipe,
                     out: torch.Tensor, flags: torch.Tensor | None, accumulate: bool,
                     runs: list[tuple[int, int]]) -> None:
    """``out[e] (+)= xt_e^T dy_e`` into ``out [E, K, N]`` (any strides; accumulation as
    ``quantized_wgrad``'s) for x already quantized per group along the tokens and dy ``[M, N]`` quantized
    here, a run of its columns at a time: every scale is per column, so the runs give the bytes of one
    call, and the backward's peak holds one run's copy."""
    act, _ = operand_recipes(recipe)
    for n0, n1 in runs:
        whole = (n0, n1) == (0, dy.shape[1])
        dyt = quantize(dy if whole else dy[:, n0:n1], act, dim=0, offsets=offsets, tail=False)
        quantized_wgrad(xt, dyt, offsets, recipe, out if whole else out[:, :, n0:n1], flags, accumulate, out.dtype)
        del dyt  # freed before the next run's copy is made, not when the name is bound again


def _fp8_capable(device: torch.device) -> None:
    """FP8 tensor cores: sm_89 (Ada) or newer on a GPU; the CPU runs the reference or the interpreter."""
    if device.type == "cuda" and _capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise RuntimeError(f"recipe: FP8 grouped GEMMs need FP8 tensor cores (compute capability 8.9 or newer); "
                           f"{device} ({name}) has {_capability(device)}")


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    """A CUDA device's compute capability, kept: every FP8 product asks (reading the device's properties
    costs tens of microseconds of host time a call)."""
    return torch.cuda.get_device_capability(device)


def resolve_recipe(recipe: str | Recipe | None, *operands: object) -> Recipe:
    """The GEMM recipe: ``recipe``, or that of the first QuantizedTensor operand.

    ``"mxfp8"`` by name rounds its scales up (``mx_rounding="rceil"``), as NVIDIA's MXFP8 training
    recipes do: OCP's floor rounding clips the largest values of a fifth of random blocks, which costs
    about 2 dB of SQNR; pass ``dropless.Recipe("mxfp8", 32)`` for the OCP scales.
    """
    quantized = [q for q in operands if isinstance(q, QuantizedTensor)]
    if recipe is None:
        if not quantized:
            raise ValueError("recipe must be given unless an operand is a QuantizedTensor")
        recipe = quantized[0].recipe
        if recipe.name == "block128x128":
            recipe = get_recipe("block128", pow2=recipe.pow2)
    elif recipe == "mxfp8":
        recipe = get_recipe("mxfp8", mx_rounding="rceil")
    resolved = get_recipe(recipe)
    operand_recipes(resolved)  # a GEMM recipe, or a ValueError naming it
    return resolved


def check_quantized_operand(name: str, q: QuantizedTensor, recipe: Recipe, expected: Recipe, ndim: int,
                            dim: int, grouped: bool) -> None:
    """``q`` is a valid FP8 operand quantized with ``expected``'s recipe along ``dim`` (per group if
    ``grouped``); errors name the argument."""
    check_quantized(name, q)
    if q.data.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(q.data.shape)}")
    if q.recipe.name != expected.name:
        raise ValueError(f"{name} was quantized with recipe {q.recipe.name!r}, but the {recipe.name!r} GEMM "
                         f"needs {expected.name!r} here")
    if q.dim != dim or (q.offsets is not None) != grouped:
        where = "along the tokens, per group (offsets)" if grouped else f"along dim {dim}"
        raise ValueError(f"{name} must be quantized {where}; it was quantized along dim {q.dim}"
                         f"{' per group' if q.offsets is not None else ''}")


def fp8_grouped_mm(x: torch.Tensor | QuantizedTensor, w: torch.Tensor | QuantizedTensor, offsets: torch.Tensor,
                   recipe: Recipe, w_quantized: tuple[QuantizedTensor, QuantizedTensor] | None = None,
                   main_grad: torch.Tensor | None = None, accumulate: torch.Tensor | None = None,
                   tail: bool = True) -> torch.Tensor:
    """``grouped_mm`` in FP8 (``offsets`` already resolved and checked against M).

    x: ``[M, K]`` bf16/fp16/fp32, or a QuantizedTensor along K; w: ``[E, K, N]`` (any strides), or a
    QuantizedTensor along K. Plain tensors are differentiable (x, and w or ``main_grad``); with a
    quantized operand the call is a forward product only. ``w_quantized``: ``quantize_weight(w)``'s
    pair, reused instead of quantizing w again. ``tail=False``: rows past ``offsets[-1]`` of y (and of x's
    gradient) are left unwritten.
    """
    act, weights = operand_recipes(recipe)
    _fp8_capable(x.device)
    out_dtype = x.dtype if isinstance(x, torch.Tensor) else torch.bfloat16
    if isinstance(x, QuantizedTensor) or isinstance(w, QuantizedTensor):
        if isinstance(x, QuantizedTensor):
            check_quantized_operand("x", x, recipe, act, 2, 1, grouped=False)
        else:
            x = quantize(x.detach(), act, dim=1)
        if isinstance(w, QuantizedTensor):
            check_quantized_operand("w", w, recipe, weights, 3, 1, grouped=False)
            wk = w
        else:
            wk = w_quantized[0] if w_quantized is not None else quantize_weight(w.detach(), weights)[0]
        if wk.shape[1] != x.shape[1]:
            raise ValueError(f"w must have shape [E, K={x.shape[1]}, N] to match x [M, K], got {tuple(wk.shape)}")
        return quantized_mm(x, wk, offsets, recipe, out_dtype, tail)
    if w_quantized is None:
        # Quantization is not differentiated through: the product's backward gives w its gradient.
        w_quantized = quantize_weight(w.detach(), weights)
    else:
        check_weight_pair(w_quantized, w, recipe, weights)
    wk, wn = w_quantized
    return Fp8GroupedMM.apply(x, w, offsets, wk.data, wk.scale, wn.data, wn.scale, recipe, main_grad, accumulate,
                              None, None, None, None, tail)


def check_weight_pair(pair: object, w: torch.Tensor, recipe: Recipe, weights: Recipe) -> None:
    """``pair`` is ``quantize_weight(w)``'s ``(along K, along N)`` for a weight of w's shape."""
    if not (isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(q, QuantizedTensor) for q in pair)):
        raise TypeError("w_quantized must be the (along K, along N) pair of QuantizedTensors that "
                        f"dropless.quantize_weight returns, got {type(pair).__name__}")
    for name, q, dim in (("w_quantized[0]", pair[0], 1), ("w_quantized[1]", pair[1], 2)):
        check_quantized_operand(name, q, recipe, weights, 3, dim, grouped=False)
        if q.shape != w.shape:
            raise ValueError(f"{name} must have w's shape {tuple(w.shape)}, got {tuple(q.shape)}")


def fp8_grouped_mm_wgrad(x: torch.Tensor | QuantizedTensor, dy: torch.Tensor | QuantizedTensor,
                         offsets: torch.Tensor, recipe: Recipe, out: torch.Tensor | None,
                         flags: torch.Tensor | None, accumulate: bool) -> torch.Tensor:
    """``grouped_mm_wgrad`` in FP8: x ``[M, K]`` and dy ``[M, N]`` quantized along the tokens per group
    (or given so); ``out`` and the accumulation as in the BF16 op. A new result is bf16 (x's dtype
    for a plain x)."""
    act, _ = operand_recipes(recipe)
    _fp8_capable(x.device)
    out_dtype = x.dtype if isinstance(x, torch.Tensor) else torch.bfloat16
    operands = []
    for name, t in (("x", x), ("dy", dy)):
        if isinstance(t, QuantizedTensor):
            check_quantized_operand(name, t, recipe, act, 2, 0, grouped=True)
            operands.append(t)
        else:
            operands.append(quantize(t.detach(), act, dim=0, offsets=offsets))
    return quantized_wgrad(operands[0], operands[1], offsets, recipe, out, flags, accumulate, out_dtype)
