"""What a stored result leaves, on both store engines: usage in the result and a usage row, a signed
receipt for a final result only (a provisional one gets its receipt when corrected), the receipt bound to
the action, its key, its approval and decision proof; usage totals; the usage counters
(host/ledger/sealer.py, host/store/ledger.py, docs/observing.md "Observing actions")."""

import hashlib
import json
from pathlib import Path

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from aip_crewai.contracts.aip import ActionResult
from aip_crewai.contracts.errors import ConnectorTransport
from aip_crewai.host.actions.lifecycle import ActionEvent, policy_hash
from aip_crewai.host.actions.normalize import failed_result
from aip_crewai.host.actions.writer import ActionWriter
from aip_crewai.host.auth.principals import Principal
from aip_crewai.host.ledger import receipts as rc
from aip_crewai.host.ledger.sealer import Sealer, decision_proof_hash
from aip_crewai.host.ledger.usage import parse_pricing
from aip_crewai.host.metrics import Metrics
from aip_crewai.host.store.store import Store

T0 = 1_800_000_000_000
KEY = Ed25519PrivateKey.from_private_bytes(b"\x09" * 32)
USAGE = {
    "total_tokens": 150,
    "prompt_tokens": 100,
    "cached_prompt_tokens": 40,
    "completion_tokens": 50,
    "successful_requests": 3,
}
PRICING = parse_pricing(
    {"models": {"m": {"prompt": "0.15", "completion": "0.60", "cached_prompt": "0.075"}}, "crews": {"triage": "m"}},
    ["triage"],
)
APPROVER = Principal("human:acme", "acme", frozenset({"approver"}))


class Clock:
    def __init__(self) -> None:
        self.ms = T0

    def __call__(self) -> float:
        return self.ms / 1000


@pytest.fixture(params=["sqlite", "postgresql"])
async def env(request: pytest.FixtureRequest, tmp_path: Path):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    location = state / "host.db" if request.param == "sqlite" else request.getfixturevalue("postgres_url")
    clock = Clock()
    store = await Store.open(location, clock=clock)
    metrics = Metrics()
    writer = ActionWriter(store, sealer=Sealer(PRICING, rc.ReceiptKeys(KEY), metrics))
    yield store, writer, clock, metrics
    await store.close()


async def admit(writer, action_id="act_1", *, event=ActionEvent.ADMIT, approval_id=None, operation="run"):
    _, record = await writer.create(
        event,
        "acme",
        action_id,
        "cap:crewai:triage",
        "triage",
        operation,
        '{"topic":"t"}',
        "ab" * 32,
        "svc:acme",
        f"key-{action_id}",
        approval_id=approval_id,
        key_expires_at=T0 + 86_400_000,
    )
    return record


def completed(action_id="act_1"):
    return ActionResult(action_id=action_id, status="completed", output={"raw": "ok", "token_usage": USAGE})


async def test_a_completed_run_carries_usage_and_a_receipt_that_verifies(env):
    store, writer, clock, metrics = env
    await admit(writer)
    clock.ms += 1_500
    record = await writer.finish("acme", "act_1", completed(), "acknowledged")
    result = json.loads(record.result_json)
    assert result["usage"] == {
        "tokens": {"prompt": 100, "completion": 50, "total": 150, "cached": 40, "requests": 3},
        "latency_ms": 1500,
        "cost": {"amount": "0.000042", "currency": "USD", "model": "m"},
    }
    assert result["output"] == {"raw": "ok", "token_usage": USAGE}
    reread = await store.get_action("acme", "act_1")
    assert reread is not None and reread.result_json == record.result_json
    ref = result["receipt"]
    document = await store.get_receipt("acme", ref["id"])
    assert document is not None
    claims = rc.verify(document.encode(), [KEY.public_key()])
    assert json.loads(document)["hash"] == ref["hash"]
    assert claims["action_id"] == "act_1" and claims["tenant"] == "acme" and claims["status"] == "completed"
    assert claims["input_hash"] == "sha256:" + "ab" * 32
    assert claims["idempotency_key_hash"] == "sha256:" + hashlib.sha256(b"key-act_1").hexdigest()
    assert claims["output_hash"] == rc.value_hash(result["output"])
    assert claims["approval_id"] is None and claims["decision_proof_hash"] is None and claims["error_code"] is None
    assert claims["finished_at"] == "2027-01-15T08:00:01.500Z" and claims["accepted_at"] == "2027-01-15T08:00:00.000Z"
    assert await store.get_receipt("globex", ref["id"]) is None  # another tenant's id finds nothing
    text = metrics.render()
    assert 'aip_host_tokens_total{tenant="acme",crew="triage",kind="prompt"} 100' in text
    assert 'aip_host_cost_total{tenant="acme",crew="triage",currency="USD"} 4.2e-05' in text


