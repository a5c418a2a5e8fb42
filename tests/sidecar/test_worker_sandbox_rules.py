"""The worker sandbox's pure rules (``isolation/sandbox.py``): the complement of the protected paths, the plan,
the report, reachability; and the settings of ``--worker-user`` and the inline token's removal."""

from __future__ import annotations

import os
import stat
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aip_crewai.sidecar.config import INLINE_TOKEN_ENV, ConfigError, load_settings, scrub_environment
from aip_crewai.sidecar.isolation import sandbox

TREE = {
    "/": [("etc", "dir"), ("srv", "dir"), ("bin", "link"), ("vmlinuz", "file")],
    "/etc": [("ssl", "dir"), ("hosts", "file"), ("aip", "dir")],
    "/etc/aip": [("sidecar.token", "file"), ("host.toml", "file")],
    "/srv": [("state", "dir")],
    "/srv/state": [("journal.db", "file"), ("crewai", "dir"), ("replay-inputs", "dir"), ("notes", "file")],
}


def children(directory: str) -> list[tuple[str, str]]:
    return TREE.get(directory, [])


def test_the_complement_grants_everything_but_the_protected_paths_and_their_spines() -> None:
    grants = dict(sandbox.complement(["/etc/aip/sidecar.token", "/srv/state/journal.db"], children))
    assert grants == {
        "/srv/state/crewai": True,
        "/srv/state/replay-inputs": True,
        "/srv/state/notes": False,
        "/etc/ssl": True,
        "/etc/hosts": False,
        "/etc/aip/host.toml": False,
        "/vmlinuz": False,
    }  # no spine directory (/, /etc, /etc/aip, /srv, /srv/state), no link, nothing protected


def test_nothing_under_a_protected_directory_is_granted() -> None:
    grants = dict(sandbox.complement(["/srv/state", "/srv/state/journal.db"], children))
    assert not any(path.startswith("/srv/state") for path in grants)
    assert "/etc" in grants


paths = st.lists(st.sampled_from(sorted({f"{d}/{n}".replace("//", "/") for d, es in TREE.items() for n, _ in es})))


@given(paths)
def test_no_grant_ever_covers_a_protected_path(protected: list[str]) -> None:
    for granted, _is_dir in sandbox.complement(protected, children):
        assert not any(p == granted or p.startswith(granted + "/") for p in protected), (granted, protected)


def plan(tmp_path: Any, **overrides: Any) -> sandbox.SandboxPlan:
    values: dict[str, Any] = {
        "state_dir": str(tmp_path / "state"),
        "journal": str(tmp_path / "state" / "journal.db"),
        "token_file": str(tmp_path / "token"),
        "training_dir": None,
        "user": None,
        "landlock_abi": 7,
        "sidecar_pid": 42,
    }
    values.update(overrides)
    return sandbox.plan(**values)


def test_the_plan_protects_the_token_the_journal_its_companions_and_the_sidecars_proc(tmp_path: Any) -> None:
    found = plan(tmp_path)
    journal = os.path.realpath(tmp_path / "state" / "journal.db")
    assert set(found.protected) >= {
        os.path.realpath(tmp_path / "token"),
        journal,
        journal + "-wal",
        journal + "-shm",
        journal + ".lock",
        os.path.realpath(tmp_path / "state" / "replay-inputs"),
        "/proc/42",
    }


def test_a_protected_path_inside_a_granted_directory_is_refused(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="crew workers may open"):
        plan(tmp_path, token_file=str(tmp_path / "state" / "crewai" / "token"))
    with pytest.raises(ValueError, match="crew workers may open"):
        plan(tmp_path, training_dir=str(tmp_path / "training"), token_file=str(tmp_path / "training" / "t"))


