"""Approval routes: the queue, one approval with its evidence payload, and the
one decision, in the AIP 1.0 shapes (ApprovalList, ApprovalRecordView,
ApprovalDecision).

Only approvers (or operators, for reading) of the approval's own tenant see
it; another tenant's approval does not exist (404). The decider is the
authenticated principal: a decision body naming another ``approver`` is
refused (403); the requester may not decide.

How a stored approval reads in AIP terms (:func:`render`):

| field | value |
|---|---|
| ``request.requester`` | the principal that submitted the action |
| ``request.subject`` | the crew that would do the work: ``{id: "crewai:<crew id>", kind: "agent"}`` |
| ``request.approver_selector`` | ``{type: "tenant_policy"}``: approvers of the tenant, not the requester |
| ``request.evidence`` | ``input_snapshot`` (hash of capability + input) and ``policy_decision`` (the policy hash) |
| ``status`` | ``pending`` / ``approved`` / ``denied`` / ``expired`` / ``withdrawn`` (the action was cancelled first) |
| ``decision`` | the approver's decision; for an expired approval, ``expired`` by the host (``kind: system``) |
| ``evidence_payload`` | the exact input, only on ``GET /aip/v1/approvals/{id}`` |
| ``request.evidence`` (more) | ``display_findings`` on ``GET /aip/v1/approvals/{id}`` when the input holds code points a person would misread (:mod:`aip_crewai.contracts.display`); its ``uri`` serves the list |
| ``request.reason`` | why it waits for a decision (:func:`approval_reason`); on ``GET /aip/v1/approvals/{id}`` it also says when the crew's own code may set or change the inputs, and names to approvers the inputs the request leaves out (:func:`~aip_crewai.host.crews.inputs.left_to_crew`) |

Principal kinds come from the principal id's prefix (``human:``, ``agent:``,
``svc:``/``service:``, ``system:``); any other id is a ``service``.

Source: AIP 1.0 schemas approval_list, approval_record_view,
approval_request, approval_decision; docs/approvals.md "The approval flow".
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ...contracts import display
from ...contracts import operations as ops
from ...contracts.aip import (
    ApprovalDecision,
    ApprovalEvidencePayload,
    ApprovalList,
    ApprovalRecordView,
    ApprovalRequest,
    ApproverSelector,
    DecisionRequest,
    EvidenceArtifact,
    Principal,
    PrincipalKind,
)
from ...contracts.errors import (
    AipError,
    ApprovalAlreadyDecided,
    ApprovalExpiredUndecidable,
    ApprovalNotFound,
    ApprovalPolicyMismatch,
    ApprovalWithdrawn,
    Forbidden,
    InvalidEnvelope,
    MessageTooLarge,
    ProofNotFound,
)
from ...contracts.inputs import plain_rule
from ...plumbing import httpsig
from ...plumbing.asgi import read_bounded
from ..actions.idempotency import fence_hash
from ..actions.lifecycle import ApprovalStatus
from ..actions.service import ActionService
from ..auth.principals import Principal as Caller
from ..auth.principals import can_read_approvals
from ..crews.inputs import left_to_crew
from ..crews.manifest import CapabilityIndex
from ..ledger.routes import include_receipts, receipt_chain
from ..store.store import ApprovalRecord, ms_to_rfc3339
from .authenticate import authenticate
from .limits import JSON_BODY, MAX_DECISION_BYTES
from .routes import aip_json
from .state import host_state

#: The host itself, as the principal that expires approvals.
HOST_PRINCIPAL = Principal(id="system:aip-crewai-host", kind="system", display_name="aip-crewai host")
_KIND_PREFIXES: tuple[tuple[str, PrincipalKind], ...] = (
    ("human:", "human"),
    ("agent:", "agent"),
    ("svc:", "service"),
    ("service:", "service"),
    ("system:", "system"),
)
_decision_decoder = msgspec.json.Decoder(DecisionRequest)
#: Evidence kind of a signed decision's proof.
PROOF_KIND = "http_message_signature"
#: Evidence kind of the display findings of an approval's input (docs/approvals.md "The approval flow").
DISPLAY_KIND = "display_findings"
#: Most names of inputs left to the crew that a reason lists, and most characters they take in all
#: (:func:`approval_reason`; the first name is always listed).
MAX_REASON_NAMES = 20
MAX_REASON_NAME_CHARS = 1_000


class DisplayFindings(msgspec.Struct, frozen=True):
    """``GET /aip/v1/approvals/{id}/display``: the code points of the approval's input a person would
    misread (bidi controls, invisible, control and space characters, look-alikes, mixed-script words),
    each with its JSON path, offset (code points), ``U+XXXX`` and kind (:class:`~aip_crewai.contracts.display.Finding`);
    ``truncated`` when more than :data:`~aip_crewai.contracts.display.MAX_FINDINGS` were found.
    ``input_hash`` is the approval's input snapshot hash, so a client knows which input they describe."""

    approval_id: str
    input_hash: str
    findings: list[display.Finding]
    truncated: bool = False


