"""Host metrics in the Prometheus text exposition format (hand-written, no dependency).

One :class:`Metrics` per app (``HostState.metrics``), so tests never share
counters. Labels never carry principals, action ids or inputs. Tenant names and
crew ids appear only on the usage counters (``tokens_total``, ``cost_total``):
both are closed sets fixed by ``host.toml`` and the crews file, so the
exposition stays bounded; the usage counters show each tenant's usage to
whoever may read ``/metrics`` (docs/security.md "Security", metrics labels).

Metrics (all prefixed ``aip_host_``):

| name | type | labels |
|---|---|---|
| ``requests_total`` | counter | route (path template), method, status (class) |
| ``request_duration_seconds`` | summary (sum, count) | route, method |
| ``ready`` | gauge | (1 while the host is ready: a sidecar agrees, ARCHITECTURE.md §7) |
| ``unauthenticated_body_bytes`` | gauge | (bytes of request bodies held before authentication: the budget's use, docs/security.md "Security") |
| ``sidecar_ready`` | gauge | sidecar (its configured name; 1 while that sidecar agrees) |
| ``readiness_checks_total`` | counter | result (ready, unready) |
| ``auth_failures_total`` | counter | |
| ``fence_decisions_total`` | counter | fence, decision (incremented by the fences) |
| ``stream_errors_total`` | counter | code |
| ``actions_total`` | counter | operation, status |
| ``tokens_total`` | counter | tenant, crew, kind (prompt, completion, total, cached, requests): tokens of crew operations' final results |
| ``cost_total`` | counter | tenant, crew, currency: their cost in currency units (priced crews only, docs/observing.md "Observing actions") |
| ``webhook_attempts_total`` | counter | outcome (delivered, http_error, timeout, connect_error, refused, endpoint_removed; docs/webhooks.md) |
| ``webhook_deliveries_total`` | counter | outcome (delivered, expired): deliveries that ended |
| ``status_cache_total`` | counter | result (hit, miss): key-less ``:status`` reads answered from the host's cache of final job views, or asking the sidecar (not counted while the cache is disabled) |

Every label value comes from a closed set, never from request bytes (an
anonymous client sending made-up methods must not grow the exposition): the
route is a path template of the app or ``unmatched``, the method one of
:data:`~aip_crewai.plumbing.asgi.KNOWN_METHODS` or ``other``, the status its class (``2xx`` … ``5xx``).
:meth:`Metrics.observe_request` applies these rules.

Source: ARCHITECTURE.md §6 (``/metrics``: Prometheus text); docs/security.md "Security" (metrics labels).
"""

from __future__ import annotations

from ..plumbing.asgi import method_label
from ..plumbing.prometheus import CONTENT_TYPE, Counter, Gauge, Summary, _Family

__all__ = ["CONTENT_TYPE", "Metrics", "status_label"]


def status_label(status: int) -> str:
    """The status class: ``1xx`` … ``5xx`` (``other`` outside 100..599)."""
    return f"{status // 100}xx" if 100 <= status <= 599 else "other"


class Metrics:
    """The host's metric families (see the module table)."""

    def __init__(self) -> None:
        p = "aip_host_"
        self.requests = Counter(
            p + "requests_total", "HTTP requests by route template, method and status.", ("route", "method", "status")
        )
        self.request_duration = Summary(
            p + "request_duration_seconds", "HTTP request handling time, seconds.", ("route", "method")
        )
        self.unauthenticated_body_bytes = Gauge(
            p + "unauthenticated_body_bytes", "Bytes of request bodies held before authentication (the budget's use)."
        )
        self.ready = Gauge(p + "ready", "1 while the host is ready (a sidecar's health agrees), else 0.")
        self.sidecar_ready = Gauge(
            p + "sidecar_ready", "1 while this sidecar's health agrees with the configuration, else 0.", ("sidecar",)
        )
        self.readiness_checks = Counter(p + "readiness_checks_total", "Sidecar health checks by result.", ("result",))
        self.auth_failures = Counter(p + "auth_failures_total", "Requests refused as unauthenticated.")
        self.fence_decisions = Counter(
            p + "fence_decisions_total", "Fence decisions by fence and decision.", ("fence", "decision")
        )
        self.stream_errors = Counter(p + "stream_errors_total", "Sidecar stream failures by error code.", ("code",))
        self.actions = Counter(p + "actions_total", "Actions reaching a status, by operation.", ("operation", "status"))
        self.tokens = Counter(
            p + "tokens_total",
            "Model tokens (and requests) of crew operations' final results, by tenant, crew and kind.",
            ("tenant", "crew", "kind"),
        )
        self.cost = Counter(
            p + "cost_total", "Cost of crew operations' final results, currency units.", ("tenant", "crew", "currency")
        )
        self.status_cache = Counter(
            p + "status_cache_total",
            "Key-less status reads by result of the final-view cache (hit, miss).",
            ("result",),
        )
        self.webhook_attempts = Counter(
            p + "webhook_attempts_total",
            "Webhook delivery attempts by outcome (delivered, http_error, timeout, connect_error, refused, "
            "endpoint_removed).",
            ("outcome",),
        )
        self.webhook_deliveries = Counter(
            p + "webhook_deliveries_total", "Webhook deliveries ended, by outcome (delivered, expired).", ("outcome",)
        )
        self.ready.set(0)

    def observe_request(self, route: str | None, method: str, status: int, duration_s: float) -> None:
        """Count one HTTP request (labels from closed sets only, see the module docstring).

        Args:
            route: the matched route's path template, or None (``unmatched``).
            method: the raw request method (any other than :data:`~aip_crewai.plumbing.asgi.KNOWN_METHODS` is ``other``).
            status: the response status code.
            duration_s: handling time, seconds.
        """
        route_label, method_name = route or "unmatched", method_label(method)
        self.requests.inc(route=route_label, method=method_name, status=status_label(status))
        self.request_duration.observe(duration_s, route=route_label, method=method_name)

    def families(self) -> list[_Family]:
        """Every family of this instance, in the order defined (each attribute that is one: a family added to
        ``__init__`` is exposed without being listed again; the webhook counters were left out of a list)."""
        return [value for value in vars(self).values() if isinstance(value, _Family)]

    def render(self) -> str:
        """The whole exposition, text format 0.0.4."""
        lines: list[str] = []
        for family in self.families():
            lines += family.render()
        return "\n".join(lines) + "\n"
