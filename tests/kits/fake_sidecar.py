"""A scripted in-memory sidecar for host unit tests (httpx2.MockTransport).

It speaks the ARCHITECTURE.md §4 routes the host uses and counts executions, so a
test can assert that N requests produced exactly one sidecar job.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx2

from aip_crewai.sse import encode_event


@dataclass
class FakeJob:
    action_id: str
    crew_id: str
    operation: str
    input: Any
    events: list[dict[str, Any]] = field(default_factory=list)
    #: Keys added to (or replacing) this job's view, e.g. ``provider_stop_observed`` or ``error``.
    view_extra: dict[str, Any] = field(default_factory=dict)

    @property
    def status(self) -> str:
        return self.events[-1]["data"].get("status", self.events[-1]["event"]) if self.events else "running"


class FakeSidecar:
    """Executes every admitted job instantly: started, one llm chunk, completed."""

    def __init__(self, token: str = "sidecar-token") -> None:
        self.token = token
        self.health: dict[str, Any] = {"status": "ready"}  # what GET /health answers (tests may add fields)
        self.jobs: dict[str, FakeJob] = {}
        self.executions = 0
        self.requests: list[httpx2.Request] = []
        self.stream_override: bytes | None = None
        self.cancel_status = 200
        self.omit_output = False  # completed events say output_omitted; the view has the output

    def transport(self) -> httpx2.MockTransport:
        return httpx2.MockTransport(self.handle)

    def _admit(self, body: dict[str, Any]) -> FakeJob:
        job = self.jobs.get(body["action_id"])
        if job is None:
            self.executions += 1
            job = FakeJob(body["action_id"], body["crew_id"], body.get("operation", "run"), body.get("input"))
            output: dict[str, Any] = {"raw": f"done:{json.dumps(job.input, sort_keys=True)}", "tasks_output": []}
            if job.operation == "knowledge_query":
                output = {"results": [{"content": "policy"}]}
            job.events = [
                {"event": "started", "sequence": 0, "data": {"status": "running", "operation": job.operation}},
                {"event": "chunk", "sequence": 1, "data": {"content": "working", "channel": "llm"}},
                {"event": "completed", "sequence": 2, "data": output},
            ]
            self.jobs[job.action_id] = job
        return job

    def _sse(self, events: list[dict[str, Any]]) -> httpx2.Response:
        if self.omit_output:
            events = [
                {**e, "data": {"status": "completed", "output_omitted": True, "output_bytes": 9}}
                if e["event"] == "completed"
                else e
                for e in events
            ]
        body = b"".join(encode_event(json.dumps(e), event=e["event"], id=str(e["sequence"])) for e in events)
        return httpx2.Response(200, content=self.stream_override or body, headers={"content-type": "text/event-stream"})

    def _view(self, job: FakeJob) -> dict[str, Any]:
        terminal = job.events[-1]
        output = terminal["data"] if terminal["event"] == "completed" else None
        return {
            "action_id": job.action_id,
            "crew_id": job.crew_id,
            "operation": job.operation,
            "status": terminal["event"] if terminal["event"] in ("completed", "failed", "cancelled") else "running",
            "event_count": len(job.events),
            "output": output,
            **job.view_extra,
        }

    def handle(self, request: httpx2.Request) -> httpx2.Response:
        self.requests.append(request)
        path = request.url.path
        if request.headers.get("authorization") != f"Bearer {self.token}":
            return httpx2.Response(401, json={"detail": "unauthorized"})
        if path == "/health":
            return httpx2.Response(200, json=self.health)
        if path in ("/jobs", "/jobs/stream") and request.method == "POST":
            admitted = self._admit(json.loads(request.content))
            if path == "/jobs":
                return httpx2.Response(200, json=admitted.events[-1]["data"])
            return self._sse(admitted.events)
        parts = path.split("/")
        job = self.jobs.get(parts[2]) if len(parts) > 2 else None
        if job is None:
            return httpx2.Response(404, json={"detail": "unknown job"})
        if len(parts) == 3:
            return httpx2.Response(200, json=self._view(job))
        if parts[3] == "events":
            cursor = int(request.url.params.get("cursor", "0"))
            if "text/event-stream" in request.headers.get("accept", ""):
                return self._sse(job.events[cursor:])
            return httpx2.Response(
                200,
                json={
                    "action_id": job.action_id,
                    "cursor": cursor,
                    "next_cursor": len(job.events),
                    "status": self._view(job)["status"],
                    "events": job.events[cursor:],
                },
            )
        if parts[3] == "cancel":
            if self.cancel_status != 200:
                return httpx2.Response(self.cancel_status, json={"detail": "no"})
            return httpx2.Response(200, json=self._view(job))
        return httpx2.Response(404, json={"detail": "no route"})
