"""The README's first screen, and the reference pages (docs/reference/), match the code."""

from pathlib import Path

from aip_crewai.contracts.operations import CATALOGUE, capability_id
from aip_crewai.sidecar.options import OPTIONS

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
CONFIGURATION = (ROOT / "docs" / "reference" / "configuration.md").read_text()
HTTP_API = (ROOT / "docs" / "reference" / "http-api.md").read_text()
CLI = (ROOT / "docs" / "reference" / "cli.md").read_text()


def test_first_screen_has_the_two_commands():
    first = "\n".join(README.splitlines()[:40])
    assert "make run" in first and "make test" in first


def _default(value):
    if value is None:
        return "—"
    if isinstance(value, tuple):
        return ",".join(value)
    return str(value)


def test_every_sidecar_setting_is_documented_with_its_env_and_default():
    for option in OPTIONS:
        assert f"| `{option.flag}` | `{option.env}` | `{_default(option.default)}` |" in CONFIGURATION, option.flag


def test_capability_table_matches_the_catalogue():
    for spec in CATALOGUE:
        row = (
            f"| `{spec.name}` | `{capability_id('<crew>', spec.name)}` | {spec.kind.value} | {spec.risk.value} | "
            f"{'yes' if spec.approval else 'no'} | {spec.key.value} | "
        )
        assert row in HTTP_API, spec.name


def test_host_config_keys_are_documented():
    for key in [
        "[host]",
        "bind =",
        "store =",
        "max_response_bytes =",
        "[sidecar]",
        "url =",
        "token_file =",
        "[crews]",
        "file =",
        "[tenants.",
        "[[principals]]",
        "token_sha256 =",
        "ed25519_public_key =",
    ]:
        assert key in CONFIGURATION, key


def test_exit_codes_are_documented():
    from aip_crewai.exit_codes import Exit

    for code in Exit:
        assert f"\n| {code.value} | " in CLI, code.name
