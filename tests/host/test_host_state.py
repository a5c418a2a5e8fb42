"""The host app's shared state (docs/ARCHITECTURE.md §2, ``host/http/state.py``): one typed, frozen
``HostState`` set by the lifespan and read by every handler; ``HostSetup`` before it; nothing after."""

from __future__ import annotations

import dataclasses

import pytest
from kits.hostapp import bearer, running

from aip_crewai.host.actions.service import ActionService
from aip_crewai.host.http.state import HostSetup, HostState, host_setup, host_state
from aip_crewai.host.store.store import Store


async def test_the_lifespan_sets_one_frozen_state_and_clears_it(make_app):
    app = make_app()
    setup = host_setup(app)
    assert isinstance(setup, HostSetup) and not isinstance(setup, HostState)
    with pytest.raises(RuntimeError, match="not running"):
        host_state(app)
    async with running(app) as http:
        state = host_state(app)
        assert isinstance(state.store, Store) and isinstance(state.actions, ActionService)
        assert state.settings is setup.settings and state.metrics is setup.metrics
        assert state.authenticator.claims is state.store
        with pytest.raises(dataclasses.FrozenInstanceError):
            state.store = None
        assert (await http.get("/aip/v1/manifest", headers=bearer("acme-invoker"))).status_code == 200
    with pytest.raises(RuntimeError):
        host_state(app)


def test_a_started_state_needs_every_opened_part(make_app):
    with pytest.raises(TypeError):
        HostState.started(host_setup(make_app()), store=None)
