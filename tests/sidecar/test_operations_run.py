"""Tests for the run/batch_run operations and the shared per-job plumbing (offline CrewAI)."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from aip_crewai.sidecar import operations
from aip_crewai.sidecar.jobs.context import JobCancelled
from aip_crewai.sidecar.registry import CrewSource, load_registry

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def registry(crewai_state_dir: Path) -> dict[str, CrewSource]:
    return load_registry("aip_crewai.examples.testing:CREWS")


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


async def _poll(condition, timeout: float = 10.0, interval: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached before the deadline")
        await asyncio.sleep(interval)


def _source(factory) -> CrewSource:
    return CrewSource(crew_id="custom", factory=factory)


async def test_run_echo_returns_serialized_crew_output(registry, make_ctx) -> None:
    ctx, _ = make_ctx()
    out = await operations.execute(registry["echo"], "run", {"topic": "pelicans"}, ctx)
    json.dumps(out)  # JSON-compatible as a whole
    assert set(out) == {"raw", "token_usage", "tasks_output", "json_dict", "pydantic"}
    assert out["raw"] == "offline-echo: Restate the summary of pelicans."
    assert out["token_usage"]["successful_requests"] == 2
    assert out["token_usage"]["total_tokens"] > 0
    tasks = out["tasks_output"]
    assert [t["description"] for t in tasks] == [
        "Summarize the topic pelicans.",
        "Restate the summary of pelicans.",
    ]
    assert all(isinstance(t["task_id"], str) and len(t["task_id"]) == 36 for t in tasks)
    assert len({t["task_id"] for t in tasks}) == 2
    assert all("messages" not in t for t in tasks)
    assert out["json_dict"] is None and out["pydantic"] is None


async def test_run_emits_llm_chunks_attributed_to_tasks(registry, make_ctx) -> None:
    ctx, rec = make_ctx()
    out = await operations.execute(registry["echo"], "run", {"topic": "herons"}, ctx)
    assert len(rec) == 6  # 2 tasks x 3 chunks
    assert {c["channel"] for c in rec.chunks} == {"llm"}
    assert {c["agent_role"] for c in rec.chunks} == {"Echo analyst"}
    assert [c["task_id"] for c in rec.chunks] == [t["task_id"] for t in out["tasks_output"] for _ in range(3)]
    assert "Final Answer: offline-echo: Summarize the topic herons." in rec.text()


async def test_missing_topic_uses_the_documented_default(registry, make_ctx) -> None:
    ctx, _ = make_ctx()
    out = await operations.execute(registry["echo"], "run", {}, ctx)
    assert out["raw"] == "offline-echo: Restate the summary of nothing in particular."


async def test_concurrent_runs_have_zero_cross_job_chunks(crewai_state_dir, make_ctx) -> None:
    from aip_crewai.examples.offline_llm import OfflineLLM
    from aip_crewai.examples.testing import TWO_TASKS, build_crew

    source = _source(lambda: build_crew(OfflineLLM(chunks_per_answer=8, delay_ms=15), TWO_TASKS))
    (ctx_a, rec_a), (ctx_b, rec_b) = make_ctx(), make_ctx()
    started = {"a": threading.Event(), "b": threading.Event()}
    met: list[bool] = []

    def rendezvous(rec, key, other):
        def emit(data):  # called from CrewAI's worker thread
            if not started[key].is_set():
                started[key].set()
                met.append(started[other].wait(timeout=20))
            rec(data)

        return emit

    ctx_a.emit_chunk = rendezvous(rec_a, "a", "b")
    ctx_b.emit_chunk = rendezvous(rec_b, "b", "a")
    out_a, out_b = await asyncio.gather(
        operations.execute(source, "run", {"topic": "albatross"}, ctx_a),
        operations.execute(source, "run", {"topic": "bittern"}, ctx_b),
    )
    # each job's first chunk waited for the other job's first chunk: they overlapped
    assert met == [True, True]
    assert len(rec_a) == len(rec_b) == 16
    assert "albatross" in rec_a.text() and "bittern" not in rec_a.text()
    assert "bittern" in rec_b.text() and "albatross" not in rec_b.text()
    ids_a = {t["task_id"] for t in out_a["tasks_output"]}
    ids_b = {t["task_id"] for t in out_b["tasks_output"]}
    assert {c["task_id"] for c in rec_a.chunks} == ids_a
    assert {c["task_id"] for c in rec_b.chunks} == ids_b
    assert not ids_a & ids_b


async def test_batch_run_uses_a_fresh_crew_per_item(registry, make_ctx) -> None:
    ctx, rec = make_ctx("batch_run")
    topics = ["ibis", "kite", "loon"]
    out = await operations.execute(registry["echo"], "batch_run", {"inputs": [{"topic": t} for t in topics]}, ctx)
    assert out["count"] == 3 and len(out["results"]) == 3
    for topic, result in zip(topics, out["results"], strict=True):
        assert result["raw"] == f"offline-echo: Restate the summary of {topic}."
        assert result["token_usage"]["successful_requests"] == 2  # not cumulative
    task_ids = [t["task_id"] for r in out["results"] for t in r["tasks_output"]]
    assert len(set(task_ids)) == 6  # six tasks of three distinct crews
    assert len(rec) == 18
    assert {c["task_id"] for c in rec.chunks} == set(task_ids)
    # each chunk names its batch item, in input order (the CLI labels the stream with it)
    items = [c["batch_item"] for c in rec.chunks]
    assert items == sorted(items) and set(items) == {0, 1, 2}
    for index, result in enumerate(out["results"]):
        ids = {t["task_id"] for t in result["tasks_output"]}
        assert {c["task_id"] for c in rec.chunks if c["batch_item"] == index} == ids


async def test_batch_run_rejects_a_bad_inputs_list(registry, make_ctx) -> None:
    ctx, _ = make_ctx("batch_run")
    with pytest.raises(ValueError):
        await operations.execute(registry["echo"], "batch_run", {"inputs": [1]}, ctx)


async def test_cancelling_a_slow_run_stops_model_calls(registry, make_ctx, tmp_path, monkeypatch) -> None:
    log = tmp_path / "calls.log"
    monkeypatch.setenv("AIP_CREWAI_TEST_CALL_LOG", str(log))
    ctx, rec = make_ctx()
    task = asyncio.create_task(operations.execute(registry["slow"], "run", {"topic": "owls"}, ctx))
    await _poll(lambda: len(rec) >= 2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ctx.cancel_flag.is_set()
    # the model call in flight (in CrewAI's worker thread) stops at its next chunk
    await _poll(lambda: ctx.stop_observed, timeout=5)
    calls, chunks = _lines(log), len(rec)
    assert calls == 1
    # observe a window of 4 chunk intervals (300 ms each): nothing more happens
    deadline = time.monotonic() + 1.2
    while time.monotonic() < deadline:
        assert _lines(log) == calls and len(rec) == chunks
        await asyncio.sleep(0.05)


async def test_failing_crew_raises_with_the_secret_only_in_the_exception(registry, make_ctx, capsys) -> None:
    """Provider text stays in the exception: not in chunks, root log records or stdout/stderr."""
    from aip_crewai.examples.offline_llm import FAKE_SECRET

    messages: list[str] = []

    class Collect(logging.Handler):  # caplog would also hook muted loggers
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    root = logging.getLogger()
    handler, old_level = Collect(level=logging.DEBUG), root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    ctx, rec = make_ctx()
    try:
        with pytest.raises(RuntimeError) as info:
            await operations.execute(registry["failing"], "run", {}, ctx)
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    assert FAKE_SECRET in str(info.value)
    assert FAKE_SECRET not in json.dumps(rec.chunks)
    assert not [m for m in messages if FAKE_SECRET in m]
    captured = capsys.readouterr()
    assert FAKE_SECRET not in captured.out and FAKE_SECRET not in captured.err


async def test_template_crew_is_never_kicked_off(registry, make_ctx) -> None:
    """Clones keep the template's default-input callback; the template stays pristine."""
    source = registry["echo-template"]
    outs = []
    for topic in ("gannet", "petrel"):
        ctx, _ = make_ctx()
        outs.append(await operations.execute(source, "run", {"topic": topic}, ctx))
    assert [o["raw"] for o in outs] == [
        "offline-echo: Restate the summary of gannet.",
        "offline-echo: Restate the summary of petrel.",
    ]
    # each clone counts only its own tokens (Crew.copy shares LLM objects)
    assert outs[0]["token_usage"] == outs[1]["token_usage"]
    ctx, _ = make_ctx()
    default = await operations.execute(source, "run", {}, ctx)
    assert default["raw"] == "offline-echo: Restate the summary of nothing in particular."
    template = source.template
    assert all(task.output is None for task in template.tasks)
    assert template.tasks[0].description == "Summarize the topic {topic}."


