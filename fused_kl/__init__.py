"""The framework-free core shared by ``torch_kl`` and ``jax_kl``.

It holds what must be identical in both frameworks: the loss description (``loss``), the run
options (``options``), the argument checks and their error messages (``checks``,
``value_checks``), what a resolved backend is named by and computes (``backend``), the chunk
plan (``plan``), the per-row columns the phases hand each other (``rows``), the shared
elementwise terms (``terms``) and per-row math (``rowmath``), the phase sequence of one chunk
(``chunk``), the plain backends' whole-row phases (``wholerow``), and the float64 reference
(``reference``). Nothing here imports torch or JAX at module level. The command line lives in
``fused_kl_cli``, the benchmark in ``benchmarks``.
"""

from ._version import __version__

__all__ = ["__version__"]
