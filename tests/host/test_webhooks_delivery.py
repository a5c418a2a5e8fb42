"""Webhook deliveries over a real SQLite store and a real HTTP receiver on loopback (docs/webhooks.md):
events written with their state change, signed per Standard Webhooks (verified with the package), retried
under one webhook-id, refused destinations never connected to, a slow receiver delaying nothing else."""

from __future__ import annotations

import base64
import ipaddress
import json
from pathlib import Path
from typing import Any

import pytest
from kits.poll import until_async
from kits.webhook_receiver import LoopbackOnly, Receiver
from standardwebhooks.webhooks import Webhook

from aip_crewai.contracts.aip import ActionResult
from aip_crewai.contracts.errors import ConnectorRemoteRejected
from aip_crewai.host.actions.lifecycle import ActionEvent, policy_hash
from aip_crewai.host.actions.normalize import failed_result
from aip_crewai.host.actions.writer import ActionWriter
from aip_crewai.host.auth.principals import Principal
from aip_crewai.host.store.store import Store
from aip_crewai.host.webhooks.config import EVENT_TYPES, Endpoint, WebhookSettings, endpoint_id
from aip_crewai.host.webhooks.events import WebhookEvents
from aip_crewai.host.webhooks.sender import WebhookSender, webhook_client

SECRET = "whsec_" + base64.b64encode(b"s" * 32).decode()
T0 = 1_800_000_000_000


def endpoint(url: str, **kw: Any) -> Endpoint:
    values: dict[str, Any] = {
        "events": frozenset(EVENT_TYPES),
        "retry_initial_s": 0.05,
        "retry_max_s": 0.1,
        "timeout_s": 5.0,
    }
    values.update(kw)
    return Endpoint(endpoint_id=endpoint_id("acme", url), tenant="acme", url=url, signer=Webhook(SECRET), **values)


class Counted:
    def __init__(self) -> None:
        self.counts: dict[tuple[str, ...], int] = {}

    def inc(self, value: float = 1, **labels: str) -> None:
        key = tuple(sorted(labels.values()))
        self.counts[key] = self.counts.get(key, 0) + 1


class Metrics:
    def __init__(self) -> None:
        self.actions, self.stream_errors = Counted(), Counted()
        self.webhook_attempts, self.webhook_deliveries = Counted(), Counted()


@pytest.fixture(params=["sqlite", "postgresql"])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> Path | str:
    """A SQLite file, or a fresh database on the suite's PostgreSQL cluster (skipped with one line without it)."""
    if request.param == "sqlite":
        tmp_path.chmod(0o700)
        return tmp_path / "host.db"
    return str(request.getfixturevalue("postgres_url"))


@pytest.fixture
async def store(location: Path | str) -> Any:
    opened = await Store.open(location)  # the real clock: retries come due
    try:
        yield opened
    finally:
        await opened.close()


async def sending(store: Store, settings: WebhookSettings, transport: LoopbackOnly, resolver: Any = None, **kw: Any):
    store.outbox_events = WebhookEvents(settings, {})
    client = webhook_client(transport)
    extra = {"resolver": resolver} if resolver is not None else {}
    sender = WebhookSender(store, settings, client, host_id="h1", poll_s=0.02, metrics=Metrics(), **extra, **kw)
    return sender, client


async def run_action(writer: ActionWriter, action_id: str, result: ActionResult) -> None:
    created, _ = await writer.create(
        ActionEvent.ADMIT, "acme", action_id, "cap:crewai:beta", "beta", "run", '{"topic":"t"}', "h", "inv", None
    )
    assert created
    assert await writer.finish("acme", action_id, result, "acknowledged") is not None


def verified(received: list[tuple[dict[str, str], bytes]]) -> list[dict[str, Any]]:
    hook = Webhook(SECRET)
    return [hook.verify(body, headers) for headers, body in received]


