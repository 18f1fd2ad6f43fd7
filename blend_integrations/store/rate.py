"""Store layer: a measured rate (bytes per second, token-layers per second),
kept up to date."""

from __future__ import annotations

import threading


class Rate:
    """Exponentially weighted mean of ``amount / seconds`` over real operations.

        Amounts and seconds are averaged separately and divided, so a large
        operation weighs more than a small one whose fixed costs dominate. Until
        the first measurement the rate is ``initial`` (None: unknown); the first
        measurement replaces it, each later one moves the means by ``weight``.
    Callers check ``initial`` (ChunkStore's ``read_bandwidth``).
    """

    def __init__(self, initial: float | None = None, *, weight: float = 0.25) -> None:
        self.initial = initial
        self.weight = weight
        self.samples = 0
        self._amount = 0.0
        self._seconds = 0.0
        self._lock = threading.Lock()

    def add(self, amount: float, seconds: float) -> None:
        if amount <= 0 or seconds <= 0:
            return  # nothing measured
        with self._lock:
            w = 1.0 if self.samples == 0 else self.weight
            self._amount += w * (amount - self._amount)
            self._seconds += w * (seconds - self._seconds)
            self.samples += 1

    @property
    def value(self) -> float | None:
        """The current rate per second, or None if unknown."""
        with self._lock:
            return self._amount / self._seconds if self.samples else self.initial

    def __repr__(self) -> str:
        v = self.value
        return f"Rate({'unknown' if v is None else f'{v:.4g}/s'}, samples={self.samples})"
