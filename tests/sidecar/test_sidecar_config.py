"""Sidecar settings (ARCHITECTURE.md §11): flags, environment, defaults, validation, exit status."""

from __future__ import annotations

import os
import stat

import pytest

from aip_crewai.sidecar.config import ConfigError, Settings, load_settings, read_token_file
from aip_crewai.sidecar.main import main
from aip_crewai.sidecar.options import (
    DEFAULT_PRELOAD_MODULES,
    MAX_MODULE_NAME_CHARS,
    MAX_PRELOAD_MODULES,
    OPTIONS,
    build_parser,
)

DESIGN_TABLE = {
    "--registry": ("AIP_CREWAI_REGISTRY", None),
    "--host": ("AIP_CREWAI_HOST", "127.0.0.1"),
    "--port": ("AIP_CREWAI_PORT", 8090),
    "--journal": ("AIP_CREWAI_STATE_FILE", None),
    "--state-dir": ("AIP_CREWAI_STATE_DIR", None),
    "--token-file": ("AIP_CREWAI_BEARER_TOKEN_FILE", None),
    "--allowed-operations": ("AIP_CREWAI_ALLOWED_OPERATIONS", ("run",)),
    "--max-concurrency": ("AIP_CREWAI_MAX_CONCURRENCY", 4),
    "--max-retained-runs": ("AIP_CREWAI_MAX_RETAINED_RUNS", 2000),
    "--max-events-per-run": ("AIP_CREWAI_MAX_EVENTS_PER_RUN", 1000),
    "--max-event-bytes": ("AIP_CREWAI_MAX_EVENT_BYTES", 262144),
    "--stream-checkpoint-events": ("AIP_CREWAI_STREAM_CHECKPOINT_EVENTS", 128),
    "--training-dir": ("AIP_CREWAI_TRAINING_DIR", None),
}


@pytest.fixture
def base(tmp_path):
    """Minimal valid arguments: registry, journal and a 0600 token file."""
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    token.chmod(0o600)
    return [
        "--registry",
        "aip_crewai.examples.testing:CREWS",
        "--journal",
        str(tmp_path / "j.db"),
        "--token-file",
        str(token),
    ]


def test_every_design_flag_has_its_environment_variable_and_default():
    options = {opt.flag: (opt.env, opt.default) for opt in OPTIONS}
    for flag, expected in DESIGN_TABLE.items():
        assert options[flag] == expected, flag


