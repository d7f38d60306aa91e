"""What the backend registries of both frameworks share: the signature of a backend's compute
entry, and the names a resolved backend takes from its registry entry."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# ``compute(x, weight, bias, teacher, labels, row_weight, loss, run, layout, needs, backend)``
# (torch's also takes ``ready=``): ``(loss, row_losses, grad_x, grad_weight, grad_bias)``, the
# gradients None where ``needs`` leaves them out. Each driver's ``forward`` is one, each bridge another.
Compute = Callable[..., tuple]


class NamedByEntry:
    """A resolved backend (a frozen dataclass with a field ``entry``, its registry entry): its
    ``name``, what it ``runs`` in words, and whether it runs on a ``single_device`` only."""

    entry: Any

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def runs(self) -> str:
        return self.entry.runs

    @property
    def single_device(self) -> bool:
        return self.entry.single_device
