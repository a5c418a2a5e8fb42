"""Sidecar errors: each an :class:`AipError` with a stable code and HTTP status.

The app renders every one as ``{"detail": <message>, **details}``: ``detail``
is always a safe string (our rule or target, never provider text or
secrets); ``details`` adds machine-readable fields where a caller needs them
(``status``, ``error_type``, ``uncertain_outcome`` on a failed blocking job).

Source: ARCHITECTURE.md §4 (statuses), ARCHITECTURE.md §2.
"""

from __future__ import annotations

from typing import ClassVar

from aip_crewai.contracts.errors import AipError, Category


class SidecarError(AipError):
    """Root of the sidecar's own errors."""

    code: ClassVar[str] = "sidecar.error"
    category: ClassVar[Category] = Category.PERMANENT
    http_status: ClassVar[int | None] = 400
    default_message: ClassVar[str] = "the sidecar refused the request"


# ------------------------------------------------------------ journal (§5)


class JournalError(SidecarError):
    """The journal cannot be used (start-up refusal or a failed write)."""

    code = "sidecar.journal_error"
    category = Category.TEMPORARY
    http_status = 507
    default_message = "the job journal is unavailable"


class JournalLocked(JournalError):
    """Another live process holds ``<journal>.lock``."""

    code = "sidecar.journal_locked"
    http_status = 503


class JournalInsecure(JournalError):
    """A journal file or directory breaks a permission or file-type rule."""

    code = "sidecar.journal_insecure"
    http_status = 503


class JournalSchemaError(JournalError):
    """The journal's schema is newer than this code."""

    code = "sidecar.journal_schema"
    http_status = 503


class JournalForeign(JournalError):
    """The file is not an aip-crewai journal (another application's database, or not SQLite)."""

    code = "sidecar.journal_foreign"
    http_status = 503


class JournalCorrupt(JournalError):
    """SQLite's integrity check found damage in the journal."""

    code = "sidecar.journal_corrupt"
    http_status = 503


class JournalReplaced(JournalError):
    """The journal's path no longer names the file this sidecar opened (it was
    replaced or removed while running): nothing is admitted until a restart
    checks the file at the path again."""

    code = "sidecar.journal_replaced"
    http_status = 503
    default_message = "the job journal file was replaced or removed while the sidecar runs; restart the sidecar"


class JournalWriteFailed(JournalError):
    """A write transaction failed and was rolled back (nothing half-written)."""

    code = "sidecar.journal_write_failed"
    default_message = "the job journal could not record the job"


class OutcomeNotRecorded(JournalError):
    """A job ended but the journal has not taken its terminal event yet (a full disk: the outcome waits in
    the backlog, retried): its view and events are not answered from a journal that still says ``running``,
    and the reader tries again later (503, like any "try later")."""

    code = "sidecar.outcome_not_recorded"
    http_status = 503
    default_message = (
        "the job ended but the journal could not record its outcome yet (it is retried); read the job again later"
    )


class JournalFull(JournalError):
    """Admission refused: retained-run limit or journal size bound reached."""

    code = "sidecar.journal_full"
    default_message = "the job journal is full"


# ---------------------------------------------------------- admission (§4)


class ShuttingDown(SidecarError):
    code = "sidecar.shutting_down"
    category = Category.TEMPORARY
    http_status = 503
    default_message = "the sidecar is shutting down and admits no new jobs"


class Draining(SidecarError):
    code = "sidecar.draining"
    category = Category.TEMPORARY
    http_status = 503
    default_message = (
        "the sidecar is draining (SIGUSR1): it finishes its jobs and admits no new ones; send the job elsewhere"
    )


class OperationNotEnabled(SidecarError):
    code = "sidecar.operation_not_enabled"
    category = Category.POLICY
    http_status = 403
    default_message = "the operation is not enabled on this sidecar"


class IdempotencyKeyMissing(SidecarError):
    code = "sidecar.idempotency_key_missing"
    http_status = 428
    default_message = "the Idempotency-Key header is required"


class IdempotencyKeyInvalid(SidecarError):
    code = "sidecar.idempotency_key_invalid"
    http_status = 400
    default_message = "the Idempotency-Key header must be at most 512 bytes without control characters"


class InvalidJobRequest(SidecarError):
    code = "sidecar.invalid_request"
    http_status = 422
    default_message = "the job request is invalid"


class TaskRunNotFound(InvalidJobRequest):
    """``replay`` names a task id of no retained completed run of that crew."""

    code = "sidecar.task_run_not_found"
    default_message = "the task id belongs to no retained run of this crew"


class CrewNotFound(SidecarError):
    code = "sidecar.crew_not_found"
    http_status = 404
    default_message = "unknown crew"


class RequestTooLarge(SidecarError):
    code = "sidecar.input_too_large"
    http_status = 413
    default_message = "the input exceeds its size bound"


class RequestConflict(SidecarError):
    """The action id was admitted with a different request hash (or was archived)."""

    code = "sidecar.request_conflict"
    http_status = 409
    default_message = "the action id was already used with a different request"


class CrewBusy(SidecarError):
    """``memory_reset`` of a (tenant, crew) while another job of it is queued or
    running, or any job of a (tenant, crew) while its ``memory_reset`` runs:
    refused, never queued (docs/security.md "Tenant-scoped crew state")."""

    code = "sidecar.crew_busy"
    category = Category.TEMPORARY
    http_status = 409
    default_message = "the crew has a job in progress for this tenant; retry when it is finished"


# --------------------------------------------------------- job routes (§4)


class Unauthenticated(SidecarError):
    code = "sidecar.unauthenticated"
    category = Category.AUTH
    http_status = 401
    default_message = "missing or invalid bearer token"


class BadRequest(SidecarError):
    code = "sidecar.bad_request"
    http_status = 400


class JobNotFound(SidecarError):
    code = "sidecar.job_not_found"
    http_status = 404
    default_message = "job not found"


class JobNotCancellable(SidecarError):
    code = "sidecar.not_cancellable"
    http_status = 409
    default_message = "this operation cannot be cancelled"


class JobStillRunning(SidecarError):
    code = "sidecar.job_running"
    http_status = 409
    default_message = "the job is not terminal yet"


class ArchiveConfirmationRequired(SidecarError):
    code = "sidecar.archive_confirmation_required"
    http_status = 428
    default_message = "X-AIP-Archive-Confirmation must equal the action id"


class CursorOutOfRange(SidecarError):
    code = "sidecar.cursor_out_of_range"
    http_status = 416
    default_message = "the cursor is outside the journal"


# ------------------------------------------------- blocking outcomes (§4)


class JobFailedError(SidecarError):
    """Blocking ``POST /jobs`` on a failed job; details carry the failed event data."""

    code = "sidecar.job_failed"
    category = Category.CONNECTOR
    http_status = 502
    default_message = "the job failed"


class JobCancelledError(SidecarError):
    code = "sidecar.job_cancelled"
    http_status = 409
    default_message = "the job was cancelled"


class JobWaitTimeout(SidecarError):
    code = "sidecar.wait_timeout"
    category = Category.TEMPORARY
    http_status = 504
    default_message = "the job did not finish within timeout_ms; it keeps running"