def display_findings(approval: ApprovalRecord) -> DisplayFindings:
    """The :class:`DisplayFindings` of an approval's input snapshot. Pure."""
    snapshot = msgspec.json.decode(approval.input_snapshot_json)
    found = display.findings(snapshot, limit=display.MAX_FINDINGS + 1)
    return DisplayFindings(
        approval_id=approval.approval_id,
        input_hash=fence_hash(approval.capability_id, snapshot),
        findings=found[: display.MAX_FINDINGS],
        truncated=len(found) > display.MAX_FINDINGS,
    )


def display_evidence(approval: ApprovalRecord, found: DisplayFindings) -> EvidenceArtifact:
    """The evidence artifact announcing an input's display findings: ``uri`` serves them, ``hash`` is the
    SHA-256 of that answer's JSON. Pure."""
    digest = hashlib.sha256(msgspec.json.encode(found)).hexdigest()
    return EvidenceArtifact(
        id=f"{approval.approval_id}:display",
        kind=DISPLAY_KIND,
        redacted=False,
        uri=f"/aip/v1/approvals/{approval.approval_id}/display",
        hash=f"sha256:{digest}",
    )


class DecisionProof(msgspec.Struct, frozen=True):
    """What proves a signed decision (``GET /aip/v1/approvals/{id}/proof``):
    the RFC 9421 ``signature`` (standard base64 of 64 bytes) by ``key_id``
    over ``signature_base``, whose ``content-digest`` line is the SHA-256 of
    ``body``, the decision body as sent (which names the ``policy_hash``).
    Anyone with the principal's public key re-verifies it offline."""

    scheme: str
    alg: str
    key_id: str
    created: int
    nonce: str
    signature_input: str
    signature_base: str
    signature: str
    body: str


def principal_view(principal_id: str) -> Principal:
    """The AIP Principal of a configured principal id (kind from its prefix, else ``service``). Pure."""
    kind: PrincipalKind = next((k for prefix, k in _KIND_PREFIXES if principal_id.startswith(prefix)), "service")
    return Principal(id=principal_id, kind=kind)


def approval_reason(capability_id: str, left: Sequence[str] | None = None) -> str:
    """``request.reason`` of an approval of ``capability_id``: why it waits for a decision and, when ``left``
    is not None (:func:`~aip_crewai.host.crews.inputs.left_to_crew`), that the crew's own code may set or
    change its inputs, naming those the request leaves out as a JSON array (escaped as the console and the
    CLI write the input: :func:`~aip_crewai.contracts.display.dumps`), at most :data:`MAX_REASON_NAMES` of
    them in :data:`MAX_REASON_NAME_CHARS`, then how many more. Pure; docs/approvals.md "Inputs the crew fills
    itself"."""
    reason = f"{capability_id} changes crew state; the tenant's policy requires an approver's decision"
    if left is None:
        return reason
    reason += (
        ". The crew's own code (its before_kickoff callbacks) receives the inputs when it runs and may set or "
        "change them, with values no approver sees"
    )
    if not left:
        return reason
    named: list[str] = []
    for name in left[:MAX_REASON_NAMES]:
        if named and len(display.dumps([*named, name], indent=None)) > MAX_REASON_NAME_CHARS:
            break
        named.append(name)
    more = f" and {len(left) - len(named)} more" if len(left) > len(named) else ""
    return f"{reason}; this request leaves out {display.dumps(named, indent=None)}{more}"