async def test_tool_call_chunks_use_the_tools_channel(registry, make_ctx) -> None:
    ctx, rec = make_ctx()
    out = await operations.execute(registry["tool_user"], "run", {"topic": "terns"}, ctx)
    channels = [c["channel"] for c in rec.chunks]
    assert "tools" in channels and channels[-1] == "llm"
    assert "the text has" in out["raw"]


async def test_chatty_crew_streams_a_thousand_chunks(registry, make_ctx) -> None:
    ctx, rec = make_ctx()
    await operations.execute(registry["chatty"], "run", {"topic": "swifts"}, ctx)
    assert len(rec) == 1000


async def test_unknown_operations_are_rejected(registry, make_ctx) -> None:
    ctx, _ = make_ctx()
    for name in ("nope", "_common", "status", "../run", "Run"):
        with pytest.raises(ValueError, match="unknown operation"):
            await operations.execute(registry["echo"], name, {}, ctx)


async def test_cancel_hook_stops_any_llm_in_worker_threads(crewai_state_dir, make_ctx) -> None:
    """The global before_llm_call hook stops a model that has no cancel check of its own."""
    from crewai.llms.base_llm import BaseLLM

    from aip_crewai.examples.testing import build_crew
    from aip_crewai.sidecar.operations._common import job_scope

    calls: list[int] = []

    class PlainLLM(BaseLLM):
        def call(self, messages: Any, *args: Any, **kwargs: Any) -> str:
            calls.append(1)
            return "Thought: done\nFinal Answer: plain"

    def crew():
        return build_crew(PlainLLM(model="plain"), ["Say {topic}."])

    # outside any job the hook is a no-op
    assert (await asyncio.to_thread(crew().kickoff, {"topic": "x"})).raw == "plain"
    assert calls == [1]
    ctx, _ = make_ctx("replay")
    ctx.cancel_flag.set()
    with job_scope(ctx), pytest.raises(Exception, match="blocked by before_llm_call hook"):
        await asyncio.to_thread(crew().kickoff, {"topic": "y"})
    assert calls == [1] and ctx.stop_observed


