"""The conformance suite's rule for absent schemas (docs/reference/http-api.md "AIP 1.0 conformance"): it skips with one line,
unless ``AIP_CREWAI_REQUIRE_SCHEMAS=1`` (CI), where it fails."""

from __future__ import annotations

from pathlib import Path

import pytest
from aipschemas import REQUIRE_ENV, require


def test_present_schemas_run_the_suite(tmp_path: Path) -> None:
    require(tmp_path, {REQUIRE_ENV: "1"})
    require(tmp_path, {})


def test_absent_schemas_skip_the_suite_unless_required() -> None:
    with pytest.raises(pytest.skip.Exception, match="conformance suite skipped"):
        require(None, {})
    with pytest.raises(pytest.skip.Exception):
        require(None, {REQUIRE_ENV: "0"})  # only 1 requires them


def test_absent_schemas_fail_the_suite_when_required() -> None:
    with pytest.raises(pytest.fail.Exception, match="AIP_CREWAI_REQUIRE_SCHEMAS=1"):
        require(None, {REQUIRE_ENV: "1"})
