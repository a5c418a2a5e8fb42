"""The routes of what results leave: a receipt (``GET /aip/v1/receipts/{id}``), the published receipt keys
(``GET /.well-known/aip-receipt-keys``), a tenant's usage totals (``GET /aip/v1/usage``), and the receipt
chain of an action or approval view (:func:`receipt_chain`). Thin handlers: the store reads, :mod:`.usage`
renders.

Source: docs/observing.md "Observing actions".
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ...contracts.aip import Principal as PrincipalView
from ...contracts.aip import Receipt, ReceiptChain
from ...contracts.errors import Forbidden, InvalidRange, ReceiptNotFound
from ..http.authenticate import authenticate
from ..http.state import host_state
from ..store.records import UsageTotal, ms_to_rfc3339, rfc3339_to_ms
from ..store.store import Store
from .sealer import chain_hash
from .usage import TOKEN_KINDS, amount

#: The host as the actor of the receipts it signs.
HOST_ACTOR = PrincipalView(id="system:aip-crewai-host", kind="system", display_name="aip-crewai host")
#: ``GET /aip/v1/usage`` without ``to``: up to this far past now, ms (results finish at most now).
_FUTURE_MS = 1


async def receipt_chain(store: Store, tenant: str, action_id: str, chain_id: str) -> ReceiptChain:
    """The chain of ``action_id``'s receipts (``result_returned``, each with its signed document as
    ``data``), ``chain_id`` naming it (the action or approval id)."""
    receipts: list[Receipt] = []
    for text in await store.receipts_of_action(tenant, action_id):
        document = json.loads(text)
        receipts.append(
            Receipt(
                id=document["receipt"]["id"],
                receipt_type="result_returned",
                actor=HOST_ACTOR,
                occurred_at=document["receipt"]["finished_at"],
                data=document,
                hash=document["hash"],
                previous_hash=receipts[-1].hash if receipts else None,
            )
        )
    return ReceiptChain(chain_id=chain_id, receipts=receipts, root_hash=chain_hash([r.hash or "" for r in receipts]))


def include_receipts(request: Request) -> bool:
    """Whether a view was asked for its receipt chain (``?include_receipts=true``, AIP's flag)."""
    return request.query_params.get("include_receipts") in ("true", "1")


async def get_receipt(request: Request) -> Response:
    """``GET /aip/v1/receipts/{id}``: the receipt document, byte for byte as signed (any principal of its
    tenant); 404 ``receipt.not_found`` for another tenant's or an unknown id."""
    principal = await authenticate(request)
    document = await host_state(request).store.get_receipt(principal.tenant, request.path_params["receipt_id"])
    if document is None:
        raise ReceiptNotFound(details={"receipt_id": request.path_params["receipt_id"]})
    return Response(document.encode("utf-8"), media_type="application/json")


async def get_receipt_keys(request: Request) -> Response:
    """``GET /.well-known/aip-receipt-keys``: the receipt public keys (no authentication: they are public);
    ``{"keys": []}`` when the host signs no receipts."""
    keys = host_state(request).settings.receipt_keys
    body = keys.published() if keys is not None else {"keys": []}
    return Response(msgspec.json.encode(body), media_type="application/json")


def _bound(request: Request, name: str, default: int) -> int:
    text = request.query_params.get(name)
    if text is None:
        return default
    try:
        return rfc3339_to_ms(text)
    except ValueError:
        raise InvalidRange(f"{name} is not an RFC 3339 timestamp", details={"parameter": name}) from None


def usage_report(tenant: str, from_ms: int, to_ms: int, totals: list[UsageTotal]) -> dict[str, Any]:
    """The body of ``GET /aip/v1/usage`` (pure): per crew and currency, then the tenant's totals.

    Shape: ``{"tenant", "from", "to", "crews": [{"crew_id", "actions", "tokens": {prompt, completion,
    total, cached, requests}, "latency_ms", "cost": {"amount", "currency"} | null}], "totals": {"actions",
    "tokens", "cost": [{"amount", "currency"}]}}``; ``latency_ms`` sums the actions' latencies.
    """
    crews = []
    sums = [0] * len(TOKEN_KINDS)
    costs: dict[str, int] = {}
    actions = 0
    for row in totals:
        counts = (row.prompt, row.completion, row.total, row.cached, row.requests)
        sums = [a + b for a, b in zip(sums, counts, strict=True)]
        actions += row.actions
        cost = None
        if row.cost_picos is not None and row.currency is not None:
            costs[row.currency] = costs.get(row.currency, 0) + row.cost_picos
            cost = {"amount": amount(row.cost_picos), "currency": row.currency}
        crews.append(
            {
                "crew_id": row.crew_id,
                "actions": row.actions,
                "tokens": dict(zip(TOKEN_KINDS, counts, strict=True)),
                "latency_ms": row.latency_ms,
                "cost": cost,
            }
        )
    return {
        "tenant": tenant,
        "from": ms_to_rfc3339(from_ms),
        "to": ms_to_rfc3339(to_ms),
        "crews": crews,
        "totals": {
            "actions": actions,
            "tokens": dict(zip(TOKEN_KINDS, sums, strict=True)),
            "cost": [{"amount": amount(v), "currency": c} for c, v in sorted(costs.items())],
        },
    }


async def get_usage(request: Request) -> Response:
    """``GET /aip/v1/usage?from=&to=``: the caller's tenant's usage of crew operations whose results were
    stored in ``[from, to)`` (RFC 3339; default: from the start, to now), per crew; operators only (403
    otherwise), 400 ``request.invalid_range`` for a bad bound or ``from`` not before ``to``."""
    principal = await authenticate(request)
    if not principal.has_role("operator"):
        raise Forbidden("usage is for the tenant's operators")
    store: Store = host_state(request).store
    to_ms = _bound(request, "to", store.now_ms() + _FUTURE_MS)
    from_ms = _bound(request, "from", 0)
    if from_ms >= to_ms:
        raise InvalidRange(details={"from": from_ms, "to": to_ms})
    totals = await store.usage_totals(principal.tenant, from_ms, to_ms)
    return Response(
        msgspec.json.encode(usage_report(principal.tenant, from_ms, to_ms, totals)), media_type="application/json"
    )


def routes() -> list[Route]:
    """The receipt, key and usage routes, mounted by the host app."""
    return [
        Route("/aip/v1/receipts/{receipt_id:str}", get_receipt, methods=["GET"]),
        Route("/aip/v1/usage", get_usage, methods=["GET"]),
        Route("/.well-known/aip-receipt-keys", get_receipt_keys, methods=["GET"]),
    ]
