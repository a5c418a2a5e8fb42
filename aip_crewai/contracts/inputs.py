"""Per-operation input types and their validation.

Each bound of ARCHITECTURE.md §3 is written once as an ``Annotated`` alias and
reused. Byte lengths are UTF-8 bytes; booleans are never numbers (msgspec is
strict); unknown fields are rejected everywhere except the free-form ``run``
input; the whole encoded input is at most :data:`MAX_INPUT_BYTES`.

Source: ARCHITECTURE.md §3 (per-operation input).
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal
from urllib.parse import quote

import msgspec

from .display import child_path
from .errors import InputTooLarge, InvalidInput

#: Whole encoded input bound, bytes (ARCHITECTURE.md §3).
MAX_INPUT_BYTES = 1_048_576
#: Properties of a run input object (ARCHITECTURE.md §3).
MAX_RUN_PROPERTIES = 512
#: Nesting bound of an input, levels of objects/arrays (the input object itself is level 1). One bound for
#: both processes: the host refuses deeper inputs at submission, so none reaches a sidecar that cannot
#: hash it (docs/security.md "Security").
MAX_INPUT_DEPTH = 64

# Python's ``$`` also matches before a final "\n" (msgspec matches with
# ``re``), so every pattern ends with END, which means end-of-text in both
# Python and ECMAScript (JSON Schema) regexes.
END = r"(?!\n)$"
# Unicode "Cc" control characters: C0, DEL and C1.
NO_CONTROL = r"^[^\x00-\x1f\x7f-\x9f]*" + END
# Action ids travel in URL paths and in the X-AIP-Action-ID header: visible
# ASCII only, no "/" (a non-ASCII id cannot be sent as an HTTP header).
ACTION_ID_PATTERN = r"^[\x21-\x2e\x30-\x7e]+" + END
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f-\x9f]")
#: An RFC 3339 date-time (AIP's ``format: date-time``): date, ``T`` (or ``t``, or a space), time, an optional
#: fraction of 1 to 9 digits, then ``Z`` or a ``+hh:mm`` offset; each field within its range (a day past its
#: month's end, e.g. February 30, is left to ``host/store/records.rfc3339_to_ms``, which refuses it).
RFC3339_PATTERN = (
    r"^(?P<date>[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01]))[Tt ]"
    r"(?P<time>(?:[01][0-9]|2[0-3]):[0-5][0-9]:(?:[0-5][0-9]|60))(?:\.(?P<fraction>[0-9]{1,9}))?"
    r"(?P<offset>[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])" + END
)


def path_segment(value: str) -> str:
    """An id as one percent-encoded URL path segment (pure): ``?``, ``#``, ``%`` and ``/`` escaped, and an id
    of dots alone (``.``, ``..``: a valid action id) as ``%2E``s, which HTTP clients would otherwise resolve
    as a dot segment into another route (``/aip/v1/actions/../result`` is sent as ``/aip/v1/result``)."""
    return quote(value, safe="") if value.strip(".") else "%2E" * len(value)


#: What each pattern of the contracts asks for, in words: a refused value is described by these, never by the
#: regular expression (:func:`plain_rule`).
PATTERN_MEANINGS = {
    ACTION_ID_PATTERN: "visible ASCII characters without '/' (letters, digits and punctuation; no space)",
    NO_CONTROL: "text without control characters",
    RFC3339_PATTERN: "an RFC 3339 timestamp such as 2026-12-02T08:30:00Z",
}


def plain_rule(text: str) -> str:
    """A msgspec validation message with every regular expression of :data:`PATTERN_MEANINGS` replaced by its
    meaning (``Expected `str` matching regex '^[...]' - at `$.id` `` → ``Expected visible ASCII characters
    without '/' ... - at `$.id` ``). Pure."""
    for pattern, meaning in PATTERN_MEANINGS.items():
        for shown in (pattern, pattern.replace("\\", "\\\\")):  # msgspec doubles a pattern's backslashes
            text = text.replace(f"Expected `str` matching regex '{shown}'", f"Expected {meaning}")
    return text


RunActionId = Annotated[
    str,
    msgspec.Meta(
        min_length=1,
        max_length=256,
        pattern=ACTION_ID_PATTERN,
        description="Action id of the target run: 1..256 visible ASCII characters, no '/'.",
    ),
]
Reason = Annotated[str, msgspec.Meta(max_length=2048, description="Free text, at most 2048 characters.")]
Inputs = Annotated[
    dict[str, Any],
    msgspec.Meta(
        max_length=MAX_RUN_PROPERTIES, description="CrewAI kickoff inputs: an object of at most 512 properties."
    ),
]
TaskId = Annotated[
    str,
    msgspec.Meta(
        min_length=1,
        max_length=256,
        pattern=NO_CONTROL,
        description="CrewAI task id from a retained run's tasks_output: 1..256 UTF-8 bytes, no control characters.",
    ),
]
Iterations = Annotated[int, msgspec.Meta(ge=1, le=100, description="Iterations, integer 1..100.")]
ArtifactName = Annotated[
    str,
    msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}" + END, description="Training artifact file name."),
]
EvalLlm = Annotated[
    str, msgspec.Meta(min_length=1, max_length=256, description="Evaluator model name, 1..256 characters.")
]
QueryItem = Annotated[
    str,
    msgspec.Meta(
        min_length=1,
        max_length=4096,
        pattern=NO_CONTROL,
        description="A non-empty query string of at most 4096 UTF-8 bytes, no control characters.",
    ),
]
Cursor = Annotated[int, msgspec.Meta(ge=0, le=100_000, description="Event sequence to start from, 0..100000.")]
ResultsLimit = Annotated[int, msgspec.Meta(ge=1, le=100, description="Maximum results, integer 1..100.")]
ScoreThreshold = Annotated[float, msgspec.Meta(ge=0, le=1, description="Minimum score, number 0..1.")]

#: UTF-8 byte bounds that msgspec (which counts characters) cannot express.
_BYTE_BOUNDS = {"task_id": 256, "query": 4096}


def _check_bytes(field: str, value: str, limit: int) -> None:
    if len(value.encode("utf-8")) > limit:
        raise InvalidInput(f"$.{field}", f"at most {limit} UTF-8 bytes")


class _Input(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Base of the closed input objects."""


