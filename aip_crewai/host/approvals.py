"""Approval routes: the queue, one approval with its input snapshot, and the
one decision.

Only approvers (or operators, for reading) of the approval's own tenant see
it; another tenant's approval does not exist (404). The decider is the
authenticated principal, never a body field; the requester may not decide.

Source: DESIGN.md §7 (approval fence, decision request and answers).
"""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..contracts.aip import ApprovalDecision, ApprovalRequest, DecisionRequest
from ..contracts.errors import (
    ApprovalAlreadyDecided,
    ApprovalNotFound,
    Forbidden,
    InvalidEnvelope,
)
from .actions import ActionService
from .auth import Principal, authenticate
from .routes_actions import aip_json
from .store import ApprovalRecord, ms_to_rfc3339

EVIDENCE = ["reason", "input_snapshot", "policy_decision"]
_decision_decoder = msgspec.json.Decoder(DecisionRequest)


def _can_read(principal: Principal) -> None:
    if not (principal.has_role("approver") or principal.has_role("operator")):
        raise Forbidden("reading approvals needs the approver or operator role")


def render(approval: ApprovalRecord, now_ms: int, *, with_snapshot: bool) -> ApprovalRequest:
    """An ApprovalRequest view of a stored approval."""
    decision = None
    if approval.status in ("approved", "denied") and approval.decided_by and approval.decided_at is not None:
        decision = ApprovalDecision(approval_id=approval.approval_id, decision=approval.status,  # type: ignore[arg-type]
                                    reason=approval.decision_reason or "", decided_by=approval.decided_by,
                                    decided_at=ms_to_rfc3339(approval.decided_at))
    return ApprovalRequest(
        approval_id=approval.approval_id, action_id=approval.action_id, capability_id=approval.capability_id,
        tenant=approval.tenant, requested_by=approval.requested_by, policy_hash=approval.policy_hash,
        status=approval.effective_status(now_ms),  # type: ignore[arg-type]
        created_at=ms_to_rfc3339(approval.created_at), expires_at=ms_to_rfc3339(approval.expires_at),
        evidence_requirements=EVIDENCE,
        input_snapshot=msgspec.json.decode(approval.input_snapshot_json) if with_snapshot else None,
        decision=decision,
    )


async def list_approvals(request: Request) -> Response:
    """``GET /aip/v1/approvals?status=pending&cursor=...&limit=N``: one page."""
    principal = await authenticate(request)
    _can_read(principal)
    service: ActionService = request.app.state.actions
    status = request.query_params.get("status")
    if status is not None and status not in ("pending", "approved", "denied", "expired"):
        raise InvalidEnvelope("status must be pending, approved, denied or expired")
    limit_text = request.query_params.get("limit", "100")
    if not limit_text.isdigit() or not 1 <= int(limit_text) <= 200:
        raise InvalidEnvelope("limit must be an integer 1..200")
    now = service.now_ms()
    await service.store.expire_approvals(now)
    page = await service.store.list_approvals(principal.tenant, status=status,
                                              cursor=request.query_params.get("cursor"), limit=int(limit_text))
    return aip_json({"approvals": [render(a, now, with_snapshot=False) for a in page.items],
                     "next_cursor": page.next_cursor, "done": page.done})


async def _approval(request: Request, principal: Principal) -> ApprovalRecord:
    service: ActionService = request.app.state.actions
    approval = await service.store.get_approval(principal.tenant, request.path_params["approval_id"])
    if approval is None:
        raise ApprovalNotFound()
    return approval


async def get_approval(request: Request) -> Response:
    """``GET /aip/v1/approvals/{id}``: the approval with its input snapshot."""
    principal = await authenticate(request)
    _can_read(principal)
    approval = await _approval(request, principal)
    return aip_json(render(approval, request.app.state.actions.now_ms(), with_snapshot=True))


async def post_decision(request: Request) -> Response:
    """``POST /aip/v1/approvals/{id}/decision`` → 200 ApprovalDecision; 403 for a
    non-approver or the requester; 404 another tenant's; 409 decided/expired."""
    principal = await authenticate(request)
    body = await request.body()
    try:
        decision = _decision_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise InvalidEnvelope(f"invalid decision: {exc}") from exc
    approval = await _approval(request, principal)
    if not principal.has_role("approver"):
        raise Forbidden("deciding needs the approver role")
    if approval.requested_by == principal.id:
        raise Forbidden("the requester may not decide its own approval")
    if decision.approval_id is not None and decision.approval_id != approval.approval_id:
        raise InvalidEnvelope("approval_id in the body differs from the path")
    service: ActionService = request.app.state.actions
    now = service.now_ms()
    decided = await service.decide(principal, approval.approval_id, decision.decision, decision.reason, now)
    if decided is None:
        raise ApprovalAlreadyDecided(details={"approval_id": approval.approval_id})
    return aip_json(ApprovalDecision(approval_id=decided.approval_id, decision=decision.decision,
                                     reason=decision.reason, decided_by=principal.id,
                                     decided_at=ms_to_rfc3339(now)))


def routes() -> list[Route]:
    """The approval routes, mounted by the host app."""
    return [
        Route("/aip/v1/approvals", list_approvals, methods=["GET"]),
        Route("/aip/v1/approvals/{approval_id:str}", get_approval, methods=["GET"]),
        Route("/aip/v1/approvals/{approval_id:str}/decision", post_decision, methods=["POST"]),
    ]
