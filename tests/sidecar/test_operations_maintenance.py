"""Tests for replay, train, test, knowledge_query and memory_reset (offline CrewAI, in-process).

Every test runs the operation through the dispatcher
(``operations.execute(source, op, input, ctx)``) with a JobContext built
here (:class:`Jobs`); its ``find_task_run`` is a fake runtime store holding
the outputs of earlier ``run``/``replay`` jobs per crew id. Crews come from
``aip_crewai.examples.testing:CREWS`` and ``aip_crewai.examples.maintenance_crews:CREWS``. No
network: any non-loopback connect fails the test.
"""

from __future__ import annotations

import asyncio
import builtins
import contextvars
import json
import os
import pickle
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import pytest
from kits.poll import until_async

from aip_crewai.sidecar import operations
from aip_crewai.sidecar.jobs.context import InputRejected, JobCancelled, JobContext, SafeJobError
from aip_crewai.sidecar.registry import CrewSource, load_registry

if TYPE_CHECKING:
    from crewai.utilities.evaluators.crew_evaluator_handler import CrewEvaluator

pytestmark = pytest.mark.timeout(180)


# ----------------------------------------------------------------- fixtures


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail any socket connect that is not loopback or a unix socket."""
    real_connect = socket.socket.connect

    def guarded(self: socket.socket, address: Any) -> Any:
        host = address[0] if isinstance(address, tuple) else None
        if self.family == socket.AF_UNIX or host in ("127.0.0.1", "::1", "localhost"):
            return real_connect(self, address)
        raise AssertionError(f"network connection attempted: {address!r}")

    monkeypatch.setattr(socket.socket, "connect", guarded)


class Jobs:
    """Runs operations like the runtime does, with a fake retained-run store.

    ``find_task_run`` of a job of crew C searches only C's finished ``run``
    and ``replay`` jobs (as the runtime's journal does).
    """

    def __init__(self, registry: dict[str, CrewSource], state_dir: Path) -> None:
        self.registry = registry
        self.state_dir = state_dir
        self.retained: dict[str, list[dict[str, Any]]] = {}
        self._ids = iter(range(1_000_000))

    def ctx(self, crew_id: str, operation: str, training_dir: Path | None = None) -> JobContext:
        chunks: list[dict[str, Any]] = []
        return JobContext(
            action_id=f"maint-{next(self._ids)}",
            crew_id=crew_id,
            operation=operation,
            emit_chunk=chunks.append,
            cancel_flag=threading.Event(),
            state_dir=self.state_dir,
            training_dir=training_dir,
            find_task_run=self._finder(crew_id),
            extra={"chunks": chunks},
        )

    def _finder(self, crew_id: str) -> Callable[[str], Any]:
        async def find_task_run(task_id: str) -> dict[str, Any] | None:
            for output in reversed(self.retained.get(crew_id, [])):
                if any(t.get("task_id") == task_id for t in output["tasks_output"]):
                    return output
            return None

        return find_task_run

    def retain(self, crew_id: str, output: dict[str, Any]) -> dict[str, Any]:
        self.retained.setdefault(crew_id, []).append(output)
        return output

    async def call(
        self, crew_id: str, operation: str, payload: dict[str, Any], ctx: JobContext | None = None
    ) -> dict[str, Any]:
        ctx = ctx or self.ctx(crew_id, operation)
        out = await operations.execute(self.registry[crew_id], operation, payload, ctx)
        json.dumps(out)  # every output is JSON-compatible
        if operation in ("run", "replay"):
            self.retain(crew_id, out)
        return out

    async def run(self, crew_id: str, topic: str) -> dict[str, Any]:
        return await self.call(crew_id, "run", {"topic": topic})

    async def replay(self, crew_id: str, task_id: str, topic: str | None = None, **kw: Any) -> dict[str, Any]:
        payload: dict[str, Any] = {"task_id": task_id}
        if topic is not None:
            payload["inputs"] = {"topic": topic}
        return await self.call(crew_id, "replay", payload, **kw)


@pytest.fixture
def jobs(crewai_state_dir: Path) -> Jobs:
    registry = {
        **load_registry("aip_crewai.examples.testing:CREWS"),
        **load_registry("aip_crewai.examples.maintenance_crews:CREWS"),
    }
    return Jobs(registry, crewai_state_dir)


@pytest.fixture
def training_dir(tmp_path: Path) -> Path:
    path = tmp_path / "training"
    path.mkdir(mode=0o700)
    return path


def raws(output: dict[str, Any]) -> list[str]:
    return [t["raw"] for t in output["tasks_output"]]


def task_id(output: dict[str, Any], index: int) -> str:
    return str(output["tasks_output"][index]["task_id"])


class ModelCalls:
    """Counts ``LLMCallStartedEvent`` emitted in the context it was installed in."""

    def __init__(self) -> None:
        from crewai.events.stream_context import add_stream_sink
        from crewai.events.types.llm_events import LLMCallStartedEvent

        self.count = 0
        self._kind = LLMCallStartedEvent
        self._lock = threading.Lock()
        self.token = add_stream_sink(self._sink)

    def _sink(self, _source: Any, event: Any) -> None:
        if isinstance(event, self._kind):
            with self._lock:
                self.count += 1

    def close(self) -> None:
        from crewai.events.stream_context import reset_stream_sinks

        reset_stream_sinks(self.token)


def shared_replay_table() -> list[dict[str, Any]] | None:
    from crewai.memory.storage.kickoff_task_outputs_storage import (
        KickoffTaskOutputsSQLiteStorage,
    )

    return KickoffTaskOutputsSQLiteStorage().load()


# ------------------------------------------------------------------- replay


async def test_replay_reaches_an_older_retained_run_not_only_the_latest(jobs: Jobs) -> None:
    first = await jobs.run("echo", "otters")
    await jobs.run("echo", "badgers")  # the latest kickoff of the crew
    await jobs.run("knowledge_a", "lamps")  # and of the process
    ctx = jobs.ctx("echo", "replay")
    out = await jobs.replay("echo", task_id(first, 1), "otters", ctx=ctx)
    assert raws(out) == [
        "offline-echo: Summarize the topic otters.",  # restored from the retained run
        "offline-echo: Restate the summary of otters.",  # executed again
    ]
    chunks = ctx.extra["chunks"]
    assert len(chunks) == 3  # one model answer (3 chunks): task 0 was not re-run
    assert {c["task_id"] for c in chunks} == {task_id(out, 1)}


async def test_replay_output_ids_are_replayable_again(jobs: Jobs) -> None:
    first = await jobs.run("echo", "moles")
    replayed = await jobs.replay("echo", task_id(first, 0), "voles")
    assert raws(replayed) == [
        "offline-echo: Summarize the topic voles.",
        "offline-echo: Restate the summary of voles.",
    ]
    again = await jobs.replay("echo", task_id(replayed, 1), "shrews")
    assert raws(again) == [
        "offline-echo: Summarize the topic voles.",
        "offline-echo: Restate the summary of shrews.",
    ]


async def test_replay_of_unknown_or_foreign_task_id_is_rejected_without_model_calls(jobs: Jobs) -> None:
    foreign = await jobs.run("knowledge_a", "fog")
    calls = ModelCalls()
    try:
        for unknown in ("no-such-task", task_id(foreign, 0)):  # echo's runs never hold it
            with pytest.raises(InputRejected, match="is not a task of a retained run of this crew"):
                await jobs.replay("echo", unknown, "fog")
    finally:
        calls.close()
    assert calls.count == 0


async def test_replay_without_needed_inputs_is_rejected(jobs: Jobs) -> None:
    first = await jobs.run("echo", "hares")
    with pytest.raises(InputRejected, match=r"needs 'inputs' with \['topic'\]"):
        await jobs.replay("echo", task_id(first, 1))


async def test_replay_never_reads_or_writes_the_shared_replay_table(jobs: Jobs) -> None:
    first = await jobs.run("echo", "newts")
    before = shared_replay_table()
    await jobs.replay("echo", task_id(first, 0), "newts")
    assert shared_replay_table() == before


async def test_replay_survives_kickoff_outputs_reset_and_concurrent_jobs(jobs: Jobs) -> None:
    a = await jobs.run("echo", "alpha")
    b = await jobs.run("echo", "beta")
    out = await jobs.call("echo", "memory_reset", {"command_type": "kickoff_outputs"})
    assert out["reset_targets"] == ["kickoff_outputs"]
    assert not shared_replay_table()  # CrewAI's own replay would now find nothing
    ra, rb, _gamma = await asyncio.gather(  # not `_`: mypy then cannot infer ra and rb
        jobs.replay("echo", task_id(a, 1), "alpha2"),
        jobs.replay("echo", task_id(b, 1), "beta2"),
        jobs.run("echo", "gamma"),  # a kickoff rewriting the shared table meanwhile
    )
    assert raws(ra) == ["offline-echo: Summarize the topic alpha.", "offline-echo: Restate the summary of alpha2."]
    assert raws(rb) == ["offline-echo: Summarize the topic beta.", "offline-echo: Restate the summary of beta2."]


# -------------------------------------------------------------------- train


def load_artifact(path: Path) -> dict[str, Any]:
    return pickle.loads(path.read_bytes())  # noqa: S301 (a file this test made)


async def test_train_writes_only_the_artifact_and_never_reads_stdin(
    jobs: Jobs, training_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)

    def no_stdin(*_args: Any) -> str:
        raise AssertionError("train read standard input")

    monkeypatch.setattr(builtins, "input", no_stdin)
    ctx = jobs.ctx("trainable", "train", training_dir)
    payload = {"n_iterations": 2, "artifact_name": "echo-v1", "inputs": {"topic": "owls"}}
    out = await jobs.call("trainable", "train", payload, ctx=ctx)
    assert out == {"status": "completed", "artifact_name": "echo-v1", "n_iterations": 2}
    artifacts = training_dir / "_default" / "trainable"  # <tenant>/<crew>: the default tenant
    assert os.listdir(training_dir) == ["_default"]
    assert os.listdir(artifacts) == ["echo-v1"]  # no .pkl appended, no work dir left
    assert os.listdir(cwd) == []  # no training_data.pkl in the working directory
    assert (artifacts / "echo-v1").stat().st_mode & 0o777 == 0o600
    data = load_artifact(artifacts / "echo-v1")
    assert set(data) == {"Echo analyst"} and data["Echo analyst"]["suggestions"]
    assert ctx.extra["chunks"]  # the training answers streamed to the job


async def test_two_concurrent_train_jobs_never_collide(
    jobs: Jobs, training_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    names = ["first.pkl", "second.pkl"]
    outs = await asyncio.gather(
        *(
            jobs.call(
                "trainable",
                "train",
                {"n_iterations": 1, "artifact_name": name},
                ctx=jobs.ctx("trainable", "train", training_dir),
            )
            for name in names
        )
    )
    assert [o["artifact_name"] for o in outs] == names
    artifacts = training_dir / "_default" / "trainable"
    assert sorted(os.listdir(artifacts)) == names
    assert all("Echo analyst" in load_artifact(artifacts / name) for name in names)
    assert "training_data.pkl" not in os.listdir(tmp_path)


async def test_train_without_feedback_or_training_dir_fails_before_any_model_call(
    jobs: Jobs, training_dir: Path
) -> None:
    payload = {"n_iterations": 1, "artifact_name": "x"}
    calls = ModelCalls()
    try:
        with pytest.raises(SafeJobError, match="no training feedback configured"):
            await jobs.call("echo", "train", payload, ctx=jobs.ctx("echo", "train", training_dir))
        with pytest.raises(SafeJobError, match="no training directory"):
            await jobs.call("trainable", "train", payload, ctx=jobs.ctx("trainable", "train", None))
    finally:
        calls.close()
    assert calls.count == 0
    assert os.listdir(training_dir) == []


def test_validate_training_dir_rejects_missing_symlink_file_and_shared_dirs(tmp_path: Path) -> None:
    from aip_crewai.sidecar.operations.train import validate_training_dir

    good = tmp_path / "good"
    good.mkdir(mode=0o700)
    validate_training_dir(good)
    with pytest.raises(ValueError, match="does not exist"):
        validate_training_dir(tmp_path / "missing")
    link = tmp_path / "link"
    link.symlink_to(good)
    with pytest.raises(ValueError, match="symlink"):
        validate_training_dir(link)
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        validate_training_dir(afile)
    for mode in (0o770, 0o707, 0o777):
        shared = tmp_path / f"shared{mode:o}"
        shared.mkdir()
        shared.chmod(mode)
        with pytest.raises(ValueError, match="group- or world-writable"):
            validate_training_dir(shared)


# --------------------------------------------------------------------- test


async def test_test_returns_one_score_per_task_per_iteration(jobs: Jobs) -> None:
    out = await jobs.call("trainable", "test", {"n_iterations": 2, "eval_llm": "eval-model"})
    assert (out["status"], out["n_iterations"], out["eval_llm"]) == ("completed", 2, "eval-model")
    scores = out["scores"]
    assert [(s["iteration"], s["task_index"]) for s in scores] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert all(s["quality"] == 8.0 and s["model"] == "eval-model" for s in scores)
    assert all(isinstance(s["execution_duration"], float) for s in scores)


async def test_concurrent_test_jobs_collect_only_their_own_scores(jobs: Jobs) -> None:
    outs = await asyncio.gather(
        *(jobs.call("trainable", "test", {"n_iterations": 2, "eval_llm": f"eval-{i}"}) for i in range(3))
    )
    for i, out in enumerate(outs):
        assert len(out["scores"]) == 4
        assert {s["model"] for s in out["scores"]} == {f"eval-{i}"}


async def test_eval_llm_naming_the_crews_own_model_resolves_offline(jobs: Jobs) -> None:
    """A crew without an eval_llm option reuses its agent LLM of that model name."""
    out = await jobs.call("echo", "test", {"n_iterations": 1, "eval_llm": "offline-echo"})
    assert [s["model"] for s in out["scores"]] == ["offline-echo", "offline-echo"]


def test_score_sink_ignores_events_of_other_sources() -> None:
    """Only CrewTestResultEvents whose source is the job's own test crew count."""
    from crewai.events.stream_context import publish_stream_event
    from crewai.events.types.crew_events import CrewTestResultEvent

    from aip_crewai.sidecar.operations.test import _collect_scores

    class Evaluator:
        iteration = 1

    mine, other = object(), object()
    scores: list[dict[str, Any]] = []
    event = CrewTestResultEvent(quality=5.0, execution_duration=0.1, model="m", crew_name="c")

    def emit_both() -> None:
        # Evaluator stands in for a CrewEvaluator: only its iteration is read
        with _collect_scores(mine, cast("CrewEvaluator", Evaluator()), scores):
            publish_stream_event(other, event)
            publish_stream_event(mine, event)

    contextvars.copy_context().run(emit_both)
    assert [s["quality"] for s in scores] == [5.0]


# ---------------------------------------------------------- knowledge_query


async def query(jobs: Jobs, crew_id: str, text: str, **extra: Any) -> list[dict[str, Any]]:
    out = await jobs.call(crew_id, "knowledge_query", {"query": [text], **extra})
    return out["results"]


async def test_knowledge_query_returns_the_crews_own_match(jobs: Jobs) -> None:
    from aip_crewai.examples.testing import KNOWLEDGE_A_TEXT

    results = await query(jobs, "knowledge_a", "lighthouse lamp")
    assert [r["content"] for r in results] == [KNOWLEDGE_A_TEXT]
    assert set(results[0]) == {"id", "content", "metadata", "score"}


@pytest.mark.parametrize(
    ("crew_id", "own", "other"),
    [
        ("knowledge_a", "lighthouse", "volcano"),
        ("knowledge_b", "volcano", "lighthouse"),
        ("shared_knowledge_x", "glacier", "orchard"),  # both use CrewAI's collection "crew"
        ("shared_knowledge_y", "orchard", "glacier"),
    ],
)
async def test_knowledge_of_two_crews_never_mixes(jobs: Jobs, crew_id: str, own: str, other: str) -> None:
    for warm_up in ("knowledge_a", "knowledge_b", "shared_knowledge_x", "shared_knowledge_y"):
        await query(jobs, warm_up, "anything")  # every crew's texts are embedded
    mixed = "lighthouse lamp volcano crater glacier fjord orchard quince"
    results = await query(jobs, crew_id, mixed, results_limit=10, score_threshold=0.0)
    texts = " ".join(r["content"] for r in results).lower()
    assert own in texts
    assert other not in texts


async def test_knowledge_query_of_a_crew_without_knowledge_is_empty(jobs: Jobs) -> None:
    assert await query(jobs, "echo", "anything") == []


# ------------------------------------------------------------- memory_reset


@pytest.mark.parametrize(
    ("crew_id", "target"),
    [
        ("echo", "memory"),
        ("echo", "knowledge"),
        ("echo", "agent_knowledge"),
        ("memory_a", "knowledge"),
        ("knowledge_a", "agent_knowledge"),
    ],
)
async def test_reset_of_an_uninitialized_target_fails_naming_it(jobs: Jobs, crew_id: str, target: str) -> None:
    with pytest.raises(SafeJobError, match=f"memory_reset target '{target}' is not initialized"):
        await jobs.call(crew_id, "memory_reset", {"command_type": target})


@pytest.mark.parametrize(
    ("crew_id", "targets"),
    [
        ("echo", ["kickoff_outputs"]),
        ("memory_a", ["memory", "kickoff_outputs"]),
        ("knowledge_a", ["kickoff_outputs", "knowledge"]),
        ("agent_knowledge", ["kickoff_outputs", "knowledge", "agent_knowledge"]),
    ],
)
async def test_reset_all_reports_the_targets_it_reset(jobs: Jobs, crew_id: str, targets: list[str]) -> None:
    out = await jobs.call(crew_id, "memory_reset", {"command_type": "all"})
    assert out == {"status": "completed", "command_type": "all", "reset_targets": targets}


@pytest.mark.parametrize(
    ("crew_id", "target"),
    [("memory_a", "memory"), ("knowledge_a", "knowledge"), ("agent_knowledge", "agent_knowledge")],
)
async def test_reset_of_a_single_target_reports_it(jobs: Jobs, crew_id: str, target: str) -> None:
    out = await jobs.call(crew_id, "memory_reset", {"command_type": target})
    assert out == {"status": "completed", "command_type": target, "reset_targets": [target]}


async def test_reset_rejects_an_unknown_command_type(jobs: Jobs) -> None:
    with pytest.raises(InputRejected):
        await jobs.call("echo", "memory_reset", {"command_type": "long_term"})


async def test_memory_reset_clears_only_this_crews_memories(jobs: Jobs) -> None:
    """CrewAI's own reset drops the whole LanceDB table; ours keeps other crews' memories."""
    from aip_crewai.examples.maintenance_crews import memory_a, memory_b
    from aip_crewai.sidecar.operations.knowledge_query import knowledge_namespace

    def fresh(crew_id: str, factory: Callable[[], Any]) -> Any:
        with knowledge_namespace(crew_id):  # as every job builds its crew
            return factory()

    for crew_id, factory, text in (
        ("memory_a", memory_a, "Alpha fact about lighthouses."),
        ("memory_b", memory_b, "Beta fact about volcanoes."),
    ):
        crew = fresh(crew_id, factory)
        crew._memory.remember(text, importance=0.5, categories=["t"], scope="/")
        crew._memory.drain_writes()
    out = await jobs.call("memory_b", "memory_reset", {"command_type": "memory"})
    assert out["reset_targets"] == ["memory"]
    assert fresh("memory_b", memory_b)._memory._storage.count("/crew/maintenance-memory-b") == 0
    assert fresh("memory_a", memory_a)._memory._storage.count("/crew/maintenance-memory-a") >= 1


async def test_knowledge_reset_of_one_crew_leaves_another_crews_collection(jobs: Jobs) -> None:
    from aip_crewai.sidecar.operations.knowledge_query import knowledge_namespace

    with knowledge_namespace("shared_knowledge_y"):
        y = jobs.registry["shared_knowledge_y"].new_crew()  # embeds y's text now
    await jobs.call("shared_knowledge_x", "memory_reset", {"command_type": "knowledge"})
    results = await asyncio.to_thread(y.query_knowledge, ["orchard quince"], 3, 0.0)
    assert results and "orchard" in results[0]["content"]


# ------------------------------------------------------------- cancellation


def synthetic_run(task_ids: list[str], topic: str) -> dict[str, Any]:
    """A retained run of a 2-task crew, as the runtime stores it."""
    texts = [f"Summarize the topic {topic}.", f"Restate the summary of {topic}."]
    entries = [
        {"task_id": tid, "description": text, "raw": f"old answer {i}", "agent": "Echo analyst"}
        for i, (tid, text) in enumerate(zip(task_ids, texts, strict=True))
    ]
    return {"raw": "done", "token_usage": {}, "tasks_output": entries, "json_dict": None, "pydantic": None}


CANCEL_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "replay": ("slow", {"task_id": "slow-task-0", "inputs": {"topic": "tides"}}),
    "train": ("trainable_slow", {"n_iterations": 3, "artifact_name": "cancelled.pkl"}),
    "test": ("trainable_slow", {"n_iterations": 3, "eval_llm": "eval-model"}),
}


