"""The bridges: one framework's autograd around the other framework's kernels, zero-copy.

``pallas_for_torch``: torch tensors through ``jax_kl``'s Pallas kernels (``torch_kl``'s backend
``"pallas"``); ``triton_for_jax``: JAX arrays through ``torch_kl``'s Triton kernels (``jax_kl``'s
backend ``"triton"``). A bridge depends on both frameworks and neither framework depends on the
other: each registry imports its bridge from here when the backend is resolved. Each bridge calls
the other framework's one driver entry (``torch_kl.driver.forward``, ``jax_kl.driver.forward``:
the same signature) with the gradients the caller needs (``fused_kl.options.Needs``).
"""

from fused_kl._version import __version__

__all__ = ["__version__"]