async def test_a_provisional_failure_gets_no_receipt_until_its_correction_is_final(env):
    store, writer, _, metrics = env
    await admit(writer)
    provisional = failed_result("act_1", ConnectorTransport(uncertain_outcome=True, operation="run"))
    record = await writer.finish("acme", "act_1", provisional, "sent")
    assert "receipt" not in json.loads(record.result_json)
    assert json.loads(record.result_json)["usage"] == {"latency_ms": 0}  # no tokens, no cost
    assert await store.receipts_of_action("acme", "act_1") == []
    assert "aip_host_tokens_total{" not in metrics.render()
    corrected = await writer.correct(record, completed())
    assert corrected is not None
    ref = json.loads(corrected.result_json)["receipt"]
    (document,) = await store.receipts_of_action("acme", "act_1")
    assert rc.verify(document.encode(), [KEY.public_key()])["status"] == "completed"
    assert json.loads(document)["receipt"]["id"] == ref["id"]
    (total,) = await store.usage_totals("acme", 0, T0 + 10_000)
    assert (total.actions, total.prompt, total.cost_picos) == (1, 100, 42_000_000)  # the row was replaced


async def test_the_receipt_binds_the_approval_and_the_hash_of_its_decision_proof(env):
    store, writer, _, _ = env
    record = await admit(writer, event=ActionEvent.REQUEST_APPROVAL, approval_id="apr_1")
    await writer.open_approval(record, policy_hash("acme", "act_1", "cap:crewai:triage", "ab" * 32), T0 + 60_000)
    proof = json.dumps({"signature_base": '"@method": POST\n', "signature": "x"})
    approval, started = await writer.decide(APPROVER, "apr_1", "approved", "ok", T0, proof=proof)
    assert approval is not None and started is not None
    done = await writer.finish("acme", "act_1", completed(), "acknowledged")
    (document,) = await store.receipts_of_action("acme", "act_1")
    claims = rc.verify(document.encode(), [KEY.public_key()])
    assert claims["approval_id"] == "apr_1"
    assert claims["decision_proof_hash"] == decision_proof_hash(proof) == rc.sha256_ref(b'"@method": POST\n')
    assert json.loads(done.result_json)["receipt"]["hash"] == json.loads(document)["hash"]


async def test_a_withdrawn_action_gets_a_receipt_of_its_cancelled_result(env):
    store, writer, _, _ = env
    record = await admit(writer, event=ActionEvent.REQUEST_APPROVAL, approval_id="apr_1")
    await writer.open_approval(record, "ph" * 32, T0 + 60_000)
    cancelled = ActionResult(action_id="act_1", status="cancelled", output={"reason": "withdrawn"})
    assert await writer.withdraw("acme", "act_1", cancelled) is not None
    (document,) = await store.receipts_of_action("acme", "act_1")
    assert rc.verify(document.encode(), [KEY.public_key()])["status"] == "cancelled"


async def test_usage_totals_group_by_crew_and_honour_the_period_edges(env):
    store, writer, clock, _ = env
    for n in range(3):
        await admit(writer, f"act_{n}")
        clock.ms += 1000
        await writer.finish("acme", f"act_{n}", completed(f"act_{n}"), "acknowledged")
    finished = [T0 + 1000, T0 + 2000, T0 + 3000]
    (total,) = await store.usage_totals("acme", finished[0], finished[2])  # [from, to): the last is out
    assert (total.crew_id, total.actions, total.total, total.cost_picos) == ("triage", 2, 300, 84_000_000)
    assert (await store.usage_totals("acme", finished[2], finished[2] + 1))[0].actions == 1
    assert await store.usage_totals("globex", 0, T0 * 2) == []


async def test_an_inline_status_read_carries_the_runs_usage_and_stores_no_usage_row(env):
    store, writer, _, _ = env
    view = {"action_id": "act_1", "status": "completed", "output": {"raw": "ok", "token_usage": USAGE}}
    result = ActionResult(action_id="st_1", status="completed", output=msgspec.Raw(json.dumps(view).encode()))
    created, record = await writer.write_answered(
        writer.answered(
            "acme",
            "st_1",
            "cap:crewai:triage:status",
            "triage",
            "status",
            "{}",
            "cd" * 32,
            "svc:acme",
            result,
            "acknowledged",
        )
    )
    assert created
    stored = json.loads(record.result_json)
    assert stored["usage"]["tokens"]["total"] == 150 and stored["usage"]["cost"]["amount"] == "0.000042"
    assert await store.usage_totals("acme", 0, T0 * 2) == []
    (document,) = await store.receipts_of_action("acme", "st_1")
    assert rc.verify(document.encode(), [KEY.public_key()])["output_hash"] == rc.value_hash(view)
