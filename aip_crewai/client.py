"""Tenant-side Python client of the host's AIP API (used by the CLI, the
demo and the tests).

Authenticates with a bearer token, or with an Ed25519 private key: every
request is signed as an HTTP Message Signature (RFC 9421, :mod:`aip_crewai.plumbing.httpsig`:
method, authority, path, query and the body's Content-Digest, a fresh nonce),
and an action envelope is signed too (RFC 8785 canonical envelope without
``security.signature``). Streaming calls yield ``(event, envelope)`` pairs as
they arrive.

Source: docs/reference/http-api.md "AIP 1.0 conformance" (routes, envelopes, shapes).
"""

from __future__ import annotations

import base64
import json
import secrets
import time
from collections.abc import Callable, Generator, Iterator
from datetime import datetime, timezone
from typing import Any

import httpx2
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from .contracts.aip import CONTENT_TYPE
from .contracts.hashing import jcs
from .contracts.inputs import path_segment
from .contracts.sidecar import MAX_OUTPUT_BYTES
from .plumbing import httpsig
from .sse import SSEDecoder

#: Largest SSE frame the client reads, bytes: the host's largest is a ``result`` envelope carrying an
#: operation output of up to ``MAX_OUTPUT_BYTES`` (4 MiB) plus the envelope, so twice that leaves room.
MAX_FRAME_BYTES = 2 * MAX_OUTPUT_BYTES


class AipClientError(Exception):
    """The host answered with an AIP error (``status``, ``code``, ``body``): the
    body is an ``aip.core.v1.error`` envelope, ``{"body": {"error": {"error": ProtocolError}}}``.

    Any other body (``code`` ``unknown``) means ``url`` is probably not the host: the message says
    so in one line and names the flag that fixes it (:func:`foreign_answer`).
    """

    def __init__(self, status: int, body: Any, *, url: str | None = None) -> None:
        self.status = status
        self.body = body
        inner = body.get("body") if isinstance(body, dict) else None
        error = (inner.get("error") or {}).get("error") if isinstance(inner, dict) else None
        if isinstance(error, dict):
            self.code = str(error.get("code"))
            super().__init__(f"{status} {self.code}: {error.get('message')}")
        else:
            self.code = "unknown"
            super().__init__(foreign_answer(status, body, url))


#: What fixes a client pointed at something other than the host (docs/reference/cli.md).
HOST_URL_FIX = "give the host's URL (its `bind` in host.toml) with --url or AIP_CREWAI_HOST_URL"


def foreign_answer(status: int, body: Any, url: str | None) -> str:
    """One readable line for an answer that is not an AIP envelope (pure).

    Args:
        status: the HTTP status.
        body: the decoded JSON body, or the text when it was not JSON.
        url: the base URL asked (``http://127.0.0.1:8090``), None when unknown.

    Returns:
        ``401 from URL: this looks like the aip-crewai sidecar ...`` for the sidecar's error body
        (``{"detail": "..."}``, ARCHITECTURE.md §4), else ``... is not an AIP answer ...``; both end
        with :data:`HOST_URL_FIX`. The body is shown as JSON, at most 120 characters, on one line.
    """
    where = f"{status} from {url}" if url else str(status)
    if isinstance(body, dict) and set(body) == {"detail"} and isinstance(body["detail"], str):
        said = json.dumps(body)[:120]
        return f"{where}: this looks like the aip-crewai sidecar (it answered {said}), not the host; {HOST_URL_FIX}"
    shown = json.dumps(body)
    shown = shown if len(shown) <= 120 else shown[:119] + "…"
    return f"{where}: not an AIP answer ({shown}), so this is probably not the aip-crewai host; {HOST_URL_FIX}"


def _base_url(response: httpx2.Response) -> str | None:
    """``scheme://host:port`` of the request ``response`` answers (None without one)."""
    try:
        url = response.request.url
    except RuntimeError:
        return None
    return f"{url.scheme}://{url.netloc.decode('ascii', 'replace')}"


def _segment(value: str) -> str:
    """An id as one URL path segment, percent-encoded (action ids may hold ``?``, ``#``, ``%``, or be ``..``)."""
    return path_segment(value)


def new_id(prefix: str) -> str:
    """A random id such as ``act_3f2a…``."""
    return f"{prefix}_{secrets.token_hex(8)}"


def now_rfc3339() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def sign_envelope(envelope: dict[str, Any], key: Ed25519PrivateKey, key_id: str) -> dict[str, Any]:
    """Return ``envelope`` with ``security`` set and signed (ARCHITECTURE.md §7)."""
    unsigned = {**envelope, "security": {"scheme": "ed25519", "key_id": key_id}}
    signature = key.sign(jcs(unsigned))
    text = base64.urlsafe_b64encode(signature).rstrip(b"=").decode()
    return {**unsigned, "security": {**unsigned["security"], "signature": text}}


