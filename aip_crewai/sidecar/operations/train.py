"""Operation ``train``: CrewAI training that never reads stdin and writes one artifact.

Input ``{n_iterations, artifact_name, inputs?}``; output ``{"status":
"completed", "artifact_name", "n_iterations"}``; the artifact is written
atomically as exactly ``<ctx.training_dir>/<tenant>/<crew>/<artifact_name>``
(:func:`artifact_dir`: per tenant and crew, so one tenant's artifact never
replaces another's; no ``.pkl`` is appended: name it ``x.pkl`` to get
CrewAI's usual file name).

What CrewAI 1.15.5 does (``crew.py::Crew.train``), and what we change:

- It sets ``human_input=True`` on every task and asks for feedback through
  the context-scoped human-input provider
  (``crewai.core.providers.human_input``: ``get_provider``/``set_provider``/
  ``reset_provider``); the default provider calls ``input()``. We set a
  :class:`FeedbackProvider` for the job's context only: it answers with the
  crew's deployment-configured feedback (:func:`training_feedback`).
- An empty feedback makes CrewAI's final evaluation fail ("Critical training
  data error: Missing fields (human_feedback)",
  ``task_evaluator.py::evaluate_training_data``) after all iterations were
  paid for, so a crew without feedback fails fast with :class:`SafeJobError`.
- It writes ``filename`` (``.pkl`` appended) and always ``training_data.pkl``
  through ``PickleHandler``, which joins relative names to ``os.getcwd()``
  (``utilities/file_handler.py``). We pass an absolute ``filename`` inside a
  job-private directory under the training dir, and redirect the relative
  ``training_data.pkl`` there too with a context-scoped hook on
  ``CrewTrainingHandler.__init__`` (:func:`install_training_path_hook`; the
  process's working directory is never changed, other jobs are unaffected).
  Two train jobs never share a file; the result is renamed into place.

Source: ARCHITECTURE.md §3 (train input), §4 (outputs: train), §5 (never block on
stdin; worker thread; cooperative cancel), §11 (``--training-dir``).
"""

from __future__ import annotations

import contextvars
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from crewai.core.providers.human_input import (
    SyncHumanInputProvider,
    reset_provider,
    set_provider,
)
from crewai.utilities.constants import TRAINING_DATA_FILE
from crewai.utilities.training_handler import CrewTrainingHandler

from aip_crewai.sidecar.jobs.context import JobContext, SafeJobError
from aip_crewai.sidecar.operations._common import check_cancelled, job_scope
from aip_crewai.sidecar.operations._maintenance import crew_option, run_in_worker
from aip_crewai.sidecar.operations.knowledge_query import knowledge_namespace
from aip_crewai.sidecar.operations.startup.crew_checks import refuse_unavailable_knowledge, refuse_unconfigured_llms
from aip_crewai.sidecar.registry import CrewSource
from aip_crewai.sidecar.tenancy import crew_dir_name, tenant_dir_name

#: Name of the crew option holding the training feedback (``_maintenance.crew_option``).
FEEDBACK_OPTION = "training_feedback"
_WORK_PREFIX = ".aip-train-"

_private_dir: contextvars.ContextVar[str | None] = contextvars.ContextVar("aip_crewai_training_work_dir", default=None)


def training_feedback(source: CrewSource) -> str:
    """The crew's configured training feedback (default ``""``)."""
    value = crew_option(source, FEEDBACK_OPTION, "")
    return value if isinstance(value, str) else ""


class FeedbackProvider(SyncHumanInputProvider):
    """Human-input provider answering every prompt with a fixed feedback.

    Never touches stdin or the console. CrewAI calls ``self._prompt_input``
    (``handle_feedback``) and ``self._prompt_input_async``.
    """

    def __init__(self, feedback: str) -> None:
        self.feedback = feedback

    def _prompt_input(self, crew: Any = None) -> str:  # type: ignore[override]
        check_cancelled()
        return self.feedback

    async def _prompt_input_async(self, crew: Any = None) -> str:  # type: ignore[override]
        check_cancelled()
        return self.feedback


def validate_training_dir(path: Path | str) -> None:
    """Check the training directory at sidecar start (when train is allowed).

    Args:
        path: the configured ``--training-dir``.

    Raises:
        ValueError: the path is missing, a symlink, not a directory, or
            group/world-writable.

    Source: ARCHITECTURE.md §11 (``--training-dir``), §5 (state dir permissions).
    """
    p = Path(path)
    try:
        info = p.lstat()
    except FileNotFoundError:
        raise ValueError(f"training directory {str(p)!r} does not exist") from None
    if stat.S_ISLNK(info.st_mode):
        raise ValueError(f"training directory {str(p)!r} is a symlink")
    if not stat.S_ISDIR(info.st_mode):
        raise ValueError(f"training directory {str(p)!r} is not a directory")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ValueError(f"training directory {str(p)!r} is group- or world-writable")


