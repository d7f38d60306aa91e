"""The benchmark and diagnostics of fused-kl; not part of the library.

``python -m benchmarks.bench`` (from the repository root) times every implementation against
the GEMM floor; ``benchmarks/diagnose.py`` holds the GPU diagnostics behind ``RESULTS-2026-12-01.md``.
"""
