"""Fused LM head + KL divergence loss for JAX (Pallas kernel, chunked, gradient in forward)."""

from .api import fused_linear_kl_div

__all__ = ["fused_linear_kl_div"]
