"""Fused LM head + distillation loss for PyTorch: Triton kernels, chunked, gradient in the forward pass."""

from fused_kl._version import __version__

from .api import fused_linear_cross_entropy, fused_linear_kl_div
from .module import FusedLinearCrossEntropyLoss, FusedLinearJSDLoss, FusedLinearKLDivLoss

__all__ = [
    "FusedLinearCrossEntropyLoss",
    "FusedLinearJSDLoss",
    "FusedLinearKLDivLoss",
    "__version__",
    "fused_linear_cross_entropy",
    "fused_linear_kl_div",
]
