"""The stream output of the ``aip-crewai`` command: ``call --stream`` and ``actions follow``.

:func:`show_stream` prints an AIP stream as it arrives and returns the exit code of its outcome, or
names the command that resumes a stream cut before its result; :func:`follow` is ``actions follow``,
which also says when the host has nothing after ``--last-event-id`` (``204 No Content``: the action
ended at or before that position) and then exits as ``actions result`` does.

Source: docs/reference/cli.md ("Exit codes", ``actions follow``); docs/reference/http-api.md ("Stream positions").
"""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .exit_codes import Exit, of_envelope

if TYPE_CHECKING:
    from .client import AipClient


def follow(client: AipClient, action_id: str, last_event_id: str | None, as_json: bool) -> Exit:
    """``aip-crewai actions follow``: the action's stream from the start, or after ``last_event_id``.

    A stream with no frame (the host's ``204 No Content`` for a position at or past the ``result``
    frame of an ended action) is one line on stderr saying so, then the stored result as ``actions
    result`` prints it, and its exit code (0 completed, 1 failed, 3 cancelled, ...): the same outcome
    a follow from the start would have ended with, never a silent exit 1.

    Raises:
        AipClientError: the host refused the follow or the result (the caller reports it).
        httpx2.TransportError: the host cannot be reached (the caller's exit 7).
    """
    events = iter(client.follow(action_id, last_event_id=last_event_id))
    first = next(events, None)
    if first is not None:
        return show_stream(itertools.chain([first], events), as_json)
    from . import render

    answer = client.result(action_id)
    after = f" after {render.text(last_event_id)}" if last_event_id else ""
    print(
        f"aip-crewai: the stream of {render.text(action_id)} has nothing{after}: the action has ended; "
        f"its result, as {render.command('actions', 'result', action_id)} prints it:",
        file=sys.stderr,
    )
    if as_json:
        print(json.dumps(answer, separators=(",", ":")))
    else:
        for line in render.envelope_lines(answer):
            print(line)
    code = of_envelope(answer)
    return Exit.OK if code is None else code


#: The stream frames that carry an outcome (the error frame is ``aip_error``, docs/reference/http-api.md "Stream frames").
OUTCOME_EVENTS = ("result", "aip_error", "ack")


def show_stream(events: Iterable[tuple[str, dict[str, Any]]], as_json: bool) -> Exit:
    """Print an AIP stream as it arrives; return the exit code of its outcome.

    The last ``result`` decides; without one, the last ``aip_error`` frame,
    then the ``ack`` (docs/reference/cli.md "Exit codes"). A stream that ends without a
    ``result`` (the host shut down, or the connection dropped) says so on
    stderr with the command that resumes it, as does a stream the user stops
    with Ctrl-C (exit 130, 128 + SIGINT, as a shell reports it).
    """
    import httpx2

    from . import render
    from .contracts import display

    outcome: dict[str, Exit] = {}
    action_id, last_id, ended, item = None, None, False, None
    cut: httpx2.TransportError | None = None
    interrupted = False
    try:
        for event, envelope in events:
            ended = ended or event == "result"
            body = envelope.get("body") or {}
            named = (body.get("ack") or body.get("action_result") or body.get("stream_chunk") or {}).get("action_id")
            action_id = envelope.get("correlation_id") or named or action_id
            last_id = envelope.get("_sse_id") or last_id
            if as_json:
                print(json.dumps({"event": event, "envelope": envelope}, separators=(",", ":")), flush=True)
            elif event in ("chunk", "done") and render.chunk_text(envelope):
                labelled = render.batch_item(envelope)
                if labelled is not None and labelled != item:  # batch_run: each item's chunks under its label
                    item = labelled
                    print(f"\n[item {labelled}]", flush=True)
                print(display.escape(render.chunk_text(envelope) or ""), end="", flush=True)
            elif event in OUTCOME_EVENTS:
                print(f"\n[{event}]", flush=True)
                for line in render.envelope_lines(envelope, in_stream=True):
                    print(line)
            code = of_envelope(envelope) if event in OUTCOME_EVENTS else None
            if code is not None:
                outcome[event] = code
            if event == "ack" and code == Exit.PENDING_APPROVAL:
                # The host keeps a pending action's stream open until the decision: stop here (exit 5).
                print(
                    f"aip-crewai: {render.text(action_id)} waits for an approver's decision; then: "
                    f"{render.command('actions', 'follow', action_id, '--last-event-id', last_id or 'sse_0')}",
                    file=sys.stderr,
                )
                return Exit.PENDING_APPROVAL
    except httpx2.TransportError as exc:
        if action_id is None:
            raise  # nothing arrived: "cannot reach" (exit 7), as for any other request
        cut = exc
    except KeyboardInterrupt:  # Ctrl-C: the action goes on at the host; say where to pick the stream up
        interrupted = True
    if not ended and action_id:
        why = (
            "interrupted"
            if interrupted
            else f"the connection to the host was lost ({type(cut).__name__})"
            if cut is not None
            else "the stream ended before the result (the host may be shutting down)"
        )
        resume = ("--last-event-id", last_id) if last_id else ()
        print(
            f"\naip-crewai: {why}; resume with: {render.command('actions', 'follow', action_id, *resume)}",
            file=sys.stderr,
        )
    if interrupted:
        return Exit.INTERRUPTED
    if cut is not None and not ended:
        return Exit.UNREACHABLE
    return outcome.get("result", outcome.get("aip_error", outcome.get("ack", Exit.FAILED)))