async def test_offline_llm_checks_the_cancel_flag_before_calling(crewai_state_dir, make_ctx) -> None:
    from aip_crewai.examples.offline_llm import OfflineLLM
    from aip_crewai.sidecar.operations._common import job_scope

    ctx, _ = make_ctx("train")
    ctx.cancel_flag.set()
    with job_scope(ctx), pytest.raises(JobCancelled):
        OfflineLLM().call("hello")
    assert ctx.stop_observed


async def test_crew_streaming_output_yields_offline_chunks(crewai_state_dir) -> None:
    from crewai.types.streaming import CrewStreamingOutput

    from aip_crewai.examples.testing import echo

    crew = echo()
    crew.stream = True
    streaming = await crew.akickoff(inputs={"topic": "rails"})
    assert isinstance(streaming, CrewStreamingOutput)
    chunks = [chunk async for chunk in streaming]
    assert len(chunks) == 6 and "rails" in "".join(c.content for c in chunks)
    assert streaming.result.raw == "offline-echo: Restate the summary of rails."


async def test_offline_llm_answers_structured_requests(crewai_state_dir) -> None:
    from aip_crewai.examples.offline_llm import OfflineLLM

    class Score(BaseModel):
        quality: float
        suggestions: list[str]
        passed: bool
        level: int | None = None

    result = await OfflineLLM().acall("rate this", response_model=Score)
    assert result == Score(quality=8.0, suggestions=["offline suggestions"], passed=True, level=8)


def test_knowledge_crews_answer_only_their_own_text(registry) -> None:
    a, b = registry["knowledge_a"].new_crew(), registry["knowledge_b"].new_crew()
    hits_a = a.query_knowledge(["lighthouse lamp"])
    assert hits_a and "lighthouse" in hits_a[0]["content"] and hits_a[0]["score"] > 0.35
    assert a.query_knowledge(["volcano crater"]) == []
    assert "volcano" in b.query_knowledge(["volcano crater"])[0]["content"]