async def test_each_event_type_is_delivered_once_and_verifies(store: Store):
    receiver = await Receiver().start()
    transport = LoopbackOnly()
    settings = WebhookSettings((endpoint(receiver.url),))
    sender, client = await sending(store, settings, transport)
    writer = ActionWriter(store)
    import asyncio

    task = asyncio.create_task(sender.run())
    try:
        # approval.requested and approval.decided
        created, record = await writer.create(
            ActionEvent.REQUEST_APPROVAL,
            "acme",
            "a-1",
            "cap:crewai:beta:memory_reset",
            "beta",
            "memory_reset",
            '{"secret_input":"x"}',
            "h",
            "inv",
            None,
            approval_id="apr-1",
        )
        await writer.open_approval(
            record, policy_hash("acme", "a-1", record.capability_id, "h"), store.now_ms() + 60_000
        )
        decided, started = await writer.decide(
            Principal(id="apv", tenant="acme", roles=frozenset({"approver"})), "apr-1", "approved", "ok", store.now_ms()
        )
        assert decided is not None and started is not None
        await writer.finish(
            "acme", "a-1", ActionResult(action_id="a-1", status="completed", output={"raw": "out"}), "acknowledged"
        )
        await run_action(writer, "a-2", failed_result("a-2", ConnectorRemoteRejected(operation="run")))
        await run_action(writer, "a-3", ActionResult(action_id="a-3", status="cancelled"))
        await until_async(lambda: len(receiver.received) >= 5, what="five deliveries")
        bodies = verified(receiver.received)
        assert sorted(b["type"] for b in bodies) == sorted(EVENT_TYPES)
        by_type = {b["type"]: b for b in bodies}
        assert by_type["approval.requested"]["data"]["request"]["id"] == "apr-1"
        assert (
            "evidence_payload" not in by_type["approval.requested"]["data"]
            or by_type["approval.requested"]["data"]["evidence_payload"] is None
        )
        assert b"secret_input" not in b"".join(body for _, body in receiver.received)
        assert by_type["approval.decided"]["data"]["status"] == "approved"
        assert by_type["action.completed"]["data"]["action_id"] == "a-1"
        assert "output" not in by_type["action.completed"]["data"]
        assert by_type["action.failed"]["data"]["error"]["code"] == ConnectorRemoteRejected.code
        ids = [headers["webhook-id"] for headers, _ in receiver.received]
        assert len(set(ids)) == 5
        # once each: nothing more is sent
        await until_async(lambda: sender.metrics.webhook_deliveries.counts.get(("delivered",)) == 5)
        assert len(receiver.received) == 5
        delivered = await store.list_deliveries("acme")
        assert {d.status for d in delivered} == {"delivered"} and all(d.attempts == 1 for d in delivered)
        assert set(transport.hosts) == {"127.0.0.1"}
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.aclose()
        await receiver.stop()


async def test_500_500_200_is_three_attempts_under_one_webhook_id(store: Store):
    import asyncio

    receiver = await Receiver(statuses=[500, 500]).start()
    transport = LoopbackOnly()
    settings = WebhookSettings((endpoint(receiver.url, events=frozenset({"action.completed"})),))
    sender, client = await sending(store, settings, transport)
    task = asyncio.create_task(sender.run())
    try:
        await run_action(
            ActionWriter(store), "a-1", ActionResult(action_id="a-1", status="completed", output={"raw": "x"})
        )
        (delivery,) = await until_async(lambda: _delivered(store), what="the delivery after two 500s")
        assert delivery.attempts == 3
        assert [a.outcome for a in delivery.history] == ["http_error", "http_error", "delivered"]
        assert [a.status_code for a in delivery.history] == [500, 500, 200]
        assert len(receiver.received) == 3
        assert len({headers["webhook-id"] for headers, _ in receiver.received}) == 1
        assert receiver.received[0][0]["webhook-id"] == delivery.delivery_id
        assert len({body for _, body in receiver.received}) == 1
        verified(receiver.received)
        assert (await store.claim_deliveries("h2", 60_000, 10)) == []  # nothing after
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.aclose()
        await receiver.stop()


async def _delivered(store: Store) -> Any:
    found = await store.list_deliveries("acme", status="delivered")
    return found or None


@pytest.mark.parametrize(
    ("addresses", "reason"),
    [(["169.254.169.254"], "metadata"), (["10.1.2.3"], "private"), (["10.9.9.9", "169.254.169.254"], "private")],
)
async def test_names_resolving_to_metadata_or_private_addresses_are_refused_without_a_connection(
    store: Store, addresses: list[str], reason: str
):
    import asyncio

    asked: list[tuple[str, int]] = []

    async def resolver(host: str, port: int) -> list[str]:
        asked.append((host, port))
        return addresses

    transport = LoopbackOnly()
    url = "https://hooks.example.invalid/aip"
    settings = WebhookSettings((endpoint(url, events=frozenset({"action.completed"}), deadline_s=3600),))
    sender, client = await sending(store, settings, transport, resolver)
    try:
        await run_action(ActionWriter(store), "a-1", ActionResult(action_id="a-1", status="completed"))
        assert await sender.step() == 1
        await until_async(lambda: sender.metrics.webhook_attempts.counts.get(("refused",)), what="a refusal")
        assert asked == [("hooks.example.invalid", 443)]
        assert transport.hosts == []  # never connected anywhere
        (delivery,) = await store.list_deliveries("acme")
        assert delivery.status == "pending" and delivery.history[0].outcome == "refused"
    finally:
        await client.aclose()
        await asyncio.sleep(0)


