"""Argument types of the ``aip-crewai`` command line (argparse ``type=``): each checks one argument before
anything is sent and raises :class:`argparse.ArgumentTypeError` naming the expected form (argparse prints it
and exits 2, docs/reference/cli.md "Exit codes")."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from urllib.parse import urlsplit

from .contracts.inputs import ACTION_ID_PATTERN, PATTERN_MEANINGS


def _id_argument(text: str, kind: str, hint: str = "") -> str:
    """Check an id argument against the action id rule (1 to 256 visible ASCII characters, no ``/``): ``text``
    itself, or :class:`argparse.ArgumentTypeError` saying ``'<text>' is not an <kind>: <hint>1 to 256 …`` (the
    text cut at 64 characters)."""
    if len(text) > 256 or not re.match(ACTION_ID_PATTERN, text):
        shown = text if len(text) <= 64 else text[:64] + "…"
        raise argparse.ArgumentTypeError(
            f"{shown!r} is not an {kind}: {hint}1 to 256 {PATTERN_MEANINGS[ACTION_ID_PATTERN]}"
        )
    return text


def action_id(text: str) -> str:
    """Check an action id argument (the AIP ``Action.id`` this host accepts: 1 to 256 visible ASCII characters,
    no ``/``; ARCHITECTURE.md §3), so a bad one is refused here, in words, not answered by the host as a
    route it does not have (``actions show ../x`` would reach another path).

    Raises:
        argparse.ArgumentTypeError: naming the rule (argparse exits 2).
    """
    return _id_argument(text, "action id")


def approval_id(text: str) -> str:
    """Check an approval id argument (``approvals show|decide``) as :func:`action_id` checks an action id: the
    host's ids (``apr_…``) always fit, and an empty one is refused here, in words, instead of sending a request
    for another route (``GET /aip/v1/approvals/`` is answered with a redirect to the approval list).

    Raises:
        argparse.ArgumentTypeError: naming the rule (argparse exits 2).
    """
    return _id_argument(text, "approval id", "the apr_… id of approvals list, ")


def not_blank(text: str) -> str:
    """Check a value that must say something (a stream position, a cursor, a job id): an empty or blank one
    would silently mean "from the start", so it is refused.

    Raises:
        argparse.ArgumentTypeError: naming the rule (argparse exits 2).
    """
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is empty; give a value or leave the option out")
    return text


def integer(low: int, high: int) -> Callable[[str], int]:
    """An integer argument ``low..high``, read as the sidecar's numeric options are (``sidecar.options.int_in``:
    ASCII digits only; argparse's ``type=int`` took ``1_0``, `` 5 ``, ``+5`` and ``-3``).

    Raises (the parser):
        argparse.ArgumentTypeError: naming the value and the rule (argparse exits 2).
    """
    from .sidecar.options import int_in

    parse = int_in(low, high)

    def check(text: str) -> int:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{text!r} {exc}") from None

    return check


def host_url(text: str) -> str:
    """Check a ``--url``: an absolute ``http://`` or ``https://`` URL with a host.

    Raises:
        argparse.ArgumentTypeError: naming the expected form (argparse exits 2).
    """
    parts = urlsplit(text.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an http(s) URL; give the host's base URL with its scheme, "
            "e.g. http://127.0.0.1:8081 or https://aip.example.com"
        )
    return text.strip()
