"""How the host reaches one sidecar: its base URL, its bearer, and the connection pools its requests go to.

:class:`SidecarHttp` is owned by the host lifespan (one per sidecar) and used by
:class:`~aip_crewai.host.sidecars.client.SidecarClient`, the one boundary where transport failures and
sidecar statuses become connector errors. Every request carries :func:`sidecar_headers`.

Three pools per sidecar (ARCHITECTURE.md §8, the sidecar client's pools):
- ``job_transport`` (httpx2): the requests that run a job (a run's stream, a blocking start);
- ``transport`` (httpx2): the other short requests (cancels), and every request when a test hands in a
  transport or the sidecar is reached through a proxy;
- ``reads`` (:class:`SidecarReads`, aiohttp): the read-only JSON ``GET`` requests (a job's status, an
  events page) of a sidecar reached directly. aiohttp's C parser answers such a request on loopback for
  a quarter to a third of httpx2's CPU and half its latency (bench/results/HISTORY.md, session 38). Its
  failures are raised as the httpx2 exceptions the client already maps.

Source: ARCHITECTURE.md §7 and §8.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx2
import yarl

from ... import package_version

#: The ``User-Agent`` of every request the host sends a sidecar (its job requests and health probes): a
#: sidecar's access log, or a proxy in front of an https sidecar, can tell the host's requests apart.
USER_AGENT = f"aip-crewai-host/{package_version()}"


def sidecar_headers(token: str | None) -> tuple[tuple[str, str], ...]:
    """The headers of every request to a sidecar (jobs and health probes): :data:`USER_AGENT` and, with a
    ``token``, its bearer."""
    return (("User-Agent", USER_AGENT), *((("Authorization", f"Bearer {token}"),) if token is not None else ()))


class ResponseTooLarge(Exception):
    """A read's body grew past its bound (``status``: the sidecar's HTTP status)."""

    def __init__(self, status: int) -> None:
        super().__init__(f"response of status {status} over its bound")
        self.status = status


def _cancel_requested() -> bool:
    """Whether the running task itself was asked to stop (``Task.cancelling()``, Python 3.11 and later).
    On Python 3.10, which cannot tell, always True: a cancellation is never taken for anything else."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return cancelling is None or cancelling() > 0