async def test_an_allowed_cidr_lets_a_private_destination_through_the_check(store: Store):
    from aip_crewai.host.webhooks.safety import checked_address, refusal

    allow = (ipaddress.ip_network("10.1.0.0/16"),)

    async def resolver(host: str, port: int) -> list[str]:
        return ["10.1.2.3"]

    assert await checked_address("h.example", 443, resolver, allow) == ("10.1.2.3", "")
    assert await checked_address("h.example", 443, resolver, ()) == (None, "private")
    assert refusal(ipaddress.ip_address("::ffff:169.254.169.254"), ()) == "metadata"
    assert refusal(ipaddress.ip_address("127.0.0.1"), ()) is None
    assert refusal(ipaddress.ip_address("fe80::1"), ()) == "link_local"
    assert refusal(ipaddress.ip_address("224.0.0.1"), ()) == "multicast"
    assert refusal(ipaddress.ip_address("100.64.0.1"), ()) == "private"
    assert refusal(ipaddress.ip_address("93.184.216.34"), ()) is None


async def test_a_slow_receiver_delays_neither_the_action_nor_another_tenants_delivery(store: Store):
    import asyncio

    slow = Receiver(release=asyncio.Event())
    await slow.start()
    fast = await Receiver().start()
    transport = LoopbackOnly()
    slow_end = endpoint(slow.url, events=frozenset({"action.completed"}), timeout_s=30)
    fast_end = Endpoint(
        endpoint_id=endpoint_id("globex", fast.url),
        tenant="globex",
        url=fast.url,
        signer=Webhook(SECRET),
        events=frozenset({"action.completed"}),
    )
    settings = WebhookSettings((slow_end, fast_end))
    sender, client = await sending(store, settings, transport)
    task = asyncio.create_task(sender.run())
    writer = ActionWriter(store)
    try:
        await run_action(writer, "a-1", ActionResult(action_id="a-1", status="completed"))
        await until_async(lambda: len(slow.received) == 1, what="the slow receiver holding a delivery")
        # the next action of the slow tenant is stored at once, and another tenant's event goes out
        await run_action(writer, "a-2", ActionResult(action_id="a-2", status="completed"))
        created, _ = await writer.create(
            ActionEvent.ADMIT, "globex", "g-1", "cap:crewai:gamma", "gamma", "run", "{}", "h", "inv", None
        )
        await writer.finish("globex", "g-1", ActionResult(action_id="g-1", status="completed"), "acknowledged")
        await until_async(lambda: len(fast.received) == 1, what="the other tenant's delivery")
        assert json.loads(slow.received[0][1])["data"]["action_id"] == "a-1"  # still held, the action stored
        slow.release.set()  # type: ignore[union-attr]
        await until_async(lambda: _all_delivered(store, "acme", 2), what="the slow tenant's events")
    finally:
        slow.release.set()  # type: ignore[union-attr]
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.aclose()
        await slow.stop()
        await fast.stop()


async def _all_delivered(store: Store, tenant: str, count: int) -> bool:
    return len(await store.list_deliveries(tenant, status="delivered")) == count


async def test_events_of_one_action_are_claimed_in_order_and_one_host_at_a_time(store: Store):
    """Two events of one action: the second is not due while the first is pending; a claim held by one
    host is not given to another until it expires (the database's clock)."""
    settings = WebhookSettings((endpoint("http://127.0.0.1:9/hook"),))
    store.outbox_events = WebhookEvents(settings, {})
    writer = ActionWriter(store)
    created, record = await writer.create(
        ActionEvent.REQUEST_APPROVAL,
        "acme",
        "a-1",
        "cap:crewai:beta:memory_reset",
        "beta",
        "memory_reset",
        "{}",
        "h",
        "inv",
        None,
        approval_id="apr-1",
    )
    await writer.open_approval(record, policy_hash("acme", "a-1", record.capability_id, "h"), store.now_ms() + 60_000)
    await writer.decide(
        Principal(id="apv", tenant="acme", roles=frozenset({"approver"})), "apr-1", "denied", "no", store.now_ms()
    )
    (first,) = await store.claim_deliveries("h1", 60_000, 10)
    assert first.event_type == "approval.requested"
    assert await store.claim_deliveries("h2", 60_000, 10) == []  # held by h1; the next waits for it
    now = store.now_ms()
    assert (
        await store.finish_attempt(
            first, "h2", status="delivered", outcome="delivered", status_code=200, started_at=now, duration_ms=1
        )
        is None
    )  # not h2's claim: nothing written
    assert (
        await store.finish_attempt(
            first, "h1", status="delivered", outcome="delivered", status_code=200, started_at=now, duration_ms=1
        )
        == "delivered"
    )
    (second,) = await store.claim_deliveries("h2", 60_000, 10)
    assert second.event_type == "approval.decided"
    # the denial failed the action (action.failed): still behind the approval.decided that h2 holds
    assert await store.claim_deliveries("h1", 1, 10) == []


