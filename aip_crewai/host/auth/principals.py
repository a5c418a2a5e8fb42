"""Principal authentication and roles.

Two ways in (ARCHITECTURE.md §7):

- ``Authorization: Bearer <token>``: the SHA-256 of the presented token is
  compared with EVERY configured hash using ``hmac.compare_digest`` (no early
  exit, so timing does not tell which principal, if any, matched).
- An Ed25519-signed envelope: ``security = {scheme: "ed25519", key_id:
  <principal id>, signature: <base64url, no padding, 64 bytes>}``. The signed
  bytes are the RFC 8785 canonical JSON (``hashing.jcs``) of the envelope
  object AS RECEIVED (the decoded JSON, not a re-encoded Struct, which would
  drop defaults) with only ``security.signature`` removed. Checked in this
  order: principal known and holding a key, every number canonical
  (:func:`~aip_crewai.contracts.hashing.number_problem`: what runs is exactly
  what was signed; else 400 ``message.non_canonical_number`` naming the
  field), signature valid, ``sent_at`` within ±300 s of the host clock. The
  ``message_id`` is claimed per signing key (principal), and only AFTER the
  request is authorized (:meth:`Authenticator.claim`, called by the action
  service once the role and capability checks passed), so neither a forged
  message nor a signer without the role can burn another signer's ids
  (claims outlive the freshness window).

- An HTTP Message Signature (RFC 9421, :mod:`aip_crewai.plumbing.httpsig`): the
  ``Signature-Input``/``Signature`` headers, Ed25519, ``keyid`` = the principal
  id, covering ``@method @authority @path @query`` (and ``content-digest``
  with a body), ``created`` within ±300 s, a ``nonce`` claimed once per key in
  the same claim store as envelope message ids (as ``httpsig:<nonce>``), at
  once: a verified signature is its key's own, so claiming it cannot burn
  anyone else's nonces. Any route accepts it, so a principal configured with
  only an ``ed25519_public_key`` lists, shows and decides approvals and reads
  the actions its role allows (docs/approvals.md "Signed requests").

When a request has several, the bearer token decides and every signature
present must also verify and name the same principal. Anything else is
:class:`~aip_crewai.contracts.errors.Unauthenticated` (401 with
``WWW-Authenticate: Bearer``, rendered by the app's error handler).

Roles are ``invoker``, ``approver``, ``operator``; :func:`require_role`
raises ``Forbidden`` (403). Tenant routing is not decided here: a principal
carries its tenant and every lookup downstream is keyed by it.

Source: ARCHITECTURE.md §7 (principals, signed envelopes), §6 (statuses).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import structlog
from cryptography.exceptions import InvalidSignature

from ...contracts.errors import Forbidden, InvalidInput, NonCanonicalNumber, Unauthenticated
from ...contracts.hashing import number_problem
from ...contracts.inputs import MAX_INPUT_DEPTH, too_deep
from ...plumbing import httpsig
from ...plumbing.bearer import parse_bearer
from ..settings import PrincipalConfig
from ..store.records import rfc3339_to_ms
from .signatures import NONCE_CLAIM_PREFIX, PublicAuthorities, SignedRequest, envelope_signature, signed_bytes

log = structlog.get_logger(__name__)

#: Accepted clock difference for ``sent_at``, milliseconds (ARCHITECTURE.md §7).
MAX_CLOCK_SKEW_MS = 300_000
#: How long a claimed message id is remembered past ``sent_at``, ms (> the skew window).
MESSAGE_ID_RETENTION_MS = MAX_CLOCK_SKEW_MS + 60_000
MAX_BEARER_CHARS = 4096
#: Nesting bound of a signed envelope: the input's bound plus the envelope, body and action levels above it.
MAX_ENVELOPE_DEPTH = MAX_INPUT_DEPTH + 3
#: Where an envelope holds the action's input (a JSON path).
INPUT_PATH = "$.body.action.input"


def envelope_too_deep(path: str) -> InvalidInput:
    """The refusal of an envelope nested past :data:`MAX_ENVELOPE_DEPTH` at ``path`` (its first container past
    the bound, :func:`~aip_crewai.contracts.inputs.too_deep`): inside the action's input, as the input's own
    bound names it (:data:`MAX_INPUT_DEPTH` levels from the input); elsewhere, as the envelope's."""
    if path.startswith((f"{INPUT_PATH}.", f"{INPUT_PATH}[")):
        return InvalidInput(path, f"nested deeper than {MAX_INPUT_DEPTH} levels of objects and arrays")
    return InvalidInput(path, f"the envelope nests deeper than {MAX_ENVELOPE_DEPTH} levels of objects and arrays")


