"""Sidecar settings (ARCHITECTURE.md §11): flags, environment, defaults, validation, exit status."""

from __future__ import annotations

import os

import pytest

from aip_crewai.sidecar.config import OPTIONS, ConfigError, Settings, build_parser, load_settings, read_token_file
from aip_crewai.sidecar.main import main

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
    return ["--registry", "examples.testing:CREWS", "--journal", str(tmp_path / "j.db"), "--token-file", str(token)]


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
        "127.0.0.1", 8090, 4, ("run",))
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


@pytest.mark.parametrize("flag,value,named", [
    ("--max-concurrency", "0", "--max-concurrency (AIP_CREWAI_MAX_CONCURRENCY)"),
    ("--max-concurrency", "1_000", "--max-concurrency"),
    ("--port", "70000", "--port (AIP_CREWAI_PORT)"),
    ("--max-events-per-run", "1", "--max-events-per-run"),
    ("--max-event-bytes", "100", "--max-event-bytes"),
    ("--stream-checkpoint-events", "-3", "--stream-checkpoint-events"),
    ("--max-retained-runs", "lots", "--max-retained-runs"),
    ("--allowed-operations", "run,launch", "--allowed-operations"),
    ("--allowed-operations", "status,events", "--allowed-operations"),
    ("--sse-keepalive-seconds", "nan", "--sse-keepalive-seconds"),
    ("--log-level", "loud", "--log-level"),
])
def test_invalid_values_name_the_setting(base, flag, value, named):
    with pytest.raises(ConfigError) as info:
        load_settings([*base, flag, value], {})
    assert str(info.value).startswith(named)


def test_invalid_environment_values_name_the_setting(base):
    with pytest.raises(ConfigError, match="AIP_CREWAI_MAX_EVENT_BYTES"):
        load_settings(base, {"AIP_CREWAI_MAX_EVENT_BYTES": "big"})


def test_journal_directory_must_exist_before_anything_creates_it(tmp_path, base):
    with pytest.raises(ConfigError, match=r"^--journal \(AIP_CREWAI_STATE_FILE\): the directory .* does not exist"):
        load_settings([*base, "--journal", str(tmp_path / "missing" / "j.db")], {})
    assert not (tmp_path / "missing").exists()
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


@pytest.mark.parametrize("content,mode,problem", [
    ("tok\n", 0o644, "mode 0644"),
    ("", 0o600, "1..16384 bytes"),
    ("x" * 16385, 0o600, "1..16384 bytes"),
    ("\n", 0o600, "empty token"),
    ("two words\n", 0o600, "without whitespace"),
])
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
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings([*base, "--allowed-operations", "train", "--training-dir", str(tmp_path / "nope")], {})
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
        settings.port = 1  # type: ignore[misc]
