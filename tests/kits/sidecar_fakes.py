"""A fake executor and app/runtime builders for the sidecar unit tests (no CrewAI).

Crews of the fake (``FAKE_CREWS``):
- ``echo``: emits ``input["chunks"]`` chunks (default 2), returns a CrewOutput-like dict.
- ``slow``: emits one chunk, then waits on ``fake.release`` (asyncio), cancellable at that await.
- ``worker``: a worker thread emitting chunks until ``fake.release_thread`` is set; stops on
  the cancel flag (raising JobCancelled, as the adapter does).
- ``failing``: raises ``RuntimeError`` whose text holds a secret.
- ``safe``: raises ``SafeJobError``.
- ``bulky``: returns ``input["size"]`` bytes of output.
- ``chatty``: emits ``input["chunks"]`` chunks of ``input["chunk_bytes"]`` characters.
- ``bad``: returns a non-JSON value.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx2

from aip_crewai.sidecar.config import Settings
from aip_crewai.sidecar.http.app import create_app
from aip_crewai.sidecar.jobs.context import JobCancelled, JobContext, SafeJobError

SECRET = "sk-live-DO-NOT-LEAK-1234"
TOKEN = "test-token-0123456789"
FAKE_CREWS = ("echo", "slow", "worker", "failing", "safe", "bulky", "chatty", "bad")
ALL_OPERATIONS = ("run", "batch_run", "replay", "train", "test", "knowledge_query", "memory_reset")


def crew_output(action_id: str, raw: str = "done", tasks: int = 1) -> dict[str, Any]:
    return {
        "raw": raw,
        "token_usage": {"total_tokens": 1},
        "tasks_output": [{"task_id": f"task-{action_id}-{i}", "raw": raw} for i in range(tasks)],
        "json_dict": None,
        "pydantic": None,
    }


class FakeExecutor:
    """Records calls; behaviour by crew id (see the module docstring)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict[str, Any]]] = []
        self.contexts: list[JobContext] = []
        self.release = asyncio.Event()
        self.release_thread = threading.Event()
        self.started = asyncio.Event()

    async def __call__(self, crew_id: str, operation: str, input: dict[str, Any], ctx: JobContext) -> Any:
        self.calls.append((crew_id, operation, input))
        self.contexts.append(ctx)
        self.started.set()
        if crew_id == "echo":
            for i in range(input.get("chunks", 2) if operation == "run" else 2):
                ctx.emit_chunk({"content": f"part {i}", "channel": "llm", "task_id": "t", "agent_role": "writer"})
            if operation == "batch_run":
                results = [crew_output(f"{ctx.action_id}-{i}") for i, _ in enumerate(input["inputs"])]
                return {"results": results, "count": len(results)}
            if operation == "knowledge_query":
                return {"results": []}
            if operation == "replay":
                found = await ctx.find_task_run(input["task_id"]) if ctx.find_task_run else None
                return {**crew_output(ctx.action_id), "replayed_from": bool(found)}
            return crew_output(ctx.action_id)
        if crew_id == "slow":
            ctx.emit_chunk({"content": "working", "channel": "llm"})
            await self.release.wait()
            return crew_output(ctx.action_id)
        if crew_id == "worker":
            return await asyncio.to_thread(self._worker, ctx)
        if crew_id == "failing":
            raise RuntimeError(f"provider said: invalid key {SECRET}")
        if crew_id == "safe":
            raise SafeJobError("memory_reset target 'memory' is not initialized", error_type="TargetNotInitialized")
        if crew_id == "bulky":
            return {"raw": "x" * input.get("size", 10)}
        if crew_id == "chatty":
            for i in range(input.get("chunks", 10)):
                ctx.emit_chunk({"content": ("y" * input.get("chunk_bytes", 1)) + str(i), "channel": "llm"})
            return crew_output(ctx.action_id)
        if crew_id == "bad":
            return {"value": object()}
        raise AssertionError(f"unknown fake crew {crew_id}")

    def _worker(self, ctx: JobContext) -> dict[str, Any]:
        sent = 0
        while not self.release_thread.wait(0.005):
            if ctx.cancel_flag.is_set():
                ctx.stop_observed = True
                raise JobCancelled("cancelled")
            if sent < 3:
                ctx.emit_chunk({"content": f"thread {sent}", "channel": "llm"})
                sent += 1
        return crew_output(ctx.action_id)


def make_settings(tmp_path: Path, **overrides: Any) -> Settings:
    base = Settings(
        registry="tests:FAKE",
        journal=tmp_path / "journal.db",
        state_dir=tmp_path,
        token=TOKEN,
        allowed_operations=ALL_OPERATIONS,
        training_dir=tmp_path,
        sse_keepalive_seconds=0.05,
        shutdown_grace_seconds=0.5,
    )
    return replace(base, **overrides)


@asynccontextmanager
async def running_app(tmp_path: Path, **overrides: Any) -> AsyncIterator[tuple[httpx2.AsyncClient, Any, FakeExecutor]]:
    """Yield ``(client, app, fake)``: the app's lifespan runs around the block."""
    fake = FakeExecutor()
    app = create_app(make_settings(tmp_path, **overrides), crews=FAKE_CREWS, executor=fake)
    async with app.router.lifespan_context(app):
        transport = httpx2.ASGITransport(app=app, raise_app_exceptions=False)
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with httpx2.AsyncClient(transport=transport, base_url="http://sidecar", headers=headers) as client:
            yield client, app, fake


def job(
    action_id: str, crew_id: str = "echo", operation: str = "run", input: Any = None, **extra: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "crew_id": crew_id,
        "action_id": action_id,
        "operation": operation,
        "input": {} if input is None else input,
    }
    body.update(extra)
    return body
