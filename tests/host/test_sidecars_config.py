"""Crews sharded over several sidecars: ``[[sidecars]]`` with the crews each serves;
one ``[sidecar]`` stays valid and serves every crew."""

from __future__ import annotations

import pytest
from kits.hostapp import CREWS, HostFiles, base_document

from aip_crewai.host.config import HostConfigError, load_settings

CREW_IDS = [crew["id"] for crew in CREWS]


def document(*entries: dict) -> dict:
    doc = base_document()
    del doc["sidecar"]
    doc["sidecars"] = list(entries)
    return doc


def entry(url: str, crews: list[str], **more: object) -> dict:
    return {"url": url, "token_file": "sidecar.token", "crews": crews, **more}


def load(files: HostFiles, doc: dict):
    files.write(doc)
    return load_settings(files.config, environ={})


def error(files: HostFiles, doc: dict) -> HostConfigError:
    with pytest.raises(HostConfigError) as info:
        load(files, doc)
    return info.value


def test_one_sidecar_table_serves_every_crew(host_files: HostFiles) -> None:
    settings = load(host_files, base_document())
    assert [(s.name, s.url, s.crews) for s in settings.sidecars] == [("sidecar", "http://127.0.0.1:8090", None)]
    assert all(settings.sidecars[0].serves(crew_id) for crew_id in CREW_IDS)


def test_each_crew_is_served_by_the_sidecar_that_lists_it(host_files: HostFiles) -> None:
    first, rest = CREW_IDS[:1], CREW_IDS[1:]
    settings = load(
        host_files,
        document(
            entry("http://127.0.0.1:8090", first, name="eu-1"),
            entry("http://127.0.0.1:8091", rest, keepalive_seconds=2.0),
        ),
    )
    assert [(s.name, s.crews) for s in settings.sidecars] == [
        ("eu-1", frozenset(first)),
        ("sidecar-2", frozenset(rest)),
    ]
    assert settings.sidecars[1].keepalive_s == 2.0 and settings.sidecar_url == "http://127.0.0.1:8090"
    assert settings.sidecars[0].serves(first[0]) and not settings.sidecars[0].serves(rest[0])


def test_a_crew_may_be_served_by_several_sidecars(host_files: HostFiles) -> None:
    """A hot crew on several sidecars (docs/operating.md "Several sidecars"): both entries list it, in order."""
    settings = load(
        host_files,
        document(
            entry("http://127.0.0.1:8090", CREW_IDS, name="a"),
            entry("http://127.0.0.1:8091", CREW_IDS[:1], name="b"),
        ),
    )
    assert [s.name for s in settings.sidecars if s.serves(CREW_IDS[0])] == ["a", "b"]
    assert [s.name for s in settings.sidecars if s.serves(CREW_IDS[1])] == ["a"]


def test_every_admitted_crew_is_served_by_at_least_one_valid_sidecar(host_files: HostFiles) -> None:
    one = "http://127.0.0.1:8090"
    both = base_document()
    both["sidecars"] = [entry(one, CREW_IDS)]
    assert error(host_files, both).key == "sidecar"
    neither = base_document()
    del neither["sidecar"]
    assert error(host_files, neither).key == "sidecar"
    twice = error(host_files, document(entry(one, [*CREW_IDS, CREW_IDS[0]])))  # twice in one entry
    assert twice.key == f"sidecars[0].crews[{len(CREW_IDS)}]" and "twice" in twice.message
    unserved = error(host_files, document(entry(one, CREW_IDS[:1])))
    assert unserved.key == "sidecars" and CREW_IDS[1] in unserved.message
    assert error(host_files, document(entry(one, ["no-such-crew", *CREW_IDS]))).key == "sidecars[0].crews[0]"
    assert (
        error(host_files, document(entry(one, CREW_IDS[:1]), entry("http://example.com", CREW_IDS[1:]))).key
        == "sidecars[1].url"
    )
    assert (
        error(host_files, document(entry(one, CREW_IDS[:1], name="a"), entry(one, CREW_IDS[1:], name="a"))).key
        == "sidecars[1].name"
    )
    assert error(host_files, document(entry(one, []))).key.startswith("sidecars[0]")