class StatusInput(_Input, frozen=True):
    """``status``: read one job's status."""

    run_action_id: RunActionId


class EventsInput(_Input, frozen=True):
    """``events``: read one job's events from ``cursor``."""

    run_action_id: RunActionId
    cursor: Cursor | None = None


class CancelInput(_Input, frozen=True):
    """``cancel``: request cancellation of another run."""

    run_action_id: RunActionId
    reason: Reason | None = None


class BatchRunInput(_Input, frozen=True):
    """``batch_run``: 1..100 input objects, one fresh crew each."""

    inputs: Annotated[list[Inputs], msgspec.Meta(min_length=1, max_length=100)]


class ReplayInput(_Input, frozen=True):
    """``replay``: re-run from one task of a retained run."""

    task_id: TaskId
    inputs: Inputs | None = None

    def __post_init__(self) -> None:
        _check_bytes("task_id", self.task_id, _BYTE_BOUNDS["task_id"])


class TrainInput(_Input, frozen=True):
    """``train``: write ``<training dir>/<artifact_name>``."""

    n_iterations: Iterations
    artifact_name: ArtifactName
    inputs: Inputs | None = None


class TestInput(_Input, frozen=True):
    """``test``: evaluate the crew with ``eval_llm``."""

    __test__ = False  # not a pytest class

    n_iterations: Iterations
    eval_llm: EvalLlm
    inputs: Inputs | None = None


class KnowledgeQueryInput(_Input, frozen=True):
    """``knowledge_query``: query the crew-level knowledge."""

    query: Annotated[list[QueryItem], msgspec.Meta(min_length=1, max_length=100)]
    results_limit: ResultsLimit = 3
    score_threshold: ScoreThreshold = 0.35

    def __post_init__(self) -> None:
        for index, item in enumerate(self.query):
            if len(item.encode("utf-8")) > _BYTE_BOUNDS["query"]:
                raise InvalidInput(f"$.query[{index}]", f"at most {_BYTE_BOUNDS['query']} UTF-8 bytes")


class MemoryResetInput(_Input, frozen=True):
    """``memory_reset``: reset one memory domain, or ``all``."""

    command_type: Literal["memory", "knowledge", "agent_knowledge", "kickoff_outputs", "all"]


#: The run input is the free-form CrewAI inputs object itself.
RunInput = Inputs


def encoded_size(value: Any) -> int:
    """Bytes of ``value`` encoded as compact JSON."""
    return len(msgspec.json.encode(value))


def invalid_input(exc: msgspec.ValidationError) -> InvalidInput:
    """Translate a msgspec validation error (``"<rule> - at `$.path`"``) into
    :class:`InvalidInput` keeping the JSON path."""
    text = plain_rule(str(exc))
    rule, sep, where = text.rpartition(" - at `")
    return InvalidInput(where.rstrip("`"), rule) if sep else InvalidInput("$", text)


def exceeds_depth(value: Any, limit: int = MAX_INPUT_DEPTH) -> bool:
    """Whether decoded JSON ``value`` nests objects/arrays deeper than ``limit``
    levels (a scalar is level 0, ``{}`` level 1): :func:`too_deep` is not None."""
    return too_deep(value, limit) is not None