def _resolve(capability_id: str, crews: Mapping[str, Any]) -> tuple[str, str] | None:
    """``(crew id, operation)`` of an approval's capability among the configured ``crews``; None when its crew
    was removed from the configuration since."""
    return ops.resolve_capability(capability_id, {crew_id: ops.OPERATION_NAMES for crew_id in crews})


def _subject(capability_id: str, crews: Mapping[str, Any]) -> tuple[Principal, str | None]:
    """The crew an approval's capability runs (as an agent principal) and the operation's risk."""
    found = _resolve(capability_id, crews)
    if found is None:  # the crew was removed from the configuration since
        return Principal(id=f"crewai:{capability_id}", kind="agent"), None
    crew = crews[found[0]]
    return (Principal(id=f"crewai:{crew.id}", kind="agent", display_name=crew.name), ops.get(found[1]).risk.value)


def render(
    approval: ApprovalRecord,
    now_ms: int,
    crews: Mapping[str, Any],
    *,
    with_payload: bool,
    found: DisplayFindings | None = None,
    left: Sequence[str] | None = None,
) -> ApprovalRecordView:
    """The ApprovalRecordView of a stored approval (see the module table). Pure.

    Args:
        approval: the stored approval.
        now_ms: the host clock, epoch milliseconds (a pending approval past
            its expiry reads ``expired``).
        crews: crew id -> admitted descriptor (for the subject and risk).
        with_payload: include the exact input (``evidence_payload``).
        found: the input's display findings; when it lists any, ``request.evidence``
            announces them (:func:`display_evidence`).
        left: what the crew's own code may do to the request's inputs (:func:`approval_reason`); None: the
            plain reason.
    """
    status = approval.effective_status(now_ms)
    snapshot = msgspec.json.decode(approval.input_snapshot_json)
    hashed = fence_hash(approval.capability_id, snapshot)
    subject, risk = _subject(approval.capability_id, crews)
    url = f"/aip/v1/approvals/{approval.approval_id}"
    request = ApprovalRequest(
        id=approval.approval_id,
        action_id=approval.action_id,
        capability_id=approval.capability_id,
        requester=principal_view(approval.requested_by),
        subject=subject,
        approver_selector=ApproverSelector(),
        reason=approval_reason(approval.capability_id, left),
        evidence=[
            EvidenceArtifact(
                id=f"{approval.approval_id}:input",
                kind="input_snapshot",
                redacted=True,
                uri=url,
                hash=f"sha256:{hashed}",
            ),
            EvidenceArtifact(
                id=f"{approval.approval_id}:policy",
                kind="policy_decision",
                redacted=False,
                hash=f"sha256:{approval.policy_hash}",
            ),
            *([display_evidence(approval, found)] if found is not None and found.findings else []),
        ],
        expires_at=ms_to_rfc3339(approval.expires_at),
        policy_hash=approval.policy_hash,
        risk=risk,  # type: ignore[arg-type]
    )
    decision = None
    updated = approval.created_at
    if status in ("approved", "denied") and approval.decided_by and approval.decided_at is not None:
        decision = ApprovalDecision(
            approval_id=approval.approval_id,
            decision=status,  # type: ignore[arg-type]
            approver=principal_view(approval.decided_by),
            decided_at=ms_to_rfc3339(approval.decided_at),
            reason=approval.decision_reason,
            policy_hash=approval.policy_hash,
            evidence=proof_evidence(approval),
        )
        updated = approval.decided_at
    elif status == "expired":
        decision = ApprovalDecision(
            approval_id=approval.approval_id,
            decision="expired",
            approver=HOST_PRINCIPAL,
            decided_at=ms_to_rfc3339(approval.expires_at),
            policy_hash=approval.policy_hash,
        )
        updated = approval.expires_at
    payload = None
    if with_payload:
        payload = ApprovalEvidencePayload(
            action_id=approval.action_id, capability_id=approval.capability_id, input_hash=hashed, input=snapshot
        )
    return ApprovalRecordView(
        request=request,
        status=status,  # type: ignore[arg-type]
        created_at=ms_to_rfc3339(approval.created_at),
        updated_at=ms_to_rfc3339(updated),
        decision=decision,
        evidence_payload=payload,
    )


