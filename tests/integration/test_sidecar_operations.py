"""replay, train, test, knowledge_query and memory_reset through the real sidecar's HTTP API."""

from __future__ import annotations

import stat

import httpx2
import pytest
from kits.sidecar import post_job, start_with_training_dir

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300), pytest.mark.sidecar_jobs]

OPS = "run,replay,train,test,knowledge_query,memory_reset"


@pytest.fixture
def sidecar(sidecar_factory, tmp_path):
    return start_with_training_dir(sidecar_factory, tmp_path, "aip_crewai.examples.maintenance_crews:CREWS", OPS)


post = post_job


def test_the_five_operations_over_http(sidecar):
    run = post(sidecar, "run-1", "trainable", "run", {"topic": "tides"})
    assert run.status_code == 200, run.text
    tasks = run.json()["tasks_output"]
    assert all(task["task_id"] for task in tasks)

    replay = post(
        sidecar, "replay-1", "trainable", "replay", {"task_id": tasks[-1]["task_id"], "inputs": {"topic": "tides"}}
    )
    assert replay.status_code == 200, replay.text
    assert "tides" in replay.json()["raw"]
    unknown = post(sidecar, "replay-2", "trainable", "replay", {"task_id": "not-a-task"})
    assert unknown.status_code == 422 and "detail" in unknown.json()

    train = post(sidecar, "train-1", "trainable", "train", {"n_iterations": 1, "artifact_name": "model-1"})
    assert train.status_code == 200, train.text
    assert train.json() == {"status": "completed", "artifact_name": "model-1", "n_iterations": 1}
    artifact = sidecar.training_dir / "_default" / "trainable" / "model-1"  # job id without a tenant
    assert artifact.is_file() and stat.S_IMODE(artifact.stat().st_mode) == 0o600
    assert sorted(p.name for p in artifact.parent.iterdir()) == ["model-1"]
    assert not (sidecar.state_dir / "training_data.pkl").exists()

    tested = post(sidecar, "test-1", "trainable", "test", {"n_iterations": 1, "eval_llm": "offline-eval"})
    assert tested.status_code == 200, tested.text
    assert tested.json()["status"] == "completed" and tested.json()["scores"]

    empty = post(sidecar, "kq-1", "trainable", "knowledge_query", {"query": ["anything"]})
    assert empty.status_code == 200 and empty.json() == {"results": []}

    reset = post(sidecar, "mr-1", "memory_a", "memory_reset", {"command_type": "memory"})
    assert reset.status_code == 200, reset.text
    assert reset.json()["reset_targets"] == ["memory"]
    missing = post(sidecar, "mr-2", "trainable", "memory_reset", {"command_type": "memory"})
    assert missing.status_code == 502
    view = httpx2.get(f"{sidecar.base_url}/jobs/mr-2/events", headers=sidecar.headers).json()
    failed = view["events"][-1]["data"]
    assert failed["status"] == "failed" and "'memory'" in failed["message"]
    assert failed["uncertain_outcome"] is False  # refused before anything was reset
