"""Changes committed on a shared PostgreSQL store are pushed to followers on every host:
chunks and results stored by one Store wake the signal another host's listener holds, at commit."""

from __future__ import annotations

import asyncio

from aip_crewai.host.store.notify import RemoteChanges, listen, payload
from aip_crewai.host.store.store import Store

T0 = 1_790_000_000_000


def test_a_payload_names_the_tenant_and_the_action_and_only_followed_actions_are_woken() -> None:
    async def scenario() -> None:
        changes = RemoteChanges()
        followed = changes.signal("acme", "act_1")
        changes.deliver(payload("acme", "act_2"))
        changes.deliver(payload("globex", "act_1"))
        assert followed.version == 0
        changes.deliver(payload("acme", "act_1"))
        assert followed.version == 1

    asyncio.run(scenario())


async def test_chunks_and_results_committed_by_one_host_wake_another_hosts_follower(postgres_url: str) -> None:
    writer = await Store.open(postgres_url, clock=lambda: T0 / 1000, owner="host-a")
    changes = RemoteChanges()
    stop = listen(postgres_url, changes, asyncio.get_running_loop())
    try:
        await asyncio.wait_for(changes.listening().wait(), 20)
        await writer.create_action("acme", "act_1", "cap:crewai:alpha", "alpha", "run", "{}", "h", "p", "k", "running")
        signal = changes.signal("acme", "act_1")
        seen = signal.version
        await writer.append_chunks("acme", "act_1", [(0, '{"kind":"data"}')])
        assert await signal.wait(10, seen=seen)
        seen = signal.version
        await writer.update_action("acme", "act_1", from_statuses=["running"], status="completed", result_json="{}")
        assert await signal.wait(10, seen=seen)
    finally:
        await asyncio.to_thread(stop)
        await writer.close()


async def test_a_sqlite_store_sends_nothing(tmp_path) -> None:
    tmp_path.chmod(0o700)
    store = await Store.open(tmp_path / "host.db", clock=lambda: T0 / 1000)
    try:
        assert store.url is None
        await store.create_action("acme", "act_1", "cap:crewai:alpha", "alpha", "run", "{}", "h", "p", None, "running")
        assert await store.append_chunks("acme", "act_1", [(0, "{}")]) == 1
    finally:
        await store.close()
