"""The one metrics helper of both processes: Prometheus text exposition.

Counter, gauge and summary families keyed by label values, rendered in the
text format version 0.0.4; label values are escaped by
:func:`escape_label_value`. Each process declares its own families (host:
``host/metrics.py``; sidecar: ``sidecar/http/metrics.py``).

Source: docs/ARCHITECTURE.md §2 (metrics on both processes).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def escape_label_value(value: str) -> str:
    """A label value in the exposition format (backslash, newline and quote escaped)."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _format_value(value: float) -> str:
    if value != value:  # NaN
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "+Inf" if value > 0 else "-Inf"
    return str(int(value)) if float(value).is_integer() else repr(float(value))


class _Family:
    kind = "untyped"

    def __init__(self, name: str, help_text: str, labelnames: Iterable[str] = ()) -> None:
        self.name = name
        self.help = help_text
        self.labelnames = tuple(labelnames)
        self._values: dict[tuple[str, ...], float] = {}
        self._lock = threading.Lock()

    def _key(self, labels: dict[str, str]) -> tuple[str, ...]:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {tuple(labels)}")
        return tuple(str(labels[name]) for name in self.labelnames)

    def value(self, **labels: str) -> float:
        """Current value of one label set (0 when never touched)."""
        return self._values.get(self._key(labels), 0.0)

    def _series(self) -> list[tuple[str, tuple[str, ...], float]]:
        with self._lock:
            return [("", key, value) for key, value in sorted(self._values.items())]

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        for suffix, key, value in self._series():
            labels = ",".join(
                f'{name}="{escape_label_value(v)}"' for name, v in zip(self.labelnames, key, strict=False)
            )
            lines.append(
                f"{self.name}{suffix}{{{labels}}} {_format_value(value)}"
                if labels
                else f"{self.name}{suffix} {_format_value(value)}"
            )
        return lines


class Counter(_Family):
    """Monotonic counter: ``inc(amount=1, **labels)``."""

    kind = "counter"

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount


class Gauge(_Family):
    """Gauge: ``set(value, **labels)``."""

    kind = "gauge"

    def set(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = float(value)


class Summary(_Family):
    """Summary without quantiles: ``<name>_sum`` and ``<name>_count``."""

    kind = "summary"

    def __init__(self, name: str, help_text: str, labelnames: Iterable[str] = ()) -> None:
        super().__init__(name, help_text, labelnames)
        self._counts: dict[tuple[str, ...], float] = {}

    def observe(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + value
            self._counts[key] = self._counts.get(key, 0.0) + 1

    def count(self, **labels: str) -> float:
        return self._counts.get(self._key(labels), 0.0)

    def _series(self) -> list[tuple[str, tuple[str, ...], float]]:
        with self._lock:
            series = []
            for key in sorted(self._values):
                series += [("_sum", key, self._values[key]), ("_count", key, self._counts[key])]
            return series