def test_help_documents_every_flag_and_variable(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for opt in OPTIONS:
        assert opt.flag in text and opt.env in text
    assert "--allow-unauthenticated" in text and "--allow-ephemeral" in text


def test_defaults_apply_and_the_token_loses_one_trailing_newline(base, tmp_path):
    settings = load_settings(base, {})
    assert (settings.host, settings.port, settings.max_concurrency, settings.allowed_operations) == (
        "127.0.0.1",
        8090,
        4,
        ("run",),
    )
    assert settings.token == "s3cret" and settings.state_dir == tmp_path
    assert settings.operations == ["cancel", "events", "run", "status"]
    assert "s3cret" not in repr(settings)


def test_environment_is_read_and_flags_override_it(tmp_path, base):
    env = {
        "AIP_CREWAI_REGISTRY": "pkg:CREWS",
        "AIP_CREWAI_MAX_CONCURRENCY": "7",
        "AIP_CREWAI_PORT": "9000",
        "AIP_CREWAI_ALLOWED_OPERATIONS": "run,status,events,cancel,knowledge_query",
        "AIP_CREWAI_STATE_FILE": str(tmp_path / "env.db"),
        "AIP_CREWAI_BEARER_TOKEN_FILE": base[-1],
        "AIP_CREWAI_HOST": "",  # empty means unset
    }
    from_env = load_settings([], env)
    assert (from_env.registry, from_env.max_concurrency, from_env.port) == ("pkg:CREWS", 7, 9000)
    assert from_env.allowed_operations == ("run", "knowledge_query") and from_env.host == "127.0.0.1"
    flagged = load_settings(["--max-concurrency", "2", "--registry", "other:X"], env)
    assert (flagged.max_concurrency, flagged.registry) == (2, "other:X")


@pytest.mark.parametrize(
    "flag,value,named",
    [
        ("--max-concurrency", "0", "--max-concurrency (AIP_CREWAI_MAX_CONCURRENCY)"),
        ("--max-concurrency", "1_000", "--max-concurrency"),
        ("--port", "70000", "--port (AIP_CREWAI_PORT)"),
        ("--max-events-per-run", "1", "--max-events-per-run"),
        ("--max-event-bytes", "100", "--max-event-bytes"),
        ("--max-event-bytes", "1023", "--max-event-bytes"),
        ("--max-event-bytes", "4194305", "--max-event-bytes"),
        ("--stream-checkpoint-events", "-3", "--stream-checkpoint-events"),
        ("--max-retained-runs", "lots", "--max-retained-runs"),
        ("--allowed-operations", "run,launch", "--allowed-operations"),
        ("--allowed-operations", "status,events", "--allowed-operations"),
        ("--sse-keepalive-seconds", "nan", "--sse-keepalive-seconds"),
        ("--log-level", "loud", "--log-level"),
    ],
)
def test_invalid_values_name_the_setting(base, flag, value, named):
    with pytest.raises(ConfigError) as info:
        load_settings([*base, flag, value], {})
    assert str(info.value).startswith(named)


def test_invalid_environment_values_name_the_setting(base):
    with pytest.raises(ConfigError, match="AIP_CREWAI_MAX_EVENT_BYTES"):
        load_settings(base, {"AIP_CREWAI_MAX_EVENT_BYTES": "big"})


def test_a_missing_journal_directory_is_created_0700_as_the_reference_does(tmp_path, base):
    settings = load_settings([*base, "--journal", str(tmp_path / "missing" / "deeper" / "j.db")], {})
    for directory in (tmp_path / "missing", tmp_path / "missing" / "deeper"):
        assert directory.is_dir() and stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert [event for event, _ in settings.warnings] == ["journal_dir_created"]
    assert settings.state_dir == tmp_path / "missing" / "deeper"
    with pytest.raises(ConfigError, match="--state-dir .* does not exist"):
        load_settings([*base, "--state-dir", str(tmp_path / "nostate")], {})


def test_journal_and_token_are_required_unless_explicitly_waived_on_loopback(tmp_path, base):
    no_journal = [a for i, a in enumerate(base) if i not in (2, 3)]
    with pytest.raises(ConfigError, match="--journal"):
        load_settings(no_journal, {})
    assert load_settings([*no_journal, "--allow-ephemeral"], {}).journal is None
    no_token = base[:4]
    with pytest.raises(ConfigError, match="--token-file"):
        load_settings(no_token, {})
    open_settings = load_settings([*no_token, "--allow-unauthenticated"], {})
    assert open_settings.token is None
    assert load_settings([*no_token, "--allow-unauthenticated", "--host", "::1"], {}).token is None
    for flag in ("--allow-unauthenticated", "--allow-ephemeral"):
        with pytest.raises(ConfigError, match=f"^{flag}: only allowed with a loopback"):
            load_settings([*base, flag, "--host", "0.0.0.0"], {})


@pytest.mark.parametrize(
    "content,mode,problem",
    [
        ("tok\n", 0o644, "mode 0644"),
        ("", 0o600, "1..16384 bytes"),
        ("x" * 16385, 0o600, "1..16384 bytes"),
        ("\n", 0o600, "empty token"),
        ("two words\n", 0o600, "without whitespace"),
    ],
)
def test_token_file_rules(tmp_path, content, mode, problem):
    path = tmp_path / "token"
    path.write_text(content)
    path.chmod(mode)
    with pytest.raises(ConfigError, match=problem):
        read_token_file(path)


def test_token_file_must_be_a_regular_non_symlink_file(tmp_path):
    real = tmp_path / "real"
    real.write_text("tok")
    real.chmod(0o600)
    assert read_token_file(real) == "tok"
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(ConfigError, match="symlink"):
        read_token_file(tmp_path / "link")
    with pytest.raises(ConfigError, match="not a regular file"):
        read_token_file(tmp_path)
    assert read_token_file(_write(tmp_path / "crlf", "tok\r\n")) == "tok"
    assert read_token_file(_write(tmp_path / "max", "t" * 16384)) == "t" * 16384


def _write(path, text):
    path.write_bytes(text.encode())
    path.chmod(0o600)
    return path


def test_training_dir_is_required_with_train_and_must_be_private(base, tmp_path):
    with pytest.raises(ConfigError, match="--training-dir .*required when train"):
        load_settings([*base, "--allowed-operations", "run,train"], {})
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o775)
    with pytest.raises(ConfigError, match="group- or world-writable"):
        load_settings([*base, "--allowed-operations", "train", "--training-dir", str(shared)], {})
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (tmp_path / "alias").symlink_to(private)
    with pytest.raises(ConfigError, match="symlink"):
        load_settings([*base, "--allowed-operations", "train", "--training-dir", str(tmp_path / "alias")], {})
    ok = load_settings([*base, "--allowed-operations", "train", "--training-dir", str(private)], {})
    assert ok.training_dir == private and ok.allowed_operations == ("train",)