async def test_an_expired_claim_is_taken_by_another_host_and_a_past_deadline_expires(store: Store):
    settings = WebhookSettings(
        (endpoint("http://127.0.0.1:9/hook", events=frozenset({"action.completed"}), deadline_s=1),)
    )
    store.outbox_events = WebhookEvents(settings, {})
    await run_action(ActionWriter(store), "a-1", ActionResult(action_id="a-1", status="completed"))
    (claimed,) = await store.claim_deliveries("dead-host", 1, 10)  # a claim of 1 ms: the host "dies"
    (taken,) = await until_async(lambda: store.claim_deliveries("h2", 60_000, 10), what="the takeover")
    assert taken.delivery_id == claimed.delivery_id
    now = store.now_ms()
    assert (
        await store.finish_attempt(
            taken,
            "h2",
            status="pending",
            outcome="http_error",
            status_code=500,
            started_at=now,
            duration_ms=1,
            retry_in_ms=5_000,
        )
        == "expired"
    )  # the next attempt would be past the 1 s deadline
    (delivery,) = await store.list_deliveries("acme")
    assert delivery.status == "expired" and delivery.attempts == 1


async def test_a_restarted_host_takes_its_own_claims_back_at_once(store: Store):
    """A host killed (or stopped) mid-attempt left its claims, which kept its deliveries waiting for the claim
    to expire (the longest timeout + 30 s) after a restart under the same host id. The new process's sender
    releases its own id's claims as it starts and delivers at once; another host's claim stays."""
    import asyncio

    receiver = await Receiver().start()
    settings = WebhookSettings((endpoint(receiver.url, events=frozenset({"action.completed"})),))
    sender, client = await sending(store, settings, LoopbackOnly())
    await run_action(ActionWriter(store), "a-1", ActionResult(action_id="a-1", status="completed"))
    await run_action(ActionWriter(store), "a-2", ActionResult(action_id="a-2", status="completed"))
    mine, theirs = await store.claim_deliveries("h1", 600_000, 1), await store.claim_deliveries("h2", 600_000, 1)
    assert len(mine) == len(theirs) == 1  # the dead process's claim (h1, this host) and a live peer's (h2)
    task = asyncio.create_task(sender.run())
    try:

        async def statuses() -> dict[str, str] | None:
            found = {d.delivery_id: d.status for d in await store.list_deliveries("acme")}
            return found if found[mine[0].delivery_id] == "delivered" else None

        found = await until_async(statuses, timeout=10, what="the taken-back delivery recorded")
        assert found[theirs[0].delivery_id] == "pending" and len(receiver.received) == 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.aclose()
        await receiver.stop()


async def test_two_hosts_on_one_postgresql_store_deliver_each_event_once(postgres_url: str):
    """Two stores on one PostgreSQL database, each with its own sender (host ids h1, h2), deliver every
    event: each webhook-id is answered 2xx exactly once, also for the events whose first attempts failed
    (their retries may be claimed by either host)."""
    import asyncio

    events, failing = 24, 6
    receiver = await Receiver(statuses=[500] * failing).start()
    settings = WebhookSettings((endpoint(receiver.url, events=frozenset({"action.completed"})),))
    stores = [await Store.open(postgres_url), await Store.open(postgres_url)]
    senders, clients = [], []
    for host_id, opened in zip(("h1", "h2"), stores, strict=True):
        opened.outbox_events = WebhookEvents(settings, {})
        client = webhook_client(LoopbackOnly())
        clients.append(client)
        senders.append(WebhookSender(opened, settings, client, host_id=host_id, poll_s=0.02, metrics=Metrics()))
    tasks = [asyncio.create_task(s.run()) for s in senders]
    try:
        writers = [ActionWriter(s) for s in stores]
        for n in range(events):  # written through both hosts
            await run_action(writers[n % 2], f"a-{n}", ActionResult(action_id=f"a-{n}", status="completed"))
        await until_async(lambda: _all_delivered(stores[0], "acme", events), what="every event delivered")
        answered_2xx = [headers["webhook-id"] for headers, _ in receiver.received[failing:]]
        assert len(answered_2xx) == len(set(answered_2xx)) == events  # once each
        assert len({headers["webhook-id"] for headers, _ in receiver.received}) == events
        verified(receiver.received)
        listed = await stores[1].list_deliveries("acme", limit=events + 1)
        assert sum(d.attempts for d in listed) == events + failing
        assert {a.host_id for d in listed for a in d.history} <= {"h1", "h2"}
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for client in clients:
            await client.aclose()
        for opened in stores:
            await opened.close()
        await receiver.stop()


