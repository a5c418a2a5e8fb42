"""What a stored result leaves besides itself: its ``usage`` and, once final, its signed receipt.

The :class:`~aip_crewai.host.actions.writer.ActionWriter` asks :meth:`Sealer.seal` for a :class:`ResultSeal`
of every result it stores and hands it to the store, which calls it inside the result's own transaction
with the action as just written (so ``latency_ms`` is the row's ``updated_at − created_at``) and its
approval's decision proof (:func:`aip_crewai.host.store.ledger.seal_now`). The seal then returns the result
JSON with ``usage`` and ``receipt`` added, the usage row, and the receipt:

- ``usage`` for a crew operation (one that starts a sidecar job): tokens from its output's
  ``token_usage`` (:mod:`.usage`), latency, cost when priced; stored as the action's usage row. A
  ``status`` read carries the usage of the run it read (tokens and cost from the job view's output, its
  own latency) and stores no row: the run's own row counts it. A read answered inline is admitted and
  finished in one write (latency 0): its usage is added before that write (:meth:`Sealer.seal_answered`).
- a receipt for a final result only (:func:`~aip_crewai.host.actions.lifecycle.result_is_final`), when a
  receipt key is configured (:mod:`.receipts`); a provisional result gets one when its correction is final.

Source: docs/observing.md "Observing actions"; ARCHITECTURE.md §9 "Final results".
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog

from ...contracts import operations as ops
from ...contracts.aip import ActionResult
from ..actions.lifecycle import ActionState, result_is_final
from ..store.records import ActionRecord, SealedRows, ms_to_rfc3339
from . import receipts as rc
from .usage import TOKEN_KINDS, Measured, Pricing, Usage, measure

log = structlog.get_logger(__name__)

_encode = msgspec.json.Encoder()
_fields = msgspec.json.Decoder(dict[str, msgspec.Raw])


class _Proof(msgspec.Struct, frozen=True):
    signature_base: str


def decision_proof_hash(proof_json: str | None) -> str | None:
    """``sha256:<hex>`` of a signed decision's RFC 9421 signature base (the hash its approval's proof
    evidence shows), or None for an unsigned decision (or a proof that cannot be read)."""
    if proof_json is None:
        return None
    try:
        base = msgspec.json.decode(proof_json, type=_Proof).signature_base
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return rc.sha256_ref(base.encode("utf-8"))


def _builtins(value: Any) -> Any:
    """``value`` as the JSON a tenant decodes (a ``msgspec.Raw`` output included)."""
    return msgspec.json.decode(_encode.encode(value))


@dataclass
class Sealer:
    """Builds the seal of each stored result. ``pricing``: ``[pricing]`` (None: no cost); ``keys``: the
    receipt keys (None: no receipts); ``metrics``: the host's metrics (tokens and cost counted per tenant
    and crew when a crew operation's final result is stored)."""

    pricing: Pricing | None = None
    keys: rc.ReceiptKeys | None = None
    metrics: Any = None

    def seal(self, result: ActionResult) -> ResultSeal:
        """The seal of ``result`` (computes its output hash now, off the store's thread, when receipts are on)."""
        output_hash = None
        if self.keys is not None and result.output is not None and result.status != "pending_approval":
            output_hash = rc.value_hash(_builtins(result.output))
        return ResultSeal(self, result, output_hash)

    def seal_answered(self, result: ActionResult, *, operation: str, crew_id: str) -> tuple[ActionResult, ResultSeal]:
        """The result to store and the seal of a read answered inline, admitted and finished in ONE write (so
        its latency is 0 ms). A completed ``status``'s usage is computed here, and stored with the row it is
        inserted in, instead of by the seal on the store's thread (which re-encoded the stored result and
        updated the row: about 60 µs per recorded status, measured in-process). The seal keeps what needs the record
        as written: a receipt, webhook events."""
        if operation == "status" and result.status == "completed" and result.usage is None:
            usage = _status_usage(result, crew_id=crew_id, latency_ms=0, pricing=self.pricing)
            result = msgspec.structs.replace(result, usage=msgspec.to_builtins(usage))
        return result, self.seal(result)

    def count(self, seal: ResultSeal) -> None:
        """Count what a written seal measured (tokens by kind, cost) under its tenant and crew."""
        if self.metrics is None or seal.counted is None:
            return
        tenant, crew, measured = seal.counted
        if measured.tokens is not None:
            for kind, value in zip(TOKEN_KINDS, measured.tokens.as_tuple(), strict=True):
                if value:
                    self.metrics.tokens.inc(value, tenant=tenant, crew=crew, kind=kind)
        if measured.cost_picos is not None and measured.currency is not None:
            self.metrics.cost.inc(measured.cost_picos / 10**12, tenant=tenant, crew=crew, currency=measured.currency)


