"""Fused LM head + distillation loss for PyTorch: Triton kernels, chunked, gradient in the forward pass."""

from .api import fused_linear_cross_entropy, fused_linear_kl_div
from .module import FusedLinearCrossEntropyLoss, FusedLinearJSDLoss, FusedLinearKLDivLoss

__all__ = [
    "FusedLinearCrossEntropyLoss",
    "FusedLinearJSDLoss",
    "FusedLinearKLDivLoss",
    "fused_linear_cross_entropy",
    "fused_linear_kl_div",
]
