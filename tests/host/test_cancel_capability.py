"""What the sidecar can cancel: learned from /health, published, and a refused cancel
leaves the job running and followed."""

from __future__ import annotations

import httpx2
import pytest
from kits.fake_sidecar import FakeSidecar
from kits.hostapp import SIDECAR_TOKEN, bearer, running

from aip_crewai.contracts import operations as ops
from aip_crewai.contracts.errors import NotCancellable
from aip_crewai.host.actions.dispatch import Dispatcher, Job
from aip_crewai.host.http.state import host_state
from aip_crewai.host.sidecars.client import SidecarClient
from aip_crewai.host.sidecars.connection import SidecarHttp
from aip_crewai.host.sidecars.readiness import DEFAULT_CANCELLABLE, published_cancellable


@pytest.mark.parametrize(
    "body,expected",
    [
        ({}, DEFAULT_CANCELLABLE),  # a peer sidecar without the field: run and batch_run only
        ({"cancellable_operations": ["run", "train"]}, frozenset({"run", "train"})),
        ({"cancellable_operations": "run"}, DEFAULT_CANCELLABLE),
        ({"cancellable_operations": ["run", 3]}, DEFAULT_CANCELLABLE),
        (None, DEFAULT_CANCELLABLE),
    ],
)
def test_published_cancellable_operations(body, expected) -> None:
    assert published_cancellable(body) == expected


async def test_supports_cancel_follows_what_the_sidecar_publishes(make_app) -> None:
    fake = FakeSidecar(SIDECAR_TOKEN)
    app = make_app(sidecar_transport=fake.transport())

    async def supports_cancel() -> dict[str, bool]:
        await host_state(app).readiness.refresh()
        manifest = (await http.get("/aip/v1/manifest", headers=bearer("acme-invoker"))).json()
        return {cap["id"]: cap["contract"]["execution"]["supports_cancel"] for cap in manifest["capabilities"]}

    async with running(app) as http:
        peer = await supports_cancel()
        fake.health["cancellable_operations"] = ["run", "batch_run", "replay", "train", "test"]
        ours = await supports_cancel()
    assert peer["cap:crewai:beta"] is True and peer["cap:crewai:beta:train"] is False
    assert ours["cap:crewai:beta:train"] is True
    assert ours["cap:crewai:beta:knowledge_query"] is False  # our table: never cancellable


@pytest.mark.parametrize("status", [409, 503])
async def test_a_cancel_the_sidecar_refuses_is_not_cancellable_and_other_failures_are_unconfirmed(status) -> None:
    fake = FakeSidecar(SIDECAR_TOKEN)
    fake.cancel_status = status
    async with httpx2.AsyncClient(
        transport=fake.transport(),
        base_url="http://127.0.0.1:8090",
        headers={"Authorization": f"Bearer {SIDECAR_TOKEN}"},
    ) as http:
        jobs = SidecarHttp.of("http://127.0.0.1:8090", token=SIDECAR_TOKEN, transport=fake.transport())
        dispatcher = Dispatcher(SidecarClient(jobs, max_response_bytes=1 << 20), max_response_bytes=1 << 20)
        await http.post(
            "/jobs",
            json={"crew_id": "beta", "action_id": "acme:act_t", "operation": "train", "input": {}},
            headers={"Idempotency-Key": "k"},
        )
        job = Job("acme", "act_t", "beta", ops.get("train"), {}, "k")
        if status == 409:
            with pytest.raises(NotCancellable) as refused:
                await dispatcher.cancel_remote(job)
            assert refused.value.details["operation"] == "train" and "keeps running" in refused.value.message
        else:
            assert await dispatcher.cancel_remote(job) == (False, {"remote_status": status})  # unconfirmed: why