@dataclass(frozen=True)
class Principal:
    """An authenticated caller. ``method`` is ``bearer``, ``ed25519`` (a signed
    envelope) or ``http_signature`` (an RFC 9421 signed request)."""

    id: str
    tenant: str
    roles: frozenset[str]
    method: str = "bearer"
    #: ``(message_id, claim expiry ms)`` of a verified signed envelope, to be
    #: claimed once the request is authorized (:meth:`Authenticator.claim`).
    message_claim: tuple[str, int] | None = None
    #: The verified RFC 9421 signature of this request (its proof), when it was signed.
    request_signature: httpsig.VerifiedSignature | None = None

    def has_role(self, role: str) -> bool:
        return role in self.roles


class MessageIdClaims(Protocol):
    """What the authenticator needs from the store."""

    async def claim_message_id(
        self, tenant: str, message_id: str, expires_at: int, *, now: int | None = None, key_id: str | None = None
    ) -> bool: ...


#: What a principal of an action's tenant may read of it (docs/security.md "Security": who reads what).
FULL, METADATA = "full", "metadata"


def action_access(principal: Principal, *, submitted: bool, decided: bool) -> str | None:
    """How much of one action of its own tenant ``principal`` may read. Pure.

    - an invoker reads the actions it submitted (``full``: input, chunks, output);
    - an approver reads the actions whose approval it decided (``full``);
    - an operator reads metadata only (``metadata``: state, times, result
      status and error code; no input, chunks, output or error details);
    - anyone else: None (the action does not exist for it: 404).
    A principal with several roles gets the widest of them.
    """
    if (principal.has_role("invoker") and submitted) or (principal.has_role("approver") and decided):
        return FULL
    if principal.has_role("operator"):
        return METADATA
    return None


def can_read_approvals(principal: Principal) -> None:
    """Raise ``Forbidden`` (403) unless ``principal`` is an approver or an operator
    (who read a tenant's approvals: docs/security.md "Who reads what")."""
    if not (principal.has_role("approver") or principal.has_role("operator")):
        raise Forbidden("reading approvals needs the approver or operator role")


def require_role(principal: Principal, role: str) -> None:
    """Raise ``Forbidden`` (403, ``policy.forbidden``) unless ``principal`` holds ``role``."""
    if role not in principal.roles:
        raise Forbidden(f"this needs the {role} role", details={"required_role": role})


