"""An approved action's dispatch takes its first step (its durable ``sent`` write) before the approver's
decision is answered, so the write overlaps the answer (bench/results/HISTORY.md, session 31)."""

from __future__ import annotations

from kits.fake_sidecar import FakeSidecar
from kits.hostapp import SIDECAR_TOKEN, bearer, running, submit_action
from kits.poll import until_async

from aip_crewai.host.http import approvals
from aip_crewai.host.http.state import host_state


async def test_an_approved_actions_sent_write_is_under_way_before_the_decision_is_answered(make_app, monkeypatch):
    order: list[str] = []
    answer = approvals.aip_json

    def answering(*args, **kwargs):
        order.append("answer")
        return answer(*args, **kwargs)

    monkeypatch.setattr(approvals, "aip_json", answering)
    app = make_app(sidecar_transport=FakeSidecar(SIDECAR_TOKEN).transport())
    async with running(app) as http:
        store = host_state(app).actions.store
        update = store.update_action

        async def noting(*args, **kwargs):
            if kwargs.get("dispatch") == "sent":
                order.append("sent")
            return await update(*args, **kwargs)

        monkeypatch.setattr(store, "update_action", noting)
        approval_id = (await submit_action(http, "run_1"))["approval_id"]
        decided = await http.post(
            f"/aip/v1/approvals/{approval_id}/decision",
            headers=bearer("acme-both"),
            json={"decision": "approved", "reason": "ok"},
        )
        assert decided.status_code == 200
        assert order == ["sent", "answer"]
        await until_async(lambda: host_state(app).actions.live.get("acme", "run_1") is None, what="the dispatch to end")
