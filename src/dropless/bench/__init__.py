"""Benchmarks of dropless against its peers, run as ``python -m dropless.bench <command>``.

``gemm`` times the grouped GEMM (forward, data gradient, weight gradient, forward+backward) against a
dense GEMM of the same FLOPs, a Python loop of ``F.linear``, ``torch._grouped_mm`` and a
capacity-padded ``bmm``, all on the same inputs in one run, and writes a JSON file, a PNG plot and a
table. ``ep`` (under ``torchrun``) times expert parallelism: dispatch and combine bandwidth per rank
against NCCL ``all_to_all_single``, and the expert-parallel layer against the same per-GPU work on
one GPU (its weak-scaling efficiency). ``jax`` times ``dropless.jax.ragged_dot`` the same way against
``jax.lax.ragged_dot``, the PyTorch op and a dense jnp matmul in one process (the one command that
loads JAX). ``readme`` regenerates the README's performance table from result files.

Every figure is TFLOP/s of useful FLOPs (``2*M*K*N`` per pass, ``6*M*K*N`` for fwd+bwd, padding
never counted) and its ratio to the dense GEMM timed in the same run. Before a case is timed its
results are checked against an fp32 reference; ``max_rel_err`` is the relative Frobenius error
``||out - ref||_F / ||ref||_F`` (the largest over the pass's results), and a case above the dtype's
tolerance (2e-2 for bf16) is reported as failed, with no speed.
"""
