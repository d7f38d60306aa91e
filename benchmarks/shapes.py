"""LM heads ``[V, H]`` of real models, by name: what ``python -m benchmarks.bench --heads`` takes.

A head is named after a model that has it (several models share some heads); ``--heads`` also
takes any ``HxV``. The quick heads are tiny, for a smoke test on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    """An LM head: hidden size ``h`` and vocabulary ``v``; ``name`` labels the rows and plots."""

    name: str
    h: int
    v: int
    models: str = ""

    @property
    def size(self) -> str:
        return f"{self.h}x{self.v}"

    @property
    def label(self) -> str:
        return self.size if self.name == self.size else f"{self.name} ({self.size})"


SHAPES = {
    s.name: s
    for s in (
        Shape("llama3-8b", 4096, 128256, "Llama 3, 3.1 8B"),
        Shape("llama3-70b", 8192, 128256, "Llama 3, 3.1 70B"),
        Shape("llama2", 4096, 32000, "Llama 2 7B, Mistral 7B v0.1"),
        Shape("tinyllama", 2048, 32000, "TinyLlama 1.1B"),
        Shape("qwen2.5-7b", 3584, 152064, "Qwen2.5 7B"),
        Shape("gemma2-2b", 2304, 256000, "Gemma 2 2B"),
        Shape("quick-64", 64, 512, "smoke test"),
        Shape("quick-32", 32, 256, "smoke test"),
    )
}
DEFAULT = ("llama3-8b", "llama2")
QUICK = ("quick-64", "quick-32")


def parse_head(text: str) -> Shape:
    """A head by name (``llama3-8b``) or as ``HxV`` (``4096x128256``)."""
    if text in SHAPES:
        return SHAPES[text]
    h, sep, v = text.lower().partition("x")
    if not (sep and h.isdigit() and v.isdigit() and int(h) > 0 and int(v) > 0):
        raise ValueError(f"--heads: expected a name ({', '.join(SHAPES)}) or HxV such as 4096x128256, got {text!r}")
    named = [s for s in SHAPES.values() if (s.h, s.v) == (int(h), int(v))]
    return named[0] if named else Shape(text.lower(), int(h), int(v))