class SidecarReads:
    """The read-only JSON ``GET`` requests of one sidecar, on an aiohttp session of their own.

    The session is made at the first request (inside the running event loop) and closed by
    :meth:`aclose`. It sends no cookie, follows no redirect, reads no proxy or CA variable of the
    environment, and sends only the sidecar's headers and the request's (no ``Accept`` or ``Accept-Encoding``
    of its own).
    An https sidecar's certificate is checked as httpx2 checks it (``verify``). Its pool:
    ``limits.max_connections`` connections, an idle one reused for ``limits.keepalive_expiry``
    seconds at most, as the httpx2 pool of short requests.
    """

    def __init__(
        self,
        base_url: httpx2.URL,
        headers: tuple[tuple[str, str], ...],
        *,
        limits: httpx2.Limits,
        connect_timeout_s: float,
        verify: ssl.SSLContext | bool,
    ) -> None:
        # the request's URL as SidecarHttp.request builds it: the origin, the base's raw path (ending with /)
        # and the route's (nothing of the base's query or fragment)
        self._origin = f"{base_url.scheme}://{base_url.netloc.decode('ascii')}"
        self._prefix = base_url.raw_path.decode("ascii").partition("?")[0]
        self._headers = dict(headers)
        self._limits = limits
        self._connect_timeout_s = connect_timeout_s
        # the very context httpx2's pools check an https sidecar against (its CA bundle, or the private CA)
        self._ssl = httpx2.create_ssl_context(verify, trust_env=False) if base_url.scheme == "https" else True
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    def _open(self) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(
            limit=self._limits.max_connections or 0,
            keepalive_timeout=self._limits.keepalive_expiry or 0,
            ssl=self._ssl,
            resolver=aiohttp.ThreadedResolver(),  # getaddrinfo, as httpx2 resolves
        )
        session = aiohttp.ClientSession(
            connector=connector,
            cookie_jar=aiohttp.DummyCookieJar(),
            trust_env=False,
            skip_auto_headers=("Accept", "Accept-Encoding"),
        )
        # No second try of a GET whose connection broke (aiohttp's own retry of an idempotent request; one of
        # its ClientSession.ATTRS): as on httpx2, a request is sent once, so a failure after it may have
        # reached the sidecar is never reported as ``not_sent`` (a refused retry would be).
        session._retry_connection = False
        return session

    async def get(
        self,
        path: str,
        *,
        headers: Mapping[str, str],
        params: dict[str, Any] | None,
        read_timeout_s: float,
        limit: int,
        on_head: Callable[[], None],
    ) -> tuple[int, bytes]:
        """``GET`` ``path`` (relative to the base URL, percent-encoded as httpx2 does) with the sidecar's
        headers and ``headers`` → ``(status, body)``.

        ``read_timeout_s`` bounds the wait for a pooled connection (with the connect) and each read, seconds;
        the connect alone is bounded by the sidecar's connect bound. ``on_head`` is called once the status
        line and headers arrived.

        Raises: ``httpx2.ConnectError`` or ``httpx2.ConnectTimeout`` (nothing reached the sidecar: no
        connection, or none within the bound, or the pools are closed, also while the read waited for one
        of their connections: on Python 3.10, which cannot tell that from the task's own cancellation, such
        a read raises ``asyncio.CancelledError``),
        ``httpx2.ReadTimeout``, ``httpx2.ReadError`` (any other transport failure), :class:`ResponseTooLarge`
        (the body grew past ``limit`` bytes)."""
        if self._closed:
            raise httpx2.ConnectError("the sidecar's connections are closed")
        if self._session is None:
            self._session = self._open()
        target = httpx2.URL(path, params=params).raw_path.decode("ascii").lstrip("/")
        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=read_timeout_s,  # aiohttp's: the pool's wait and the connect together
            sock_connect=self._connect_timeout_s,
            sock_read=read_timeout_s,
        )
        failure: httpx2.HTTPError
        try:
            async with self._session.get(
                yarl.URL(self._origin + self._prefix + target, encoded=True),
                headers={**self._headers, **headers},
                allow_redirects=False,
                timeout=timeout,
            ) as response:
                on_head()
                body = bytearray()
                async for piece in response.content.iter_any():
                    body += piece
                    if len(body) > limit:
                        raise ResponseTooLarge(response.status)
                return response.status, bytes(body)
        # Each failure is raised after the except block, so that the aiohttp exception, whose request_info
        # holds the bearer, is neither its cause nor its context.
        except aiohttp.ConnectionTimeoutError as exc:  # the pool's wait or the connect
            failure = httpx2.ConnectTimeout(str(exc))
        except aiohttp.ClientConnectorError as exc:  # refused, unresolved, TLS refused: no connection
            failure = httpx2.ConnectError(str(exc))
        except aiohttp.ServerTimeoutError as exc:
            failure = httpx2.ReadTimeout(str(exc))
        except aiohttp.ClientError as exc:
            failure = httpx2.ReadError(f"{type(exc).__name__}: {exc}")
        except asyncio.CancelledError:
            if not self._closed or _cancel_requested():
                raise
            # aiohttp's connector cancels the requests waiting for one of its connections (or for an address)
            # when it closes; the task itself was not cancelled: the read waited, nothing was sent
            failure = httpx2.ConnectError("the sidecar's connections were closed while the read waited for one")
        raise failure

    async def aclose(self) -> None:
        """Close the session's connections; a later request raises ``httpx2.ConnectError`` (not sent)."""
        self._closed = True
        session, self._session = self._session, None
        if session is not None:
            await session.close()


