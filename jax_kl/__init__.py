"""Fused LM head + distillation loss for JAX: Pallas kernels, chunked, gradient in the forward pass."""

from fused_kl._version import __version__

from .api import fused_linear_cross_entropy, fused_linear_kl_div

__all__ = ["__version__", "fused_linear_cross_entropy", "fused_linear_kl_div"]