def install_training_path_hook() -> None:
    """Redirect CrewAI's relative ``training_data.pkl`` per context (idempotent).

    Wraps ``CrewTrainingHandler.__init__`` once, process-wide. The wrapper
    changes nothing unless the current context set a private directory
    (:func:`_training_files_in`), so other jobs and CrewAI's own CLI use keep
    CrewAI's behaviour.
    """
    original = CrewTrainingHandler.__init__
    if getattr(original, "_aip_crewai_hook", False):
        return

    def __init__(self: Any, file_name: str) -> None:
        original(self, file_name)
        private = _private_dir.get()
        if private is not None and file_name == TRAINING_DATA_FILE:
            self.file_path = os.path.join(private, os.path.basename(self.file_path))

    __init__._aip_crewai_hook = True  # type: ignore[attr-defined]
    CrewTrainingHandler.__init__ = __init__  # type: ignore[method-assign]


install_training_path_hook()


@contextmanager
def _training_files_in(directory: str) -> Iterator[None]:
    token = _private_dir.set(directory)
    try:
        yield
    finally:
        _private_dir.reset(token)


async def execute(source: CrewSource, input: dict[str, Any], ctx: JobContext) -> dict[str, Any]:
    """Train a fresh crew and store its artifact in the training directory.

    Args:
        source: the crew source (its ``training_feedback`` option is used).
        input: ``{"n_iterations": 1..100, "artifact_name": str, "inputs"?: dict}``.
        ctx: the job context; ``ctx.training_dir`` must be set.

    Returns:
        ``{"status": "completed", "artifact_name": str, "n_iterations": int}``;
        the artifact is ``<training dir>/<tenant>/<crew>/<artifact_name>``
        (:func:`artifact_dir`).

    Raises:
        SafeJobError: train is not configured (no training dir) or the crew
            has no training feedback.
        JobCancelled: the cancel flag was seen before a model call.
        Exception: CrewAI or provider errors, unchanged.
    """
    if ctx.training_dir is None:
        raise SafeJobError("train is not enabled: no training directory is configured", before_any_effect=True)
    n_iterations = int(input["n_iterations"])
    artifact_name = str(input["artifact_name"])
    if Path(artifact_name).name != artifact_name or artifact_name in {".", ".."}:
        raise SafeJobError("artifact_name must be a plain file name", before_any_effect=True)
    feedback = training_feedback(source)
    if not feedback.strip():
        raise SafeJobError(
            f"crew {ctx.crew_id!r} has no training feedback configured "
            f"(option {FEEDBACK_OPTION!r}); CrewAI cannot train without it",
            before_any_effect=True,
        )
    inputs = dict(input.get("inputs") or {})
    training_dir = artifact_dir(Path(ctx.training_dir), ctx.tenant, ctx.crew_id)
    work = tempfile.mkdtemp(prefix=_WORK_PREFIX, dir=training_dir)
    try:
        with job_scope(ctx), knowledge_namespace(ctx.crew_id, ctx.tenant), _training_files_in(work):
            token = set_provider(FeedbackProvider(feedback))
            try:
                result = os.path.join(work, "artifact.pkl")
                await run_in_worker(ctx, _train, source, n_iterations, result, inputs)
            finally:
                reset_provider(token)
        os.chmod(result, 0o600)
        os.replace(result, training_dir / artifact_name)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"status": "completed", "artifact_name": artifact_name, "n_iterations": n_iterations}


def artifact_dir(training_dir: Path, tenant: str, crew_id: str) -> Path:
    """The directory holding the train artifacts of one ``(tenant, crew)`` (created 0700).

    Args:
        training_dir: the configured ``--training-dir``.
        tenant: the job's tenant (``""``: the default tenant, directory ``_default``).
        crew_id: the crew id (a crew id that is no safe file name becomes
            ``crew-<hex>``, see ``tenancy.crew_dir_name``).

    Returns:
        ``<training_dir>/<tenant>/<crew>``; two tenants' ``artifact_name``
        never name the same file.

    Source: docs/security.md ("Tenant-scoped crew state").
    """
    path = training_dir / tenant_dir_name(tenant) / crew_dir_name(crew_id)
    for directory in (path.parent, path):
        directory.mkdir(mode=0o700, exist_ok=True)
    return path


def _train(source: CrewSource, n_iterations: int, filename: str, inputs: dict[str, Any]) -> None:
    """Worker thread: ``crew.train`` of a fresh crew, job's provider, private files."""
    crew = source.job_crew()
    refuse_unconfigured_llms(crew)
    refuse_unavailable_knowledge(crew)
    check_cancelled()
    crew.train(n_iterations=n_iterations, filename=filename, inputs=inputs)
