"""Fused LM head + distillation loss for JAX: Pallas kernels, chunked, gradient in the forward pass."""

from .api import fused_linear_cross_entropy, fused_linear_kl_div

__all__ = ["fused_linear_cross_entropy", "fused_linear_kl_div"]