def test_to_bounded_json_bounds_depth_items_and_odd_values() -> None:
    from aip_crewai.sidecar.operations._common import to_bounded_json

    class Inner(BaseModel):
        x: int = 1

    nested: Any = "leaf"
    for _ in range(12):
        nested = [nested]
    value = {
        "model": Inner(),
        "many": list(range(500)),
        "deep": nested,
        "nan": math.nan,
        "obj": object,
        1: (1, 2),
        "set": {3},
    }
    out = to_bounded_json(value, max_depth=8, max_items=100)
    json.dumps(out, allow_nan=False)
    assert out["model"] == {"x": 1}
    assert out["many"] == list(range(100))
    assert out["nan"] == "nan" and out["obj"] == str(object)
    assert out["1"] == [1, 2] and out["set"] == [3]
    depth, node = 0, out["deep"]
    while isinstance(node, list):
        depth, node = depth + 1, node[0]
    assert node == "…" and depth == 7


async def test_support_triage_demo_runs_offline_without_network(crewai_state_dir, make_ctx, monkeypatch) -> None:
    """The demo crew (and CrewAI around it) opens no non-loopback connection."""
    import socket

    attempts: list[Any] = []
    real_connect, real_getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def connect(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            attempts.append(address)
        return real_connect(self, address)

    def getaddrinfo(host, *args, **kwargs):
        if host not in ("localhost", "127.0.0.1", "::1", None):
            attempts.append(host)
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.delenv("AIP_CREWAI_DEMO_MODEL", raising=False)
    source = load_registry("aip_crewai.examples.support_triage:CREWS")["support-triage"]
    ctx, rec = make_ctx()
    out = await operations.execute(source, "run", {"customer": "Ann Lee"}, ctx)
    assert attempts == []
    assert len(out["tasks_output"]) == 3
    assert "Ann Lee" in out["raw"] and "charged twice" in out["raw"]
    roles = {c.get("agent_role") for c in rec.chunks}
    assert {"Support triage analyst", "Resolution writer"} <= roles


def test_crewai_environment_is_offline_and_under_the_state_dir(crewai_state_dir) -> None:
    import os
    import stat

    storage = crewai_state_dir.resolve() / "crewai"
    assert os.environ["CREWAI_STORAGE_DIR"] == str(storage)
    assert stat.S_IMODE(storage.stat().st_mode) == 0o700
    for name in ("CREWAI_DISABLE_TELEMETRY", "OTEL_SDK_DISABLED", "CREWAI_DISABLE_VERSION_CHECK"):
        assert os.environ[name] == "true"
    assert os.environ["CREWAI_TRACING_ENABLED"] == "false"
    user = json.loads((storage / ".crewai_user.json").read_text())
    assert user["first_execution_done"] is True and user["trace_consent"] is False
    from crewai_core.paths import db_storage_path

    assert db_storage_path() == str(storage)


async def test_kickoff_inputs_never_reach_crewais_shared_task_output_table(
    registry, make_ctx, crewai_state_dir
) -> None:
    """CrewAI's default store writes inputs to one shared SQLite file; ours stays in the job."""
    from aip_crewai.sidecar.operations._task_outputs import RetainedRunStore

    marker = f"zqx-kickoff-{time.monotonic_ns()}"
    ctx, _ = make_ctx()
    await operations.execute(registry["echo"], "run", {"topic": marker}, ctx)
    ctx, _ = make_ctx("batch_run")
    await operations.execute(registry["echo"], "batch_run", {"inputs": [{"topic": marker + "-b"}]}, ctx)
    leaked = [
        path
        for path in (crewai_state_dir / "crewai").rglob("*")
        if path.is_file() and marker.encode() in path.read_bytes()
    ]
    assert leaked == []
    crew = registry["echo"].new_crew()
    assert isinstance(crew._task_output_handler, RetainedRunStore)
    # train and test kick off a Crew.copy(): the copy is private as well
    assert isinstance(crew.copy()._task_output_handler, RetainedRunStore)
    assert crew.copy()._task_output_handler is not crew._task_output_handler