class Authenticator:
    """Authenticates requests against the configured principals.

    Args:
        principals: from :class:`~aip_crewai.host.settings.Settings`.
        claims: the store (``claim_message_id``), used for signed envelopes.
        clock: seconds since the epoch (injectable for tests).
        authorities: the ``@authority`` a signed request may name (default: the bind address's forms).
    """

    def __init__(
        self,
        principals: Iterable[PrincipalConfig],
        claims: MessageIdClaims | None,
        *,
        clock: Callable[[], float] = time.time,
        authorities: PublicAuthorities | None = None,
    ) -> None:
        self._principals = {p.id: p for p in principals}
        self._authorities = authorities or PublicAuthorities()
        self._hashes = [(p, p.token_sha256) for p in self._principals.values() if p.token_sha256 is not None]
        self.claims = claims
        self._clock = clock

    @staticmethod
    def _principal(config: PrincipalConfig, method: str) -> Principal:
        return Principal(config.id, config.tenant, config.roles, method)

    def authenticate_bearer(self, token: str) -> Principal:
        """Principal whose stored hash equals SHA-256(``token``), else Unauthenticated."""
        digest = hashlib.sha256(token.encode("utf-8")).digest()
        found: PrincipalConfig | None = None
        for config, stored in self._hashes:  # every hash, no early exit
            if hmac.compare_digest(stored, digest) and found is None:
                found = config
        if found is None:
            raise Unauthenticated("the bearer token is not valid")
        return self._principal(found, "bearer")

    async def authenticate_envelope(self, envelope_obj: dict[str, Any]) -> Principal:
        """Verify an Ed25519-signed envelope (see the module docstring).

        Raises:
            Unauthenticated: any check fails (the message names which).
        """
        security = envelope_obj.get("security")
        if not isinstance(security, dict) or security.get("scheme") != "ed25519":
            raise Unauthenticated("the envelope carries no ed25519 security block")
        key_id = security.get("key_id")
        config = self._principals.get(key_id) if isinstance(key_id, str) else None
        if config is None or config.ed25519_public_key is None:
            raise Unauthenticated("unknown signing key")
        signature = envelope_signature(security.get("signature"))
        if signature is None:
            raise Unauthenticated("the signature must be 64 bytes in unpadded base64url")
        deep = too_deep(envelope_obj, MAX_ENVELOPE_DEPTH)  # checked before anything recurses into it
        if deep is not None:
            raise envelope_too_deep(deep)
        problem = number_problem(envelope_obj)
        if problem is not None:  # 1.0 signs as 1 but would run as 1.0; 2**53 cannot be signed at all
            raise NonCanonicalNumber(*problem)
        try:
            payload = signed_bytes(envelope_obj)
        except (TypeError, ValueError, RecursionError) as exc:  # not JSON-representable
            raise Unauthenticated("the envelope cannot be canonicalized") from exc
        try:
            config.ed25519_public_key.verify(signature, payload)
        except InvalidSignature:
            raise Unauthenticated("the signature does not verify") from None
        now_ms = int(self._clock() * 1000)
        try:
            sent_ms = rfc3339_to_ms(envelope_obj.get("sent_at"))  # type: ignore[arg-type]
        except ValueError:
            raise Unauthenticated("sent_at must be an RFC 3339 timestamp") from None
        if abs(now_ms - sent_ms) > MAX_CLOCK_SKEW_MS:
            raise Unauthenticated("sent_at is more than 300 s away from the host clock")
        message_id = envelope_obj.get("message_id")
        if not isinstance(message_id, str) or not message_id:
            raise Unauthenticated("a signed envelope needs a message_id")
        if self.claims is None:
            raise Unauthenticated("signed envelopes need the store")
        expires = max(sent_ms, now_ms) + MESSAGE_ID_RETENTION_MS
        return dataclasses.replace(self._principal(config, "ed25519"), message_claim=(message_id, expires))

    async def claim(self, principal: Principal) -> None:
        """Claim the message id of ``principal``'s signed envelope for its key (no-op without one).

        Raises:
            Unauthenticated: the id was already claimed by this key (a replay).
        """
        if principal.message_claim is None:
            return
        if self.claims is None:
            raise Unauthenticated("signed envelopes need the store")
        message_id, expires = principal.message_claim
        if not await self.claims.claim_message_id(
            principal.tenant, message_id, expires, now=int(self._clock() * 1000), key_id=principal.id
        ):
            raise Unauthenticated("message_id was already used")

    def _public_key(self, key_id: str) -> Any:
        config = self._principals.get(key_id)
        return config.ed25519_public_key if config is not None else None

    async def authenticate_signed_request(self, request: SignedRequest) -> Principal:
        """Verify an RFC 9421 signed request (:func:`aip_crewai.plumbing.httpsig.verify_request`)
        and claim its nonce for its key.

        Raises:
            Unauthenticated: its ``@authority`` is not one of this host's (``[host] public_authorities``),
                the signature breaks the profile, does not verify, names an unknown key, or its nonce
                was used before (a replay).
        """
        if not self._authorities.allows(request.authority, request.server):
            shown = request.authority[:256].encode("unicode_escape").decode("ascii")
            raise Unauthenticated(
                f"signed request: @authority {shown!r} is not an authority of this host "
                "([host] public_authorities; default: the address it listens on)"
            )
        now_s = self._clock()
        try:
            verified = httpsig.verify_request(
                request.method, request.url, request.headers, request.body, public_key=self._public_key, now_s=now_s
            )
        except httpsig.SignatureRejected as exc:
            raise Unauthenticated(f"signed request: {exc.reason}") from None
        config = self._principals[verified.key_id]  # the key resolved, so the principal exists
        if self.claims is None:
            raise Unauthenticated("signed requests need the store")
        now_ms = int(now_s * 1000)
        expires = max(verified.created * 1000, now_ms) + MESSAGE_ID_RETENTION_MS
        if not await self.claims.claim_message_id(
            config.tenant, f"{NONCE_CLAIM_PREFIX}{verified.nonce}", expires, now=now_ms, key_id=config.id
        ):
            raise Unauthenticated("signed request: the nonce was already used")
        return dataclasses.replace(self._principal(config, "http_signature"), request_signature=verified)

    async def authenticate(
        self,
        authorization: str | None,
        envelope_obj: dict[str, Any] | None,
        signed_request: SignedRequest | None = None,
    ) -> Principal:
        """Authenticate from the ``Authorization`` header value, the RFC 9421
        signature of the request, and/or the envelope's signature; every
        credential present must verify and name the same principal.

        Raises:
            Unauthenticated: no credential, a bad one, or two naming different principals.
        """
        signed = envelope_obj if isinstance(envelope_obj, dict) and "security" in envelope_obj else None
        principal: Principal | None = None
        if authorization is not None:
            token = parse_bearer(authorization, max_token_chars=MAX_BEARER_CHARS)
            if token is None:
                raise Unauthenticated("the Authorization header must be 'Bearer <token>'")
            principal = self.authenticate_bearer(token)
        if signed_request is not None:
            by_request = await self.authenticate_signed_request(signed_request)
            if principal is not None and by_request.id != principal.id:
                raise Unauthenticated("the request is signed by another principal than the bearer token's")
            principal = (
                by_request
                if principal is None
                else dataclasses.replace(principal, request_signature=by_request.request_signature)
            )
        if signed is not None:
            signer = await self.authenticate_envelope(signed)
            if principal is None:
                return signer
            if signer.id != principal.id:
                raise Unauthenticated("the envelope is signed by another principal than the request's credential")
            principal = dataclasses.replace(principal, message_claim=signer.message_claim)
        if principal is None:
            raise Unauthenticated()
        return principal
