"""Fused LM head + KL divergence loss for PyTorch (Triton kernel, chunked, gradient in forward)."""

from .api import fused_linear_kl_div
from .module import FusedLinearKLDivLoss

__all__ = ["FusedLinearKLDivLoss", "fused_linear_kl_div"]