class _IdleStore:
    """A store with nothing due: the sender's loop only waits."""

    def __init__(self) -> None:
        self.claims = 0

    async def claim_deliveries(self, host_id: str, claim_ms: int, limit: int) -> list[Any]:
        self.claims += 1
        return []

    async def release_claims(self, host_id: str) -> int:
        return 0


async def test_a_sender_cancelled_as_a_wake_up_completes_stops():
    """The race behind a test hanging until pytest-timeout (and a host's shutdown waiting forever): a
    delivery ends (waking the loop) just as the sender is cancelled. Python 3.11's ``asyncio.wait_for``
    swallowed that cancellation; the sender's wait must not."""
    import asyncio

    idle = _IdleStore()
    sender = WebhookSender(idle, WebhookSettings(()), webhook_client(LoopbackOnly()), host_id="h1", poll_s=60)
    try:
        for _ in range(3):
            task = asyncio.create_task(sender.run())
            await asyncio.sleep(0)  # the loop claims (nothing) and waits for a wake-up
            assert idle.claims > 0
            sender.wake()
            await asyncio.sleep(0)  # the wake-up's waiter completes; the loop has not resumed yet
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=30)
            assert done == {task} and task.cancelled()
    finally:
        await sender.client.aclose()


async def test_an_attempt_is_bounded_by_its_endpoint_timeout_alone():
    """``timeout_seconds`` bounds an attempt whole (0.1 .. 60 s, docs/webhooks.md): the client sets no phase
    timeout of its own. It used to carry httpx's default 5 s, so a receiver answering after 7 s timed out on
    every attempt under ``timeout_seconds = 20``."""
    import httpx2

    seen: list[dict[str, Any]] = []

    def answer(request: httpx2.Request) -> httpx2.Response:
        seen.append(request.extensions["timeout"])
        return httpx2.Response(204)

    client = webhook_client(httpx2.MockTransport(answer))
    try:
        await client.post("https://receiver.example/hook", content=b"{}")
    finally:
        await client.aclose()
    assert seen == [{"connect": None, "read": None, "write": None, "pool": None}]


@pytest.mark.parametrize(
    ("address", "allow", "reason"),
    [
        ("fec0::1", (), "private"),  # IPv6 site-local (fec0::/10), passed before
        ("feff:ffff::1", (), "private"),
        ("2002:a9fe:a9fe::", (), "metadata"),  # 6to4 embedding 169.254.169.254, passed before
        ("2002:a9fe:1::", (), "link_local"),
        ("2002:a00:1::", (), "private"),
        ("2002:6440:1::", (), "private"),  # 100.64.0.1, carrier-grade NAT
        ("2002:a00:1::", ("10.0.0.0/8",), None),  # the embedded address is judged with the allow list too
        ("2002:5db8:d822::1", (), None),  # 6to4 embedding a public 93.184.216.34 stays allowed
        ("2001:0:4136:e378:8000:63bf:5601:5601", (), "private"),  # Teredo (client 169.254.169.254)
        ("2001:0:4136:e378:8000:63bf:a247:27dd", (), "private"),  # Teredo, even with both ends public
    ],
)
async def test_site_local_and_addresses_embedding_ipv4_are_judged_as_what_they_reach(address, allow, reason):
    """docs/webhooks.md "Safety": site-local is private; a 6to4 address is judged as the IPv4 address it
    embeds and Teredo is private, at connect time, for a literal URL host and a resolved name alike."""
    from aip_crewai.host.webhooks.safety import checked_address, refusal

    networks = tuple(ipaddress.ip_network(n) for n in allow)
    assert refusal(ipaddress.ip_address(address), networks) == reason

    async def resolver(host: str, port: int) -> list[str]:
        return [address]

    expected = (address, "") if reason is None else (None, reason)
    assert await checked_address(f"[{address}]", 443, resolver, networks) == expected
    assert await checked_address("h.example", 443, resolver, networks) == expected
