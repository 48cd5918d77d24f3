"""Integrations with other libraries; each imports its library only when called."""

from dropless.integrations.huggingface import experts_forward, register_transformers

__all__ = ["experts_forward", "register_transformers"]