@pytest.mark.parametrize(
    ("isolation", "user", "abi", "euid", "mode", "missing"),
    [
        ("process", ("w", 1000, 1000, "/"), 7, 0, "user+landlock", []),
        ("process", ("w", 1000, 1000, "/"), 0, 0, "user", ["landlock"]),
        ("process", None, 7, 0, "landlock", ["worker_user"]),
        ("process", None, 7, 1000, "landlock", []),
        ("process", None, 0, 1000, "none", ["landlock"]),
        ("inprocess", None, 7, 1000, "inprocess", ["process_isolation", "worker_user", "landlock"]),
    ],
)
def test_the_report_names_what_is_missing(tmp_path, isolation, user, abi, euid, mode, missing) -> None:
    found = sandbox.report(isolation=isolation, sandbox=plan(tmp_path, user=user, landlock_abi=abi), euid=euid)
    assert (found.mode, found.missing) == (mode, missing)
    assert bool(sandbox.describe_missing(found)) == bool(missing)


def test_reachability_needs_the_search_bit_of_the_class_that_applies() -> None:
    modes = {"/": 0o755, "/srv": 0o700, "/srv/state": 0o711}

    def lookup(path: str) -> Any:
        return SimpleNamespace(st_uid=0, st_gid=0, st_mode=stat.S_IFDIR | modes[path])

    assert sandbox.unreachable("/srv/state", 1000, 1000, lookup) == "/srv"
    modes["/srv"] = 0o701
    assert sandbox.unreachable("/srv/state", 1000, 1000, lookup) is None
    modes["/srv"] = 0o710
    assert sandbox.unreachable("/srv/state", 1000, 0, lookup) is None  # the group's bit for a member


def test_scrubbing_removes_the_inline_token_only() -> None:
    environ = {INLINE_TOKEN_ENV: "s3cret", "OPENAI_API_KEY": "k"}
    assert scrub_environment(environ) is True and environ == {"OPENAI_API_KEY": "k"}
    assert scrub_environment(environ) is False


@pytest.fixture
def base(tmp_path: Any) -> list[str]:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    token.chmod(0o600)
    return ["--registry", "x:Y", "--journal", str(tmp_path / "j.db"), "--token-file", str(token)]


@pytest.mark.parametrize(
    ("value", "extra", "problem"),
    [
        ("no-such-user-aip", [], "no such user"),
        ("root", [], "not root"),
        ("0", [], "not root"),
        ("nobody", ["--isolation", "inprocess"], "--isolation process"),
    ],
)
def test_worker_user_refusals_name_the_setting(base, value, extra, problem) -> None:
    with pytest.raises(ConfigError, match=problem) as info:
        load_settings([*base, "--worker-user", value, *extra], {})
    assert "--worker-user" in str(info.value)


def test_worker_user_is_resolved_from_its_variable(base) -> None:
    if os.geteuid() != 0:
        with pytest.raises(ConfigError, match="started as root"):
            load_settings(base, {"AIP_CREWAI_WORKER_USER": "nobody"})
        return
    settings = load_settings(base, {"AIP_CREWAI_WORKER_USER": "nobody"})
    assert settings.worker_user is not None and settings.worker_user[0] == "nobody" and settings.worker_user[1] > 0


def test_the_spines_are_the_directories_on_the_way_to_protected_paths_and_none_below_them():
    from aip_crewai.sidecar.isolation.sandbox import spines

    protected = ["/srv/state/journal.db", "/srv/state/token", "/srv/state/secrets", "/proc/7"]
    assert spines(protected) == {"/", "/srv", "/srv/state", "/proc"}
    assert spines(["/srv/state", "/srv/state/journal.db"]) == {"/", "/srv"}  # nothing under a protected path
    assert spines([]) == set()


def test_a_world_writable_directory_on_the_way_to_a_protected_path_is_named_for_the_start_up_warning(
    tmp_path: Any,
) -> None:
    # A file made in /tmp after a worker booted was out of that worker's reach when the state lay under /tmp:
    # a job could or could not open it depending on its worker's age. The sidecar now says so at start.
    found = plan(tmp_path)
    modes = {d: 0o40755 for d in sandbox.spines(found.protected)}
    shared = str(tmp_path)
    modes[os.path.realpath(shared)] = 0o41777  # as /tmp: sticky, everyone may write

    def lookup(path: str) -> Any:
        return SimpleNamespace(st_mode=modes[path])

    assert sandbox.shared_spines(found, lookup) == [os.path.realpath(shared)]
    assert sandbox.shared_spines(plan(tmp_path, landlock_abi=0), lookup) == []  # no Landlock: nothing out of reach
