"""Job-private task-output stores: CrewAI's shared kickoff table is never used.

CrewAI 1.15.5 gives every ``Crew`` (and every ``Crew.copy()``, which
``train``, ``test`` and ``kickoff_for_each`` make) a
``TaskOutputStorageHandler`` that writes each task's output *and the
kickoff inputs* to one SQLite file for the whole storage dir
(``latest_kickoff_task_outputs.db``). In a sidecar serving several tenants
that file is a cross-tenant copy of run inputs outside the journal, with
none of its retention or permissions.

:func:`install` replaces the default of the private attribute
``Crew._task_output_handler`` process-wide, so every crew built afterwards,
copies included, keeps its task outputs in an in-memory
:class:`RetainedRunStore` that lives and dies with the job. Replay seeds
its own store from the journal's retained run (``operations.replay``).

Source: ARCHITECTURE.md §5 (replay storage); crewAI 1.15.5 ``crew.py``
(``_task_output_handler`` PrivateAttr, ``Crew.copy``).
"""

from __future__ import annotations

from typing import Any

from crewai import Crew
from crewai.utilities.task_output_storage_handler import TaskOutputStorageHandler


class RetainedRunStore(TaskOutputStorageHandler):
    """Job-private stand-in for CrewAI's replay table (no SQLite, no sharing).

    Holds CrewAI's record shape, one per task index: ``{"task_id": str,
    "expected_output", "output": {"description", "summary", "raw",
    "pydantic", "json_dict", "output_format", "agent", "messages"},
    "task_index": int, "inputs": dict, "was_replayed": bool}``.
    """

    def __init__(self, records: list[dict[str, Any]]) -> None:  # no super(): no SQLite
        self._records = [dict(r) for r in records]

    def update(self, task_index: int, log: dict[str, Any]) -> None:
        """Record a task execution (CrewAI calls it after every task)."""
        task = log["task"]
        record = {
            "task_id": str(task.id),
            "expected_output": task.expected_output,
            "output": dict(log["output"]),
            "task_index": task_index,
            "inputs": dict(log.get("inputs") or {}),
            "was_replayed": bool(log.get("was_replayed", False)),
        }
        if task_index < len(self._records):
            self._records[task_index] = record
        else:
            self._records.append(record)

    def add(
        self,
        task: Any,
        output: dict[str, Any],
        task_index: int,
        inputs: dict[str, Any] | None = None,
        was_replayed: bool = False,
    ) -> None:
        """Same as :meth:`update` with the arguments spread out."""
        self.update(
            task_index,
            {"task": task, "output": output, "inputs": inputs, "was_replayed": was_replayed},
        )

    def reset(self) -> None:
        """Forget the records of this job only."""
        self._records.clear()

    def load(self) -> list[dict[str, Any]]:
        """Return copies of the records, ordered by task index."""
        return [dict(r) for r in self._records]


def install() -> None:
    """Make :class:`RetainedRunStore` the default task-output store of every new crew.

    Idempotent; affects crews constructed after the call (``Crew`` and its
    subclasses share the private-attribute descriptor), so
    ``crewai_env.import_crewai`` calls it before the registry is loaded and
    before any job runs. A registry template built earlier keeps CrewAI's
    store but is never kicked off; its per-job copies get the private one.

    Raises:
        RuntimeError: this CrewAI version has no ``_task_output_handler``
            private attribute (the storage layout changed; refuse to run
            rather than leak inputs into a shared file).
    """
    attribute = Crew.__private_attributes__.get("_task_output_handler")
    if attribute is None:
        raise RuntimeError("crewai.Crew has no _task_output_handler private attribute")
    if attribute.default_factory is not _empty_store:
        attribute.default_factory = _empty_store


def _empty_store() -> RetainedRunStore:
    return RetainedRunStore([])
