"""The inputs of completed runs, kept for ``replay``: one private file per job, outside the journal.

CrewAI's own replay keeps a run's inputs; without them a replay of an older
run needs the caller to send ``inputs`` again. Crew inputs are kept out of
the journal (it holds hashes, outputs and events, never inputs), so each
completed run, batch_run or replay job that had inputs gets one file
``<state dir>/replay-inputs/<64 hex of SHA-256 of the job id>.json``: mode
0600 in a 0700 directory, ``{"<result index or -1>": {inputs}}``. The file
lives as long as the job is retained and is removed when the job is
archived. Nothing here logs the inputs (sizes only).

Written in two steps around the job's terminal commit
(:meth:`~.terminal.TerminalRecorder.record_outcome`): :meth:`ReplayInputs.place`
(temporary file, rename) before the commit, so a replay that finds the
committed run finds its inputs; :meth:`ReplayInputs.sync` (fsync of the
file and of its directory) beside the commit, both finished before the job's followers are told it ended. A
crash between the two can leave the file empty or missing: :meth:`read`
then answers None and that replay needs ``inputs`` (docs/security.md
"Tenant-scoped crew state").

Source: docs/security.md ("Tenant-scoped crew state": replay).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger(__name__)

#: Directory under the state directory.
DIRECTORY = "replay-inputs"


class ReplayInputs:
    """Per-job input files under ``<state dir>/replay-inputs`` (blocking I/O: call from a worker thread).

    Args:
        state_dir: the sidecar state directory; the subdirectory is created
            with mode 0700 on first write.
    """

    def __init__(self, state_dir: Path) -> None:
        self.directory = Path(state_dir) / DIRECTORY

    def path(self, action_id: str) -> Path:
        """The file of one job (its name never shows the job id)."""
        return self.directory / (hashlib.sha256(action_id.encode("utf-8")).hexdigest() + ".json")

    def place(self, action_id: str, inputs: dict[int | None, dict[str, Any]]) -> bool:
        """Keep a job's inputs, by result index (None: the job's own output; a batch item's index): the
        file written under a temporary name and renamed into place, not yet fsynced (:meth:`sync`).

        Returns:
            True when in place; False when the file could not be written
            (logged with the error class only; a replay then needs ``inputs``).
        """
        data = json.dumps(
            {str(-1 if k is None else k): v for k, v in inputs.items()}, separators=(",", ":"), sort_keys=True
        ).encode("utf-8")
        target = self.path(action_id)
        temporary = target.with_suffix(".tmp")
        try:
            self.directory.mkdir(mode=0o700, exist_ok=True)
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
            os.replace(temporary, target)
        except (OSError, TypeError, ValueError) as exc:
            log.error(
                "replay_inputs_not_kept", action_id=action_id, error_type=type(exc).__name__, size_bytes=len(data)
            )
            return False
        return True

    def sync(self, action_id: str) -> bool:
        """Flush a placed file to disk, then its directory (which holds the rename), each with fsync.
        Returns False when it could not be (logged, error class only)."""
        try:
            for path, flags in ((self.path(action_id), os.O_NOFOLLOW), (self.directory, os.O_DIRECTORY)):
                fd = os.open(path, os.O_RDONLY | flags)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        except OSError as exc:
            log.error("replay_inputs_not_synced", action_id=action_id, error_type=type(exc).__name__)
            return False
        return True

    def read(self, action_id: str, result_index: int | None) -> dict[str, Any] | None:
        """The kept inputs of one run (or batch item), or None when none were kept."""
        try:
            data = json.loads(self.path(action_id).read_bytes())
        except (OSError, ValueError):
            return None
        value = data.get(str(-1 if result_index is None else result_index)) if isinstance(data, dict) else None
        return value if isinstance(value, dict) else None

    def remove(self, action_id: str) -> None:
        """Delete a job's file (archive); a missing file is fine."""
        try:
            self.path(action_id).unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.error("replay_inputs_not_removed", action_id=action_id, error_type=type(exc).__name__)
