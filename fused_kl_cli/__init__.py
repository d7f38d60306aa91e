"""The ``fused-kl`` command line, kept out of the library core: ``demo`` and ``check``.

``python -m fused_kl_cli demo|check`` or the ``fused-kl`` console script. Importing this package
(or ``fused_kl_cli.cli``) changes nothing in the process: the environment that Triton and JAX
read when they start is set by :func:`fused_kl_cli.cli.main`, right before a command runs.
The benchmark is ``python -m benchmarks.bench`` (from the repository root).
"""

from fused_kl._version import __version__

__all__ = ["__version__"]