#: Longest JSON path a depth refusal names, characters (a path of long keys is cut, ending with ``…``).
MAX_SHOWN_PATH = 1024


def too_deep(value: Any, limit: int = MAX_INPUT_DEPTH) -> str | None:
    """The JSON path (``$.a[0].b``, ``$["a b"]``: :func:`~.display.child_path`) of the first object or array,
    in document order, nested deeper than ``limit`` levels (a scalar is level 0, ``{}`` level 1), or None
    when none is. Iterative: no recursion limit is reached however deep the value is. Pure.

    The path is cut at :data:`MAX_SHOWN_PATH` characters.
    """
    stack: list[tuple[Any, int, Any]] = [(value, 1, None)]  # node, its level, its path as (parent's, step)
    while stack:
        node, level, where = stack.pop()
        if isinstance(node, dict):
            steps: Any = reversed(node.items())
        elif isinstance(node, list):
            steps = zip(range(len(node) - 1, -1, -1), reversed(node), strict=True)
        else:
            continue
        if level > limit:
            return _shown_path(where)
        stack.extend((child, level + 1, (where, step)) for step, child in steps if isinstance(child, (dict, list)))
    return None


def too_deep_text(text: bytes, limit: int) -> str | None:
    """:func:`too_deep` of JSON text nested deeper than a decoder goes (msgspec raises RecursionError past
    about 1,000 levels): its strings, brackets, commas and keys scanned, nothing else decoded. None when no
    container is nested deeper than ``limit`` (or a text too broken to tell). Pure."""
    frames: list[list[Any]] = []  # per open container: [is an object, its current key or index]
    expect_key = False
    for match in _JSON_TOKEN.finditer(text):
        token = match.group()
        if token in (b"{", b"["):
            if len(frames) >= limit:  # this container's level is len(frames) + 1
                where: Any = None
                for frame in frames:
                    if frame[1] is None:  # an object without a key before its value: not JSON
                        return None
                    where = (where, frame[1])
                return _shown_path(where)
            frames.append([token == b"{", None if token == b"{" else 0])
            expect_key = token == b"{"
        elif token in (b"}", b"]"):
            if frames:
                frames.pop()
            expect_key = False
        elif token == b",":
            if frames and frames[-1][0]:
                expect_key = True
            elif frames:
                frames[-1][1] += 1
        elif token.startswith(b'"') and expect_key and frames:
            try:
                frames[-1][1] = str(json.loads(token))
            except ValueError:
                frames[-1][1] = token[1:-1].decode("utf-8", "replace")
            expect_key = False
    return None


#: The tokens :func:`too_deep_text` reads: a whole string (escapes included), a bracket, a comma.
_JSON_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{},]', re.DOTALL)


def _shown_path(where: Any) -> str:
    """The JSON path of a ``(parent's, step)`` chain (None: the root ``$``), cut at :data:`MAX_SHOWN_PATH`."""
    steps: list[str | int] = []
    while where is not None:
        where, step = where
        steps.append(step)
    path = "$"
    for step in reversed(steps):
        path = child_path(path, step)
        if len(path) > MAX_SHOWN_PATH:
            return path[: MAX_SHOWN_PATH - 1] + "…"
    return path


def convert_input(input_type: Any, value: Any, *, check_size: bool = True) -> Any:
    """Validate ``value`` (decoded JSON) against ``input_type``.

    Args:
        input_type: one of the types above (the catalogue's ``input_type``).
        value: the decoded JSON input.
        check_size: check the 1 MiB bound first (the sidecar checks it later,
            ARCHITECTURE.md §4 orders 422 and 404 before 413).

    Returns:
        The typed input (a Struct, or a dict for ``run``).

    Raises:
        InputTooLarge: the encoded input exceeds 1 MiB.
        InvalidInput: nested deeper than :data:`MAX_INPUT_DEPTH` (``field``: the path of the first
            container past it, :func:`too_deep`), or any other rule; ``field`` is the JSON path.

    Source: ARCHITECTURE.md §3; docs/security.md "Security" (nesting depth).
    """
    path = too_deep(value)
    if path is not None:
        raise InvalidInput(path, f"nested deeper than {MAX_INPUT_DEPTH} levels of objects and arrays")
    if check_size:
        size = encoded_size(value)
        if size > MAX_INPUT_BYTES:
            raise InputTooLarge(size, MAX_INPUT_BYTES)
    try:
        return msgspec.convert(value, input_type, strict=True)
    except msgspec.ValidationError as exc:
        raise invalid_input(exc) from exc


def has_control_characters(text: str) -> bool:
    """True when ``text`` holds a Unicode ``Cc`` control character."""
    return _CONTROL_RE.search(text) is not None
