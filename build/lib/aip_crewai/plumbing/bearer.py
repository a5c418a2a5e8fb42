"""The one parser of ``Authorization: Bearer <token>`` (host and sidecar).

A token is visible ASCII (0x21..0x7e), after the case-insensitive scheme
``Bearer`` and one or more spaces; trailing spaces are tolerated. Anything
else is no bearer credential at all (the caller answers 401). Comparison is
the caller's (constant time, over SHA-256 digests).

Source: RFC 6750 §2.1; docs/ARCHITECTURE.md §4 (sidecar), §7 (host).
"""

from __future__ import annotations

import re

_BEARER_RE = re.compile(r"^Bearer +([\x21-\x7e]+) *\Z", re.IGNORECASE)


def parse_bearer(value: str | bytes, *, max_token_chars: int) -> str | None:
    """The token of an ``Authorization`` header value, or None when it is not
    ``Bearer <token>`` or the token is longer than ``max_token_chars``."""
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    if len(text) > max_token_chars + 32:  # scheme and spaces: never run the regex over megabytes
        return None
    match = _BEARER_RE.match(text)
    if match is None or len(match.group(1)) > max_token_chars:
        return None
    return match.group(1)