@dataclass(frozen=True)
class SidecarHttp:
    """How the host reaches one sidecar: its base URL, the bearer every request carries, and the
    pools the requests go to (the module's docstring).

    Requests of the httpx2 pools are built here and handed to the transport itself (httpx's transport
    API, ``handle_async_request``) instead of an ``httpx2.AsyncClient``: the client's layers (URL
    merging, auth and redirect flows, cookies, default headers) cost the host's hop about
    0.2 ms of CPU per request (bench/results/HISTORY.md, session 23). Nothing the host relied
    on lives there: it follows no redirect and sends no cookie. Its requests no longer carry
    httpx's ``Accept: */*``, ``Accept-Encoding`` and ``Connection: keep-alive`` (HTTP/1.1 keeps
    the connection anyway; an answer compressed regardless is still decoded). The transport maps transport failures
    to ``httpx`` exceptions as the client did.

    Two httpx2 connection pools: ``job_transport`` for the requests that run a job (a run's stream, a blocking
    start: open as long as the job) and ``transport`` for short ones, so a status read or a cancel never
    waits for a connection behind jobs holding every one of theirs (a host running more jobs than its job
    connections). ``reads``: the aiohttp pool of status reads and events pages, None when every request
    goes to ``transport`` (a transport handed in, or a proxy).

    Fields: ``base_url`` ends with ``/``; ``headers``: :func:`sidecar_headers` (nothing else);
    ``connect_timeout_s``: the connect bound of every request, seconds (reads are bounded per
    request). Source: ARCHITECTURE.md §8 (the sidecar client).
    """

    base_url: httpx2.URL
    headers: tuple[tuple[str, str], ...] = field(repr=False)  # the bearer: never in a repr, a log or an error
    transport: httpx2.AsyncBaseTransport
    connect_timeout_s: float
    job_transport: httpx2.AsyncBaseTransport
    reads: SidecarReads | None = field(default=None, repr=False)

    @classmethod
    def of(
        cls,
        url: str,
        *,
        token: str | None = None,
        transport: httpx2.AsyncBaseTransport | None = None,
        connect_timeout_s: float = 10.0,
        limits: httpx2.Limits | None = None,
        job_limits: httpx2.Limits | None = None,
        proxy: str | None = None,
        verify: ssl.SSLContext | bool = True,
    ) -> SidecarHttp:
        """The sidecar at ``url`` (its path, if any, prefixes every route) with bearer ``token``;
        ``transport`` (tests: every request) or two new ``httpx2.AsyncHTTPTransport(trust_env=False)``
        pools, ``limits`` for short requests and ``job_limits`` for those that run a job, both through the
        explicit ``proxy``, https checked against ``verify`` (the environment's proxies and CA variables are
        not read), and without a proxy the :class:`SidecarReads` pool of its reads (``limits`` too).

        Raises: ValueError (no ``transport`` and a pool's limits missing)."""
        base = httpx2.URL(url)
        if not base.raw_path.endswith(b"/"):
            base = base.copy_with(raw_path=base.raw_path + b"/")
        short: httpx2.AsyncBaseTransport
        jobs: httpx2.AsyncBaseTransport
        headers, reads = sidecar_headers(token), None
        if transport is None:
            if limits is None or job_limits is None:
                raise ValueError("a sidecar's pools need their limits (limits, job_limits)")
            short = httpx2.AsyncHTTPTransport(trust_env=False, limits=limits, proxy=proxy, verify=verify)
            jobs = httpx2.AsyncHTTPTransport(trust_env=False, limits=job_limits, proxy=proxy, verify=verify)
            if proxy is None:
                reads = SidecarReads(base, headers, limits=limits, connect_timeout_s=connect_timeout_s, verify=verify)
        else:
            short = jobs = transport
        return cls(base, headers, short, connect_timeout_s, jobs, reads)

    def request(
        self,
        method: str,
        path: str,
        *,
        headers: dict[str, str],
        json: Any = None,
        params: dict[str, Any] | None = None,
        read_timeout_s: float | None = None,
    ) -> httpx2.Request:
        """A request for ``path`` (relative to :attr:`base_url`, percent-encoded as httpx does) with
        the bearer, ``headers`` and an optional JSON body; ``read_timeout_s`` bounds reading, writing
        and waiting for a pooled connection (None: unbounded, e.g. a stream's own silence bound)."""
        relative = httpx2.URL(path)
        url = self.base_url.copy_with(raw_path=self.base_url.raw_path + relative.raw_path.lstrip(b"/"))
        timeout = httpx2.Timeout(read_timeout_s, connect=self.connect_timeout_s)
        return httpx2.Request(
            method,
            url,
            params=params,
            headers=[*self.headers, *headers.items()],
            json=json,
            extensions={"timeout": timeout.as_dict()},
        )

    async def aclose(self) -> None:
        """Close every pool's connections."""
        await self.transport.aclose()
        if self.job_transport is not self.transport:
            await self.job_transport.aclose()
        if self.reads is not None:
            await self.reads.aclose()
