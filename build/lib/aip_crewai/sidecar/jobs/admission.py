"""Admission checks of ``POST /jobs`` in the order of ARCHITECTURE.md §4 (pure: no I/O).

:func:`check_request` runs every check that needs no journal, in order, and
raises the first failure:

1. operation not enabled → 403 (an unparsable body, or an operation that is
   none of the ten, → 422 first, as the reference sidecar answers);
2. missing/blank ``Idempotency-Key`` → 428; over 512 bytes or with control
   characters → 400;
3. request or operation input invalid → 422;
4. unknown crew → 404;
5. encoded input over 1 MiB → 413.

The runtime then checks the journal: same action id with another request hash
→ 409 (same hash: the existing record), replay task not retained → 422,
retained runs at the limit or journal full → 507, write failure → 507.

Source: ARCHITECTURE.md §3 (inputs), §4 (admission order and statuses).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import msgspec

from aip_crewai.contracts.errors import InvalidInput
from aip_crewai.contracts.hashing import request_hash
from aip_crewai.contracts.inputs import (
    MAX_INPUT_BYTES,
    convert_input,
    encoded_size,
    has_control_characters,
    invalid_input,
)
from aip_crewai.contracts.operations import OPERATIONS, OperationSpec
from aip_crewai.contracts.sidecar import DEFAULT_TIMEOUT_MS, MAX_IDEMPOTENCY_KEY_BYTES, JobRequest
from aip_crewai.sidecar.errors import (
    BadRequest,
    CrewNotFound,
    IdempotencyKeyInvalid,
    IdempotencyKeyMissing,
    InvalidJobRequest,
    OperationNotEnabled,
    RequestTooLarge,
)

#: Bound on a whole request body, bytes. Larger bodies are refused with 413
#: before parsing (the only case where 413 precedes the checks above); up to
#: this size an over-1-MiB input still gets the earlier statuses first.
MAX_BODY_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class Admission:
    """A request that passed every journal-free check.

    ``input`` is the validated operation input as decoded JSON (what the
    executor receives); ``timeout_ms`` the effective execution bound,
    milliseconds; ``request_hash`` the ARCHITECTURE.md §4 admission hash.
    """

    crew_id: str
    action_id: str
    operation: str
    spec: OperationSpec
    input: dict[str, Any]
    requested_timeout_ms: int | None
    idempotency_key: str
    request_hash: str
    input_bytes: int

    @property
    def timeout_ms(self) -> int:
        return self.requested_timeout_ms or DEFAULT_TIMEOUT_MS


def check_request(
    body: bytes,
    *,
    idempotency_key: str | None,
    header_action_id: str | None,
    allowed_operations: Collection[str],
    crews: Collection[str],
) -> Admission:
    """Validate a ``POST /jobs`` body and headers in ARCHITECTURE.md §4 order.

    Args:
        body: the raw request body (JSON object).
        idempotency_key: the ``Idempotency-Key`` header, or None.
        header_action_id: ``X-AIP-Action-ID`` if sent; must equal the body's.
        allowed_operations: startable operations enabled on this sidecar.
        crews: registered crew ids.

    Returns:
        The :class:`Admission`.

    Raises:
        InvalidJobRequest (422; also an unknown operation name), OperationNotEnabled (403),
        IdempotencyKeyMissing (428), IdempotencyKeyInvalid (400),
        BadRequest (400, header/body action id mismatch), CrewNotFound (404),
        RequestTooLarge (413).
    """
    try:
        payload = msgspec.json.decode(body)
    except msgspec.DecodeError:
        raise InvalidJobRequest("the request body is not valid JSON") from None
    except RecursionError:  # msgspec's nesting bound (about 1000 levels)
        raise InvalidJobRequest("the request body is nested too deeply") from None
    if not isinstance(payload, dict):
        raise InvalidJobRequest("the request body must be a JSON object")
    operation = payload.get("operation", "run")
    if not isinstance(operation, str) or operation not in OPERATIONS:  # as the reference: 422, not 403
        shown = operation[:64] if isinstance(operation, str) else type(operation).__name__
        raise InvalidJobRequest(
            f"unknown operation {shown!r}; operations: {', '.join(OPERATIONS)}",
            details={"field": "$.operation", "rule": "one of the ten operations"},
        )
    if operation not in allowed_operations:
        raise OperationNotEnabled(f"operation {operation!r} is not enabled on this sidecar")
    key = check_idempotency_key(idempotency_key)
    try:
        request = msgspec.convert(payload, JobRequest, strict=True)
    except msgspec.ValidationError as exc:
        error = invalid_input(exc)
        raise InvalidJobRequest(
            f"invalid job request at {error.field}: {error.rule}", details={"field": error.field, "rule": error.rule}
        ) from None
    if header_action_id is not None and header_action_id != request.action_id:
        raise BadRequest("the X-AIP-Action-ID header does not match the body's action_id")
    spec = OPERATIONS[operation]
    validate_input(spec.input_type, request.input)
    if request.crew_id not in crews:
        raise CrewNotFound(f"unknown crew {request.crew_id!r}")
    size = encoded_size(request.input)
    if size > MAX_INPUT_BYTES:
        raise RequestTooLarge(f"the encoded input is {size} bytes; at most {MAX_INPUT_BYTES} bytes")
    return Admission(
        crew_id=request.crew_id,
        action_id=request.action_id,
        operation=operation,
        spec=spec,
        input=request.input,
        requested_timeout_ms=request.timeout_ms,
        idempotency_key=key,
        request_hash=request_hash(
            crew_id=request.crew_id,
            action_id=request.action_id,
            operation=operation,
            input=request.input,
            timeout_ms=request.timeout_ms,
            idempotency_key=key,
        ),
        input_bytes=size,
    )


def check_idempotency_key(value: str | None) -> str:
    """Return the key, or raise 428 (missing/blank) or 400 (too long, control chars).

    Source: ARCHITECTURE.md §4, §7 (at most 512 bytes, no control characters).
    """
    if value is None or not value.strip():
        raise IdempotencyKeyMissing()
    if len(value.encode("utf-8", "surrogateescape")) > MAX_IDEMPOTENCY_KEY_BYTES or has_control_characters(value):
        raise IdempotencyKeyInvalid()
    return value


def validate_input(input_type: Any, value: Any) -> None:
    """Check ``value`` against an operation input type, without the size bound
    (ARCHITECTURE.md §4 wants 422 and 404 before 413: the size is checked later).

    Raises:
        InvalidJobRequest: with ``details`` ``{field, rule}`` (JSON path, rule).
    """
    try:
        convert_input(input_type, value, check_size=False)
    except InvalidInput as exc:
        raise InvalidJobRequest(exc.message, details={"field": exc.field, "rule": exc.rule}) from None
