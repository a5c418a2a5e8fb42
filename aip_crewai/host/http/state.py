"""The host app's shared state: one typed, frozen object handed to every handler.

:class:`HostSetup` is what :func:`~.app.create_app` builds without I/O; :class:`HostState` adds what the
lifespan opens (the store, the sidecar clients, readiness, the action service) and exists from the
lifespan's start to its end. Handlers take it with :func:`host_state`; nothing reads loose
``app.state`` attributes. Rule: STYLE "Folders and gates"; ARCHITECTURE.md §2.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from starlette.applications import Starlette
from starlette.requests import HTTPConnection

from ...plumbing.asgi import BodyBudget
from ..actions.service import ActionService
from ..auth.principals import Authenticator
from ..crews.descriptors import CrewDescriptor
from ..crews.manifest import CapabilityIndex
from ..metrics import Metrics
from ..settings import PrincipalConfig, Settings
from ..sidecars.connection import SidecarHttp
from ..sidecars.readiness import ReadinessGroup
from ..store.store import Store

__all__ = ["HostSetup", "HostState", "host_setup", "host_state", "record_startup_error", "startup_error"]


@dataclass(frozen=True)
class HostSetup:
    """What the app holds before its lifespan runs (no I/O to build)."""

    settings: Settings
    #: Epoch seconds (injectable: tests pass a fake clock).
    clock: Callable[[], float]
    metrics: Metrics
    #: crew id -> admitted descriptor, in file order.
    crews: Mapping[str, CrewDescriptor]
    #: principal id -> configuration.
    principals: Mapping[str, PrincipalConfig]
    capabilities: CapabilityIndex
    authenticator: Authenticator
    #: Set at SIGTERM/SIGINT by ``host.main``: open streams end, blocking waits answer (:mod:`.stopping`).
    stopping: asyncio.Event
    #: The HMAC key of stream tokens, one per process (docs/reference/http-api.md "Stream tokens").
    stream_token_key: bytes
    #: The budget of request bodies read before authentication (docs/security.md "Security").
    body_budget: BodyBudget


@dataclass(frozen=True)
class HostState(HostSetup):
    """:class:`HostSetup` plus what the lifespan opened; the handlers' one view of the app."""

    store: Store
    #: The first sidecar's connection (the only one of a single-sidecar host).
    http: SidecarHttp
    #: sidecar name -> its connection (``[[sidecars]]``).
    sidecar_http: Mapping[str, SidecarHttp]
    readiness: ReadinessGroup
    actions: ActionService

    @classmethod
    def started(cls, setup: HostSetup, **opened: Any) -> HostState:
        """``setup``'s fields plus the lifespan's ``opened`` ones (TypeError when one is missing)."""
        return cls(**{f.name: getattr(setup, f.name) for f in fields(HostSetup)}, **opened)


def _app(holder: HTTPConnection | Starlette) -> Starlette:
    return holder.app if isinstance(holder, HTTPConnection) else holder


def host_setup(holder: HTTPConnection | Starlette) -> HostSetup:
    """The app's :class:`HostSetup` (of a request, or of the app itself)."""
    setup = _app(holder).state.setup
    assert isinstance(setup, HostSetup)
    return setup


def host_state(holder: HTTPConnection | Starlette) -> HostState:
    """The app's :class:`HostState` (of a request, or of the app itself).

    Raises:
        RuntimeError: the lifespan has not started (or has ended): nothing is open.
    """
    state = getattr(_app(holder).state, "host", None)
    if not isinstance(state, HostState):
        raise RuntimeError("the host app is not running (its lifespan builds HostState)")
    return state


def record_startup_error(app: Starlette, exc: BaseException) -> None:
    """Keep the error that failed the lifespan's start, for ``host.main`` to report (exit 2)."""
    app.state.startup_error = exc


def startup_error(app: Starlette) -> BaseException | None:
    """The error :func:`record_startup_error` kept, or None."""
    error = getattr(app.state, "startup_error", None)
    return error if isinstance(error, BaseException) else None
