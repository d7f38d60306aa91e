"""Framework-neutral core shared by ``torch_kl`` and ``jax_kl``.

It holds what must be identical in both frameworks: the argument contract and its
error messages (``contract``), the chunk plan and the reduction scale (``plan``), the
DLPack bridge between the two (``bridge``), and the command line (``cli``). Nothing here
imports torch or JAX at module level.
"""
