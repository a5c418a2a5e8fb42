"""The Standard Webhooks signature of one attempt (the ``standardwebhooks`` package signs).

Headers: ``webhook-id`` (the delivery's id, the same on every attempt), ``webhook-timestamp`` (this
attempt's time, integer seconds since the epoch: receivers refuse ones more than 5 minutes away, so each
attempt is signed anew), ``webhook-signature`` (``v1,<base64 HMAC-SHA256 of "<id>.<timestamp>.<body>">``).

Source: docs/webhooks.md (signature verification); the Standard Webhooks specification.
"""

from __future__ import annotations

from datetime import datetime, timezone

from standardwebhooks.webhooks import Webhook


def signed_headers(signer: Webhook, delivery_id: str, now_s: float, body: str) -> dict[str, str]:
    """The three Standard Webhooks headers and ``content-type`` for ``body`` sent at ``now_s`` (epoch s)."""
    moment = datetime.fromtimestamp(int(now_s), tz=timezone.utc)
    return {
        "content-type": "application/json",
        "webhook-id": delivery_id,
        "webhook-timestamp": str(int(now_s)),
        "webhook-signature": signer.sign(delivery_id, moment, body),
    }
