"""Triton kernels: plain functions of tensors, no autograd, arguments checked by ``dropless.ops``."""