def _status_usage(result: ActionResult, *, crew_id: str, latency_ms: int, pricing: Pricing | None) -> Usage:
    """A completed ``status`` result's usage: the tokens and cost of the output its job view holds, and the
    read's own latency (ms)."""
    job = _builtins(result.output) if isinstance(result.output, msgspec.Raw) else result.output
    view = job.get("output") if isinstance(job, dict) else None
    return measure(view, crew_id=crew_id, latency_ms=latency_ms, pricing=pricing).usage


class ResultSeal:
    """The :data:`~aip_crewai.host.store.records.Seal` of one result (see the module docstring). After the
    store called it, :attr:`counted` holds ``(tenant, crew, measured)`` of a final crew operation's result."""

    def __init__(self, sealer: Sealer, result: ActionResult, output_hash: str | None) -> None:
        self.sealer = sealer
        self.result = result
        self.output_hash = output_hash
        self.counted: tuple[str, str, Measured] | None = None

    def __call__(self, record: ActionRecord, proof: str | None) -> SealedRows | None:
        spec = ops.get(record.operation)
        latency_ms = record.updated_at - record.created_at
        result = self.result
        fields: dict[str, msgspec.Raw] = {}
        usage_row = receipt_row = None
        error = result.error
        final = result_is_final(
            ActionState(record.status),
            startable=spec.startable,
            error_code=error.code if error is not None else None,
            details=error.details if error is not None else None,
        )
        if spec.startable:
            output = result.output if result.status == "completed" else None
            measured = measure(output, crew_id=record.crew_id, latency_ms=latency_ms, pricing=self.sealer.pricing)
            fields["usage"] = msgspec.Raw(_encode.encode(measured.usage))
            tokens = measured.tokens.as_tuple() if measured.tokens is not None else (0, 0, 0, 0, 0)
            usage_row = (
                record.tenant,
                record.action_id,
                record.crew_id,
                record.operation,
                record.updated_at,
                *tokens,
                measured.usage.latency_ms or 0,
                measured.cost_picos,
                measured.currency,
            )
            if final:
                self.counted = (record.tenant, record.crew_id, measured)
        elif record.operation == "status" and result.status == "completed" and result.usage is None:
            usage = _status_usage(result, crew_id=record.crew_id, latency_ms=latency_ms, pricing=self.sealer.pricing)
            fields["usage"] = msgspec.Raw(_encode.encode(usage))
        keys = self.sealer.keys
        if final and keys is not None and record.result_json is not None:
            receipt_id = rc.receipt_id(record.tenant, record.action_id)
            key = record.idempotency_key
            claims = {
                "type": rc.RECEIPT_TYPE,
                "id": receipt_id,
                "key_id": keys.key_id,
                "tenant": record.tenant,
                "action_id": record.action_id,
                "capability_id": record.capability_id,
                "crew_id": record.crew_id,
                "operation": record.operation,
                "principal_id": record.principal_id,
                "input_hash": f"sha256:{record.input_hash}",
                "idempotency_key_hash": rc.sha256_ref(key.encode("utf-8")) if key is not None else None,
                "approval_id": record.approval_id,
                "decision_proof_hash": decision_proof_hash(proof),
                "status": record.status.value,
                "error_code": error.code if error is not None else None,
                "output_hash": self.output_hash,
                "accepted_at": ms_to_rfc3339(record.created_at),
                "finished_at": ms_to_rfc3339(record.updated_at),
            }
            document, digest = rc.sign(claims, keys.signer)
            receipt_row = (
                record.tenant,
                receipt_id,
                record.action_id,
                record.approval_id,
                digest,
                document.decode("utf-8"),
                record.updated_at,
            )
            fields["receipt"] = msgspec.Raw(_encode.encode({"id": receipt_id, "hash": digest}))
            log.info("receipt_signed", action_id=record.action_id, receipt_id=receipt_id, key_id=keys.key_id)
        if not fields or record.result_json is None:
            return None
        stored = _fields.decode(record.result_json)
        stored.update(fields)
        return SealedRows(_encode.encode(stored).decode(), usage_row, receipt_row)


def chain_hash(hashes: list[str]) -> str | None:
    """The aggregate hash of a receipt chain: the only hash of a one-receipt chain, else ``sha256:`` of
    the hashes joined by newlines, oldest first; None for no receipt."""
    if len(hashes) <= 1:
        return hashes[0] if hashes else None
    return "sha256:" + hashlib.sha256("\n".join(hashes).encode()).hexdigest()