def proof_evidence(approval: ApprovalRecord) -> list[EvidenceArtifact] | None:
    """The evidence of a signed decision: one ``http_message_signature`` artifact
    whose ``hash`` is the SHA-256 of the signature base and whose ``uri`` serves
    the whole proof; None for an unsigned decision. Pure."""
    if approval.decision_proof is None:
        return None
    proof = msgspec.json.decode(approval.decision_proof, type=DecisionProof)
    digest = hashlib.sha256(proof.signature_base.encode("ascii")).hexdigest()
    return [
        EvidenceArtifact(
            id=f"{approval.approval_id}:signature",
            kind=PROOF_KIND,
            redacted=False,
            uri=f"/aip/v1/approvals/{approval.approval_id}/proof",
            hash=f"sha256:{digest}",
        )
    ]


#: ``status=decided``: every status but ``pending`` (the console's history, docs/approvals.md "Approval console").
DECIDED_STATUSES = tuple(s.value for s in ApprovalStatus if s is not ApprovalStatus.PENDING)
#: ``order`` values of the approval list: ``oldest`` (the default) or ``newest`` first.
ORDERS = ("oldest", "newest")


def status_filter(value: str | None) -> str | tuple[str, ...] | None:
    """The store's status filter of a ``status`` query value: one stored status, ``decided`` (any of
    :data:`DECIDED_STATUSES`), or None (no filter). Raises InvalidEnvelope (400) for anything else. Pure."""
    if value is None:
        return None
    if value == "decided":
        return DECIDED_STATUSES
    if value not in {s.value for s in ApprovalStatus}:
        raise InvalidEnvelope(
            f"status must be pending, decided, approved, denied, expired or withdrawn, not {value[:64]!r}"
        )
    return value


async def list_approvals(request: Request) -> Response:
    """``GET /aip/v1/approvals?status=...&order=oldest|newest&cursor=...&limit=N``: one ApprovalList
    page (``cursor`` None on the last page). ``status``: see :func:`status_filter`; ``order``: oldest
    first (default) or newest first; a cursor continues the order it came from. 400 ``message.invalid_envelope``
    for a bad status, order, limit or cursor (docs/approvals.md "The approval flow")."""
    principal = await authenticate(request)
    can_read_approvals(principal)
    service: ActionService = host_state(request).actions
    status = status_filter(request.query_params.get("status"))
    order = request.query_params.get("order", "oldest")
    if order not in ORDERS:
        raise InvalidEnvelope(f"order must be oldest or newest, not {order[:64]!r}")
    limit_text = request.query_params.get("limit", "100")
    if not (limit_text.isascii() and limit_text.isdigit()) or not 1 <= int(limit_text) <= 200:
        raise InvalidEnvelope("limit must be an integer 1..200")
    await service.expire_due()  # expiring an approval fails its action, in every path
    now = service.now_ms()
    page = await service.store.list_approvals(
        principal.tenant,
        status=status,
        cursor=request.query_params.get("cursor"),
        limit=int(limit_text),
        newest_first=order == "newest",
    )
    crews = host_state(request).crews
    return aip_json(
        ApprovalList(
            approvals=[render(a, now, crews, with_payload=False) for a in page.items],
            cursor=None if page.done else page.next_cursor,
        )
    )


async def _approval(request: Request, principal: Caller) -> ApprovalRecord:
    service: ActionService = host_state(request).actions
    approval = await service.store.get_approval(principal.tenant, request.path_params["approval_id"])
    if approval is None:
        raise ApprovalNotFound(request.path_params["approval_id"])
    return approval


async def get_approval(request: Request) -> Response:
    """``GET /aip/v1/approvals/{id}``: the ApprovalRecordView; approvers also get its evidence payload
    (the exact input), operators do not. ``?include_receipts=true``: with the receipt chain of its
    action (docs/observing.md "Observing actions")."""
    principal = await authenticate(request)
    can_read_approvals(principal)
    approval = await _approval(request, principal)
    # The exact input is for approvers; an operator reads the approval's metadata only.
    state = host_state(request)
    view = render(
        approval,
        state.actions.now_ms(),
        state.crews,
        with_payload=principal.has_role("approver"),
        found=display_findings(approval),
        left=_left_to_crew(state.capabilities, approval, approver=principal.has_role("approver")),
    )
    if include_receipts(request):
        chain = await receipt_chain(state.store, approval.tenant, approval.action_id, approval.approval_id)
        view = msgspec.structs.replace(view, receipt_chain=chain)
    return aip_json(view)