class RequestSigner(httpx2.Auth):
    """httpx auth that signs every request (RFC 9421, this package's profile).

    Args:
        key / key_id: the Ed25519 private key and the principal id it belongs to.
        clock: epoch seconds (the ``created`` parameter).
    """

    requires_request_body = True

    def __init__(self, key: Ed25519PrivateKey, key_id: str, *, clock: Callable[[], float] = time.time) -> None:
        self.key, self.key_id, self.clock = key, key_id, clock

    def auth_flow(self, request: httpx2.Request) -> Generator[httpx2.Request, httpx2.Response, None]:
        headers = httpsig.sign_request(
            request.method, str(request.url), request.content, self.key, self.key_id, created=int(self.clock())
        )
        request.headers.update(headers)
        yield request


class AipClient:
    """Synchronous client of one host.

    Args:
        base_url: e.g. ``http://127.0.0.1:8081``.
        token: bearer token of the principal, or None when signing.
        signing_key / key_id: Ed25519 private key and principal id: every request
            is signed (RFC 9421) and so is every action envelope.
        timeout_s: read timeout, seconds (None: no read timeout, for long streams).

    Raises:
        ValueError: ``signing_key`` without ``key_id`` (nothing would say whose key it is).
    """

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        signing_key: Ed25519PrivateKey | None = None,
        key_id: str | None = None,
        timeout_s: float | None = 660.0,
        transport: httpx2.BaseTransport | None = None,
    ) -> None:
        if signing_key is not None and not key_id:
            raise ValueError("a signing key needs its key id (the principal id)")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        auth = RequestSigner(signing_key, key_id) if signing_key is not None and key_id else None
        self.http = httpx2.Client(
            base_url=base_url,
            headers=headers,
            transport=transport,
            auth=auth,
            timeout=httpx2.Timeout(timeout_s, connect=10.0),
            follow_redirects=False,
        )
        self.signing_key = signing_key
        self.key_id = key_id

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> AipClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check(self, response: httpx2.Response) -> dict[str, Any]:
        """The JSON object of a successful answer.

        Raises:
            AipClientError: a status of 400 or more, or a success whose body is not a JSON object.
        """
        try:
            body = response.json()
        except ValueError:
            body = response.text
        if response.status_code >= 400 or not isinstance(body, dict):
            raise AipClientError(response.status_code, body, url=_base_url(response))
        return body

    def envelope(
        self,
        capability_id: str,
        input: dict[str, Any],
        *,
        action_id: str | None = None,
        idempotency_key: str | None = None,
        timeout_ms: int | None = None,
        mode: str | None = None,
    ) -> dict[str, Any]:
        """Build (and sign, when a key is set) an ``aip.core.v1.action`` envelope
        (``mode``: ``sync`` | ``async`` | ``streaming``, or None for the host's default, sync)."""
        action: dict[str, Any] = {"id": action_id or new_id("act"), "capability_id": capability_id, "input": input}
        if idempotency_key is not None:
            action["idempotency_key"] = idempotency_key
        if timeout_ms is not None:
            action["timeout_ms"] = timeout_ms
        if mode is not None:
            action["mode"] = mode
        env = {
            "aip_version": "1.0",
            "message_type": "aip.core.v1.action",
            "message_id": new_id("msg"),
            "sent_at": now_rfc3339(),
            "body": {"action": action},
        }
        if self.signing_key is not None and self.key_id is not None:
            env = sign_envelope(env, self.signing_key, self.key_id)
        return env

    def call(self, capability_id: str, input: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        """POST an action and wait for its ``action_result`` envelope (or an
        ``ack`` envelope: ``mode="async"``, or a call still running after the host's wait)."""
        env = self.envelope(capability_id, input, **kwargs)
        response = self.http.post("/aip/v1/messages", content=json.dumps(env), headers={"Content-Type": CONTENT_TYPE})
        return self._check(response)

    def stream(self, capability_id: str, input: dict[str, Any], **kwargs: Any) -> Iterator[tuple[str, dict[str, Any]]]:
        """POST an action with ``Accept: text/event-stream``; yield (event, envelope)."""
        env = self.envelope(capability_id, input, **kwargs)
        headers = {"Content-Type": CONTENT_TYPE, "Accept": "text/event-stream"}
        with self.http.stream("POST", "/aip/v1/messages", content=json.dumps(env), headers=headers) as response:
            yield from self._events(response)

    def follow(self, action_id: str, *, last_event_id: str | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
        """Follow an action's AIP stream from the host store (resumable)."""
        headers = {"Accept": "text/event-stream"}
        if last_event_id:
            headers["Last-Event-ID"] = last_event_id
        with self.http.stream("GET", f"/aip/v1/actions/{_segment(action_id)}/events", headers=headers) as response:
            yield from self._events(response)

    def _events(self, response: httpx2.Response) -> Iterator[tuple[str, dict[str, Any]]]:
        if response.status_code >= 400:
            response.read()
            self._check(response)
        decoder = SSEDecoder(max_frame_bytes=MAX_FRAME_BYTES)
        for piece in response.iter_bytes():
            for event in decoder.feed(piece):
                value = json.loads(event.data)
                value["_sse_id"] = event.id
                yield event.event, value
        decoder.close()

    def manifest(self) -> dict[str, Any]:
        return self._check(self.http.get("/aip/v1/manifest"))

    def action(self, action_id: str) -> dict[str, Any]:
        return self._check(self.http.get(f"/aip/v1/actions/{_segment(action_id)}"))

    def result(self, action_id: str) -> dict[str, Any]:
        return self._check(self.http.get(f"/aip/v1/actions/{_segment(action_id)}/result"))

    def chunks(self, action_id: str, cursor: int = 0) -> dict[str, Any]:
        return self._check(self.http.get(f"/aip/v1/actions/{_segment(action_id)}/chunks", params={"cursor": cursor}))

    def cancel(self, action_id: str) -> dict[str, Any]:
        return self._check(self.http.post(f"/aip/v1/actions/{_segment(action_id)}/cancel"))

    def approvals(self, status: str | None = "pending", cursor: str | None = None) -> dict[str, Any]:
        params = {k: v for k, v in {"status": status, "cursor": cursor}.items() if v}
        return self._check(self.http.get("/aip/v1/approvals", params=params))

    def usage(self, *, from_: str | None = None, to: str | None = None) -> dict[str, Any]:
        """``GET /aip/v1/usage``: the tenant's usage per crew (operator role)."""
        return self._check(
            self.http.get("/aip/v1/usage", params={k: v for k, v in {"from": from_, "to": to}.items() if v})
        )

    def webhook_deliveries(self, **query: str | int | None) -> dict[str, Any]:
        """``GET /aip/v1/webhooks/deliveries``: one page of the tenant's webhook deliveries (operator role);
        ``query``: ``endpoint``, ``event_type``, ``status``, ``action_id``, ``cursor``, ``limit`` (None: unset)."""
        params = {k: str(v) for k, v in query.items() if v is not None}
        return self._check(self.http.get("/aip/v1/webhooks/deliveries", params=params))

    def approval(self, approval_id: str) -> dict[str, Any]:
        return self._check(self.http.get(f"/aip/v1/approvals/{_segment(approval_id)}"))

    def decide(self, approval_id: str, decision: str, reason: str, *, policy_hash: str | None = None) -> dict[str, Any]:
        """Decide an approval. With a signing key the body names the approval's
        ``policy_hash`` (read from the approval when not given), so the stored
        signature proves which policy was decided."""
        if policy_hash is None and self.signing_key is not None:
            policy_hash = self.approval(approval_id)["request"]["policy_hash"]
        body: dict[str, Any] = {"decision": decision, "reason": reason}
        if policy_hash is not None:
            body["policy_hash"] = policy_hash
        return self._check(self.http.post(f"/aip/v1/approvals/{_segment(approval_id)}/decision", json=body))

    def approval_events(self, *, last_event_id: str | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
        """Follow the tenant's approval events (``GET /aip/v1/approvals/events``):
        yields ``(event, data)``, ``data["_sse_id"]`` the position (None for the
        snapshot of pending approvals sent first on a fresh connection)."""
        headers = {"Accept": "text/event-stream"}
        if last_event_id:
            headers["Last-Event-ID"] = last_event_id
        with self.http.stream("GET", "/aip/v1/approvals/events", headers=headers) as response:
            yield from self._events(response)

    def stream_token(self, action_id: str | None = None) -> dict[str, Any]:
        """Mint a stream token (``{stream_token, expires_at, stream_url}``) for one
        action's events, or for the approval stream when ``action_id`` is None."""
        path = f"/aip/v1/actions/{_segment(action_id)}/stream-token" if action_id else "/aip/v1/approvals/stream-token"
        return self._check(self.http.post(path))

    def ready_now(self) -> bool:
        """One ``/ready`` probe: True on 200; False on any other status or a transport error."""
        try:
            return self.http.get("/ready").status_code == 200
        except httpx2.TransportError:
            return False

    def wait_ready(self, deadline_s: float = 60.0) -> None:
        """Poll ``/ready`` until 200 or the deadline (seconds) passes; raises ``TimeoutError``."""
        end = time.monotonic() + deadline_s
        while not self.ready_now():
            if time.monotonic() > end:
                raise TimeoutError("the host did not become ready")
            time.sleep(0.2)