def test_main_exits_2_with_one_line_naming_the_setting(base, capsys, monkeypatch):
    monkeypatch.delenv("AIP_CREWAI_MAX_CONCURRENCY", raising=False)
    assert main([*base, "--max-concurrency", "many"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("aip-crewai sidecar: error: --max-concurrency (AIP_CREWAI_MAX_CONCURRENCY)")
    assert "Traceback" not in captured.err and captured.err.count("\n") == 1


def test_settings_are_immutable(base):
    settings = load_settings(base, {})
    assert isinstance(settings, Settings)
    with pytest.raises(AttributeError):
        settings.port = 1


# --------------------------------------------- the reference sidecar's environment

REFERENCE_ENV = {
    "AIP_CREWAI_REGISTRY": "aip_crewai.examples.testing:CREWS",
    "AIP_CREWAI_HOST": "127.0.0.1",
    "AIP_CREWAI_BEARER_TOKEN": "inline-s3cret",
    "AIP_CREWAI_MAX_EVENT_BYTES": "1024",
    "AIP_CREWAI_MAX_STATE_BYTES": "268435456",
    "AIP_CREWAI_ALLOWED_OPERATIONS": "run,train",
}


def test_the_reference_environment_is_accepted_as_it_is(tmp_path):
    training = tmp_path / "var" / "training"  # does not exist yet
    env = {
        **REFERENCE_ENV,
        "AIP_CREWAI_STATE_FILE": str(tmp_path / "runs.db"),
        "AIP_CREWAI_TRAINING_DIR": str(training),
    }
    settings = load_settings([], env)
    assert settings.token == "inline-s3cret" and settings.token_file is None
    assert settings.max_event_bytes == 1024 and settings.max_journal_bytes == 268_435_456
    assert settings.training_dir == training and training.is_dir()
    assert oct(training.stat().st_mode & 0o777) == oct(0o700)
    assert oct((tmp_path / "var").stat().st_mode & 0o777) == oct(0o700)
    events = dict(settings.warnings)
    assert "token file" in events["bearer_token_inline"] and "training_dir_created" in events
    assert "inline-s3cret" not in repr(settings) and "inline-s3cret" not in repr(settings.warnings)


@pytest.mark.parametrize("value, ok", [("1024", True), ("1023", False), ("4194304", True), ("4194305", False)])
def test_max_event_bytes_takes_the_reference_range(base, value, ok):
    if ok:
        settings = load_settings(base, {"AIP_CREWAI_MAX_EVENT_BYTES": value})
        assert settings.max_event_bytes == int(value)
        assert ("max_event_bytes_above_host_frame" in dict(settings.warnings)) == (int(value) > 1_048_576)
    else:
        with pytest.raises(ConfigError, match=r"AIP_CREWAI_MAX_EVENT_BYTES.*1024\.\.4194304"):
            load_settings(base, {"AIP_CREWAI_MAX_EVENT_BYTES": value})


@pytest.mark.parametrize(
    "value, ok", [("1048576", True), ("1048575", False), ("4294967296", True), ("4294967297", False), ("lots", False)]
)
def test_max_state_bytes_sets_the_journal_bound_within_the_reference_range(base, value, ok):
    if ok:
        assert load_settings(base, {"AIP_CREWAI_MAX_STATE_BYTES": value}).max_journal_bytes == int(value)
    else:
        with pytest.raises(ConfigError, match="AIP_CREWAI_MAX_STATE_BYTES"):
            load_settings(base, {"AIP_CREWAI_MAX_STATE_BYTES": value})


def test_max_state_bytes_and_a_different_journal_bound_are_refused(base):
    with pytest.raises(ConfigError, match="one bound"):
        load_settings([*base, "--max-journal-bytes", "2097152"], {"AIP_CREWAI_MAX_STATE_BYTES": "1048576"})
    same = load_settings(base, {"AIP_CREWAI_MAX_STATE_BYTES": "2097152", "AIP_CREWAI_MAX_JOURNAL_BYTES": "2097152"})
    assert same.max_journal_bytes == 2097152


def test_inline_token_rules_and_exclusion_with_the_token_file(base):
    with pytest.raises(ConfigError, match="mutually exclusive") as exc:
        load_settings(base, {"AIP_CREWAI_BEARER_TOKEN": "inline-s3cret"})
    assert "inline-s3cret" not in str(exc.value)
    no_token = base[:4]
    for bad in ("two words", "x" * 16385, "caf\u00e9"):
        with pytest.raises(ConfigError, match="AIP_CREWAI_BEARER_TOKEN") as exc:
            load_settings(no_token, {"AIP_CREWAI_BEARER_TOKEN": bad})
        assert bad not in str(exc.value)
    assert load_settings(no_token, {"AIP_CREWAI_BEARER_TOKEN": "tok\n"}).token == "tok"


@pytest.mark.parametrize(
    "name, flag",
    [("AIP_CREWAI_ALLOW_UNAUTHENTICATED", "allow_unauthenticated"), ("AIP_CREWAI_ALLOW_EPHEMERAL", "allow_ephemeral")],
)
def test_safety_valves_read_their_environment_on_loopback_only(tmp_path, name, flag):
    minimal = ["--registry", "aip_crewai.examples.testing:CREWS"]
    env = {"AIP_CREWAI_ALLOW_UNAUTHENTICATED": "true", "AIP_CREWAI_ALLOW_EPHEMERAL": "1"}
    settings = load_settings(minimal, env)
    assert settings.allow_unauthenticated and settings.allow_ephemeral and settings.token is None
    assert settings.journal is None
    with pytest.raises(ConfigError, match="only allowed with a loopback"):
        load_settings([*minimal, "--host", "0.0.0.0"], env)
    with pytest.raises(ConfigError, match=name):
        load_settings(minimal, {**env, name: "maybe"})
    assert getattr(load_settings([*minimal, f"--{flag.replace('_', '-')}"], {**env, name: "false"}), flag)


@pytest.mark.parametrize("source", ["flag", "env"])
@pytest.mark.parametrize("value", ["process", "inprocess", "INPROCESS"])
def test_isolation_reads_its_flag_and_variable(base, source, value):
    """``--isolation`` / ``AIP_CREWAI_ISOLATION``: process (default) or inprocess (docs/security.md "Process isolation")."""
    assert load_settings(base, {}).isolation == "process"
    args, env = (base + ["--isolation", value], {}) if source == "flag" else (base, {"AIP_CREWAI_ISOLATION": value})
    assert load_settings(args, env).isolation == value.lower()
    with pytest.raises(ConfigError, match=r"--isolation \(AIP_CREWAI_ISOLATION\).*process, inprocess"):
        load_settings(base, {"AIP_CREWAI_ISOLATION": "threads"})


@pytest.mark.parametrize("value, ok", [("0", True), ("60", True), ("60.01", False), ("-0.1", False), ("nan", False)])
def test_cancel_grace_seconds_is_bounded(base, value, ok):
    """``--cancel-grace-seconds`` / ``AIP_CREWAI_CANCEL_GRACE_SECONDS``: 0..60 s, default 1."""
    assert load_settings(base, {}).cancel_grace_seconds == 1.0
    if ok:
        assert load_settings(base, {"AIP_CREWAI_CANCEL_GRACE_SECONDS": value}).cancel_grace_seconds == float(value)
    else:
        with pytest.raises(ConfigError, match=r"AIP_CREWAI_CANCEL_GRACE_SECONDS.*0\.0\.\.60\.0"):
            load_settings(base, {"AIP_CREWAI_CANCEL_GRACE_SECONDS": value})


@pytest.mark.parametrize(
    "idle, concurrency, expected",
    [
        (None, "4", 4),
        (None, "9", 9),
        (None, "16", 16),
        (None, "17", 16),
        (None, "1024", 16),
        ("0", "4", 0),
        ("4", "4", 4),
        ("5", "4", None),
        ("1024", "1024", 1024),
        ("1025", "1024", None),
    ],
)
def test_idle_workers_default_to_the_concurrency_and_never_exceed_it(base, idle, concurrency, expected):
    """``--idle-workers`` / ``AIP_CREWAI_IDLE_WORKERS``: 0..``--max-concurrency``, default ``--max-concurrency`` but
    at most 16 (a sidecar at ``--max-concurrency 1024`` booted 1,024 workers); one more stops start-up naming the
    setting."""
    args = [*base, "--max-concurrency", concurrency, *(["--idle-workers", idle] if idle is not None else [])]
    if expected is None:
        with pytest.raises(ConfigError, match="--idle-workers"):
            load_settings(args, {})
    else:
        assert load_settings(args, {}).idle_workers == expected
    if idle is not None and expected is not None:
        assert load_settings(
            [*base, "--max-concurrency", concurrency], {"AIP_CREWAI_IDLE_WORKERS": idle}
        ).idle_workers == (expected)


@pytest.mark.parametrize("value, ok", [("0", True), ("0.5", True), ("86400", True), ("86400.5", False), ("-1", False)])
def test_idle_shrink_seconds_default_to_30_and_0_keeps_the_idle_workers(base, value, ok):
    """``--idle-shrink-seconds`` / ``AIP_CREWAI_IDLE_SHRINK_SECONDS``: 0..86400 seconds, default 30 (0: never
    shrink); outside stops start-up naming the setting and its range."""
    assert load_settings(base, {}).idle_shrink_seconds == 30.0
    if ok:
        assert load_settings([*base, "--idle-shrink-seconds", value], {}).idle_shrink_seconds == float(value)
        assert load_settings(base, {"AIP_CREWAI_IDLE_SHRINK_SECONDS": value}).idle_shrink_seconds == float(value)
    else:
        with pytest.raises(ConfigError, match=r"--idle-shrink-seconds.*0\.0\.\.86400\.0"):
            load_settings([*base, "--idle-shrink-seconds", value], {})
        with pytest.raises(ConfigError, match=r"AIP_CREWAI_IDLE_SHRINK_SECONDS.*0\.0\.\.86400\.0"):
            load_settings(base, {"AIP_CREWAI_IDLE_SHRINK_SECONDS": value})


@pytest.mark.parametrize("value, ok", [("0", True), ("19", True), ("20", False), ("-1", False), ("1.5", False)])
def test_worker_nice_is_a_niceness_increment(base, value, ok):
    """``--worker-nice`` / ``AIP_CREWAI_WORKER_NICE``: 0..19 (what ``nice`` accepts), default 10; outside stops
    start-up naming the setting and its range."""
    assert load_settings(base, {}).worker_nice == 10
    if ok:
        assert load_settings([*base, "--worker-nice", value], {}).worker_nice == int(value)
        assert load_settings(base, {"AIP_CREWAI_WORKER_NICE": value}).worker_nice == int(value)
    else:
        with pytest.raises(ConfigError, match=r"--worker-nice.*0\.\.19"):
            load_settings([*base, "--worker-nice", value], {})
        with pytest.raises(ConfigError, match=r"AIP_CREWAI_WORKER_NICE.*0\.\.19"):
            load_settings(base, {"AIP_CREWAI_WORKER_NICE": value})


@pytest.mark.parametrize("value, ok", [("8388608", True), ("8388607", False), ("1099511627776", True)])
def test_the_unauthenticated_body_budget_is_at_least_one_job_body(base, value, ok):
    """docs/security.md "Security" (bodies before authentication): default 64 MiB; never below one whole job body."""
    from aip_crewai.sidecar.jobs.admission import MAX_BODY_BYTES

    assert load_settings(base, {}).body_budget_bytes == 64 * 1024 * 1024
    assert int("8388608") == MAX_BODY_BYTES
    if ok:
        assert load_settings([*base, "--unauthenticated-body-budget-bytes", value], {}).body_budget_bytes == int(value)
    else:
        with pytest.raises(ConfigError, match="AIP_CREWAI_UNAUTHENTICATED_BODY_BUDGET_BYTES"):
            load_settings(base, {"AIP_CREWAI_UNAUTHENTICATED_BODY_BUDGET_BYTES": value})


@pytest.mark.parametrize(
    "value, ok", [("1", True), ("100000", True), ("0", False), ("100001", False), ("-1", False), ("2.5", False)]
)
def test_worker_jobs_counts_the_jobs_one_worker_may_run(base, value, ok):
    """``--worker-jobs`` / ``AIP_CREWAI_WORKER_JOBS``: 1..100000, default 100 (warm workers; 1 is a fresh process
    per job); outside stops start-up naming the setting and its range."""
    assert load_settings(base, {}).worker_jobs == 100
    if ok:
        assert load_settings([*base, "--worker-jobs", value], {}).worker_jobs == int(value)
        assert load_settings(base, {"AIP_CREWAI_WORKER_JOBS": value}).worker_jobs == int(value)
    else:
        with pytest.raises(ConfigError, match=r"--worker-jobs.*1\.\.100000"):
            load_settings([*base, "--worker-jobs", value], {})
        with pytest.raises(ConfigError, match=r"AIP_CREWAI_WORKER_JOBS.*1\.\.100000"):
            load_settings(base, {"AIP_CREWAI_WORKER_JOBS": value})


@pytest.mark.parametrize(
    "extra, environ, named",
    [
        (["--worker-jobs", "5"], {}, ["--worker-jobs"]),
        ([], {"AIP_CREWAI_WORKER_NICE": "3", "AIP_CREWAI_IDLE_WORKERS": "1"}, ["--idle-workers", "--worker-nice"]),
        (["--cancel-grace-seconds", "2"], {}, ["--cancel-grace-seconds"]),
        ([], {"AIP_CREWAI_PRELOAD_MODULES": "none"}, ["--preload-modules"]),
        (["--idle-shrink-seconds", "0"], {}, ["--idle-shrink-seconds"]),
    ],
)
def test_process_only_settings_given_with_inprocess_isolation_are_named_in_a_warning(base, extra, environ, named):
    """``--isolation inprocess`` runs every job in the sidecar process: a worker setting given anyway (flag or
    environment) is ignored, and the start-up warning ``process_options_ignored`` names each one; with process
    isolation, or with none given, there is no such warning."""
    settings = load_settings([*base, "--isolation", "inprocess", *extra], environ)
    (message,) = [text for event, text in settings.warnings if event == "process_options_ignored"]
    assert [
        name
        for name in (
            "--cancel-grace-seconds",
            "--idle-workers",
            "--idle-shrink-seconds",
            "--worker-nice",
            "--worker-jobs",
            "--preload-modules",
        )
        if name in message
    ] == named
    assert not any(e == "process_options_ignored" for e, _ in load_settings([*base, *extra], environ).warnings)
    assert not any(
        e == "process_options_ignored" for e, _ in load_settings([*base, "--isolation", "inprocess"], {}).warnings
    )


def _names(count: int, chars: int = 8) -> str:
    return ",".join(f"m{i:0{chars - 1}d}" for i in range(count))


@pytest.mark.parametrize(
    "value, expected",
    [
        ("openai.resources", ("openai.resources",)),
        (" a.b , c, a.b ,_d9.e_ ", ("a.b", "c", "_d9.e_")),
        ("os,,sys", "an empty or blank entry \\(entry 2 of 3\\)"),
        ("os,sys,", "an empty or blank entry \\(entry 3 of 3\\)"),
        (",os", "an empty or blank entry \\(entry 1 of 2\\)"),
        ("os, ,sys,  ", "an empty or blank entry \\(entries 2, 4 of 4\\)"),
        ("modülé.sub", ("modülé.sub",)),
        ("none", ()),
        (" NONE ", ()),
        (_names(MAX_PRELOAD_MODULES), tuple(_names(MAX_PRELOAD_MODULES).split(","))),
        ("m" * MAX_MODULE_NAME_CHARS, ("m" * MAX_MODULE_NAME_CHARS,)),
        (_names(MAX_PRELOAD_MODULES + 1), "at most 64 modules, not 65"),
        ("m" * (MAX_MODULE_NAME_CHARS + 1), "longer than 200 characters"),
        (",", "an empty or blank entry \\(entries 1, 2 of 2\\)"),
        ("   ", "must not be empty"),
        ("openai/resources", "not a module name"),
        ("9lives", "not a module name"),
        ("a..b", "not a module name"),
        ("a.b.", "not a module name"),
        (".foo", "not a module name"),
        ("none,httpcore", "none stands alone"),
    ],
)
def test_preload_modules_take_dotted_names_within_their_bounds(base, value, expected):
    """``--preload-modules`` / ``AIP_CREWAI_PRELOAD_MODULES``: a comma list of dotted module names (order kept,
    repeats dropped), at most 64 of at most 200 characters; ``none`` (any case) preloads nothing beyond CrewAI
    and the operations; default: the OpenAI client stack and ChromaDB's telemetry client. Anything else, an
    empty flag or a blank variable included, stops start-up naming the setting and the problem (an unset or
    empty variable is the default); so does an empty or blank entry (``os,,sys``, a trailing comma), which
    was dropped before."""
    assert load_settings(base, {}).preload_modules == DEFAULT_PRELOAD_MODULES == Settings("r:C").preload_modules
    assert load_settings(base, {"AIP_CREWAI_PRELOAD_MODULES": ""}).preload_modules == DEFAULT_PRELOAD_MODULES
    if isinstance(expected, tuple):
        assert load_settings([*base, "--preload-modules", value], {}).preload_modules == expected
        assert load_settings(base, {"AIP_CREWAI_PRELOAD_MODULES": value}).preload_modules == expected
    else:
        with pytest.raises(ConfigError, match=f"--preload-modules.*{expected}"):
            load_settings([*base, "--preload-modules", value], {})
        with pytest.raises(ConfigError, match=f"AIP_CREWAI_PRELOAD_MODULES.*{expected}"):
            load_settings(base, {"AIP_CREWAI_PRELOAD_MODULES": value})


@pytest.mark.parametrize("value", ["os,,sys", "os,sys,", "os, ,sys"])
def test_an_empty_preload_entry_stops_start_up_with_one_line_and_exit_2(base, capsys, monkeypatch, value):
    """``--preload-modules os,,sys`` was taken as ``os,sys``: an empty entry is refused as every option error is."""
    monkeypatch.delenv("AIP_CREWAI_PRELOAD_MODULES", raising=False)
    assert main([*base, "--preload-modules", value]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(
        "aip-crewai sidecar: error: --preload-modules (AIP_CREWAI_PRELOAD_MODULES): has an empty or blank entry"
    )
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err and captured.out == ""


#: Integer options (ASCII digits only) and decimal options (at most one decimal point too).
INTEGER_OPTIONS = [("--port", "AIP_CREWAI_PORT"), ("--max-concurrency", "AIP_CREWAI_MAX_CONCURRENCY")]
DECIMAL_OPTIONS = [("--shutdown-grace-seconds", "AIP_CREWAI_SHUTDOWN_GRACE_SECONDS")]


@pytest.mark.parametrize("value", ["1_0", "1e3", " 5 ", "5 ", " 5", "+5", "\u0665", "0x10", "5.0", "", "-1"])
@pytest.mark.parametrize(("flag", "env"), INTEGER_OPTIONS)
def test_an_integer_option_is_ascii_digits_and_nothing_else(base, flag, env, value):
    """Python's ``int()`` takes ``1_0`` (10), blanks and other scripts' digits (``\u0665``, an Arabic-Indic 5):
    the option refuses them, from the flag and from the variable, naming both."""
    with pytest.raises(ConfigError) as info:
        load_settings([*base, flag, value], {})
    assert str(info.value).startswith(f"{flag} ({env}): must be an integer")
    if value.strip():  # an empty or blank variable counts as unset
        with pytest.raises(ConfigError, match=f"^{flag} \\({env}\\): must be an integer"):
            load_settings(base, {env: value})


@pytest.mark.parametrize("value", ["1_0", "1e3", "1E3", " 5 ", "+1", "inf", "nan", "1.2.3", ".", "5..", "\u0665", ""])
@pytest.mark.parametrize(("flag", "env"), DECIMAL_OPTIONS)
def test_a_decimal_option_is_ascii_digits_with_at_most_one_point(base, flag, env, value):
    with pytest.raises(ConfigError) as info:
        load_settings([*base, flag, value], {})
    assert str(info.value).startswith(f"{flag} ({env}): must be a number")


@pytest.mark.parametrize(("value", "seconds"), [("5", 5.0), ("0.25", 0.25), (".5", 0.5), ("5.", 5.0), ("3600", 3600.0)])
def test_a_decimal_option_takes_digits_and_one_point_at_the_limits_too(base, value, seconds):
    assert load_settings([*base, "--shutdown-grace-seconds", value], {}).shutdown_grace_seconds == seconds
    assert load_settings(base, {"AIP_CREWAI_SHUTDOWN_GRACE_SECONDS": value}).shutdown_grace_seconds == seconds
    with pytest.raises(ConfigError, match="must be a number 0.0..3600.0"):
        load_settings([*base, "--shutdown-grace-seconds", "3600.5"], {})


def test_the_reference_state_bytes_and_a_numeric_worker_user_are_ascii_digits_too(base):
    with pytest.raises(ConfigError, match="AIP_CREWAI_MAX_STATE_BYTES.*ASCII digits only"):
        load_settings(base, {"AIP_CREWAI_MAX_STATE_BYTES": " 2000000 "})
    assert load_settings(base, {"AIP_CREWAI_MAX_STATE_BYTES": "2000000"}).max_journal_bytes == 2_000_000
    with pytest.raises(ConfigError, match="no such user"):  # not uid 3: a name of digits of another script
        load_settings([*base, "--worker-user", "\u0663"], {})


def test_main_refuses_a_port_with_blanks_in_one_line_and_exit_2(base, capsys, monkeypatch):
    monkeypatch.delenv("AIP_CREWAI_PORT", raising=False)
    assert main([*base, "--port", " 8090 "]) == 2
    err = capsys.readouterr().err
    assert err == (
        "aip-crewai sidecar: error: --port (AIP_CREWAI_PORT): must be an integer 0..65535 (ASCII digits only) "
        "(got ' 8090 ')\n"
    )