def _left_to_crew(index: CapabilityIndex, approval: ApprovalRecord, *, approver: bool) -> tuple[str, ...] | None:
    """What ``approval``'s crew may do to its inputs, by the crew inputs its sidecar last reported; the names
    tell of the input, so only an ``approver`` gets them (an operator is told that the crew may change them)."""
    found = _resolve(approval.capability_id, index.crews)
    if found is None:
        return None
    crew_id, operation = found
    snapshot = msgspec.json.decode(approval.input_snapshot_json)
    left = left_to_crew(operation, snapshot, index.crew_inputs.get(crew_id))
    return left if left is None or approver else ()


async def get_display(request: Request) -> Response:
    """``GET /aip/v1/approvals/{id}/display``: the :class:`DisplayFindings` of its input (approvers of
    the tenant: the paths and code points tell of the input; 403 for an operator, 404 another tenant's)."""
    principal = await authenticate(request)
    can_read_approvals(principal)
    if not principal.has_role("approver"):
        raise Forbidden("the display findings describe the input, which only approvers read")
    found = display_findings(await _approval(request, principal))
    return Response(msgspec.json.encode(found), media_type="application/json")


async def _decision_bytes(request: Request, *, authenticated: bool) -> bytes:
    """The decision body, at most :data:`~.limits.MAX_DECISION_BYTES` (the route's one bound, also applied
    by the body middleware: 413 ``message.too_large``) and declared JSON (415 before it is read); one read
    before authentication counts against the process's budget of such bodies (docs/security.md "Security")."""
    budget = None if authenticated else host_state(request).body_budget
    return await read_bounded(request, MAX_DECISION_BYTES, MessageTooLarge, budget=budget, media=JSON_BODY)


def _decode_decision(raw: bytes) -> DecisionRequest:
    """The decision body, refused (400 ``message.invalid_envelope``) unless valid and read one way only: a
    member named twice in any object (``{"decision": "denied", "decision": "approved"}``) is refused, since
    parsers disagree on which one counts and a signed body is kept as the decision's evidence (RFC 7493,
    I-JSON; docs/approvals.md "The approval flow")."""
    try:
        json.loads(raw, object_pairs_hook=_one_name_each)
    except (ValueError, RecursionError):  # not JSON: msgspec's message below says why
        pass
    try:
        return _decision_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise InvalidEnvelope(f"invalid decision: {plain_rule(str(exc))}") from exc