@pytest.mark.parametrize("operation", sorted(CANCEL_CASES))
async def test_cancel_flag_stops_the_worker_at_its_next_model_call(
    jobs: Jobs, training_dir: Path, operation: str
) -> None:
    crew_id, payload = CANCEL_CASES[operation]
    jobs.retain("slow", synthetic_run(["slow-task-0", "slow-task-1"], "tides"))
    ctx = jobs.ctx(crew_id, operation, training_dir)
    chunks = ctx.extra["chunks"]
    calls = ModelCalls()  # installed in this context: the job's task and thread inherit it
    try:
        task = asyncio.create_task(jobs.call(crew_id, operation, payload, ctx=ctx))
        await until_async(lambda: len(chunks) >= 1)  # the first model call is streaming
        ctx.cancel_flag.set()
        calls_at_cancel = calls.count
        with pytest.raises(JobCancelled):
            await asyncio.wait_for(task, timeout=60)
    finally:
        calls.close()
    assert ctx.stop_observed is True
    assert calls_at_cancel == 1
    assert calls.count == calls_at_cancel  # no model call after the flag (agent retries blocked)
    assert len(chunks) < 10  # the in-flight 10-chunk answer was cut short
    assert not [f for _dirs, _subs, files in os.walk(training_dir) for f in files]  # a cancelled train leaves no file
