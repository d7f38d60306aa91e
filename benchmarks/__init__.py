"""The benchmark and diagnostics of fused-kl; not part of the library.

``python -m benchmarks.bench`` (from the repository root) times every implementation against
the GEMM floor; ``benchmarks.interleave`` compares a few in interleaved rounds; ``benchmarks.scaling``
times the several-device layouts; ``benchmarks.distill_hf`` times a distillation step of Hugging Face
models per loss; ``benchmarks.diagnose`` prices the row kernels and the chunk size; ``benchmarks.diagnose_jax``,
``jax_kl``'s in-place ``grad_weight`` GEMM against XLA's add;
``benchmarks.results`` makes RESULTS.md's tables and plot from ``results.csv``.
"""