def _one_name_each(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    names = [name for name, _ in pairs]
    if len(set(names)) < len(names):
        twice = next(name for name in names if names.count(name) > 1)
        raise InvalidEnvelope(f"invalid decision: the member {twice[:64]!r} appears twice in one object")
    return dict(pairs)


async def _why_undecided(
    service: ActionService, principal: Caller, approval_id: str, decision: str, reason: str
) -> AipError | ApprovalRecord:
    """For a decision the store did not record now: the approval itself when it already holds this same
    decision (this principal, ``decision`` and ``reason``: a retry after a lost answer or a 503 whose commit
    went through, answered as made); else the error: expired, withdrawn (its action was cancelled), or
    already decided."""
    details = {"approval_id": approval_id}
    current = await service.store.get_approval(principal.tenant, approval_id)
    if (
        current is not None
        and current.decided_by == principal.id
        and current.status.value == decision
        and current.decision_reason == reason
    ):
        return current
    if current is not None and current.effective_status(service.now_ms()) is ApprovalStatus.EXPIRED:
        return ApprovalExpiredUndecidable(details=details)
    if current is not None and current.status in ("pending", "withdrawn"):
        return ApprovalWithdrawn(details=details)  # pending here: its action left pending_approval first
    return ApprovalAlreadyDecided(details=details)


async def post_decision(request: Request) -> Response:
    """``POST /aip/v1/approvals/{id}/decision`` (short form or an ApprovalDecision,
    see :class:`~aip_crewai.contracts.aip.DecisionRequest`) → 200 ApprovalDecision;
    400 an invalid body (no reason, a kind other than approved/denied);
    403 a non-approver, the requester, or a body naming another approver;
    404 another tenant's; 409 decided, expired or withdrawn (its action was
    cancelled, also when the cancel won a race with this decision), or another policy hash. The same
    decision again (same approver, decision and reason) is 200 with the decision as recorded: the retry a
    503 or a lost answer asks for."""
    if httpsig.is_signed(request.headers.keys()):  # the signature covers the body: read it first
        raw = await _decision_bytes(request, authenticated=False)
        principal = await authenticate(request, raw)
    else:
        principal = await authenticate(request)
        raw = await _decision_bytes(request, authenticated=True)
    decision = _decode_decision(raw)
    service: ActionService = host_state(request).actions
    approval, action = await service.store.get_approval_and_action(principal.tenant, request.path_params["approval_id"])
    if approval is None:
        raise ApprovalNotFound(request.path_params["approval_id"])
    if not principal.has_role("approver"):
        raise Forbidden("deciding needs the approver role")
    if decision.approver is not None and decision.approver.id != principal.id:
        raise Forbidden("the approver is the authenticated principal; the body names another")
    if approval.requested_by == principal.id:
        raise Forbidden("the requester may not decide its own approval")
    if decision.approval_id is not None and decision.approval_id != approval.approval_id:
        raise InvalidEnvelope("approval_id in the body differs from the path")
    if decision.decision not in ("approved", "denied"):
        raise InvalidEnvelope("a decision is approved or denied (expiry and revocation are the host's)")
    if not decision.reason or not display.says_something(decision.reason):  # "  " or "\u200b" alone: none
        raise InvalidEnvelope(
            "a decision needs a reason with a visible character (the capability's evidence requirement)"
        )
    signature = principal.request_signature
    if signature is not None and decision.policy_hash is None:
        raise InvalidEnvelope("a signed decision names the policy_hash it decides (so its signature proves it)")
    if decision.policy_hash is not None and decision.policy_hash != approval.policy_hash:
        raise ApprovalPolicyMismatch(details={"approval_id": approval.approval_id})
    proof = None
    if signature is not None:
        proof = msgspec.json.encode(DecisionProof(**signature.proof(), body=raw.decode("utf-8"))).decode()
    now = service.now_ms()
    decided = await service.decide(
        principal, approval.approval_id, decision.decision, decision.reason, now, proof=proof, action=action
    )
    # An approved action's dispatch takes its first step before this answer is written: its `sent` write, on
    # the store's thread, overlaps the answer, and the start leaves for the sidecar sooner (about 0.5 ms).
    await asyncio.sleep(0)
    if decided is None:
        undecided = await _why_undecided(service, principal, approval.approval_id, decision.decision, decision.reason)
        if isinstance(undecided, AipError):
            raise undecided
        decided, now = undecided, undecided.decided_at or now  # the same decision again: as it was recorded
    return aip_json(
        ApprovalDecision(
            approval_id=decided.approval_id,
            decision=decision.decision,
            approver=principal_view(principal.id),
            decided_at=ms_to_rfc3339(now),
            reason=decision.reason,
            policy_hash=decided.policy_hash,
            decision_id=f"{decided.approval_id}:decision",
            evidence=proof_evidence(decided),
        )
    )


async def get_proof(request: Request) -> Response:
    """``GET /aip/v1/approvals/{id}/proof``: the :class:`DecisionProof` of a
    signed decision (approvers and operators of the tenant); 404
    ``approval.no_proof`` when the decision was not signed or not made yet."""
    principal = await authenticate(request)
    can_read_approvals(principal)
    approval = await _approval(request, principal)
    if approval.decision_proof is None:
        raise ProofNotFound(details={"approval_id": approval.approval_id})
    return Response(approval.decision_proof.encode(), media_type="application/json")


def routes() -> list[Route]:
    """The approval routes, mounted by the host app."""
    return [
        Route("/aip/v1/approvals", list_approvals, methods=["GET"]),
        Route("/aip/v1/approvals/{approval_id:str}", get_approval, methods=["GET"]),
        Route("/aip/v1/approvals/{approval_id:str}/proof", get_proof, methods=["GET"]),
        Route("/aip/v1/approvals/{approval_id:str}/display", get_display, methods=["GET"]),
        Route("/aip/v1/approvals/{approval_id:str}/decision", post_decision, methods=["POST"]),
    ]
