"""Tests for aip_crewai.sidecar.registry (module:attribute → crew sources)."""

from __future__ import annotations

import re
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from aip_crewai.sidecar.registry import CrewSource, RegistryError, load_registry


class FakeCrew:
    """Duck-typed crew: copy() and kickoff(); records what happened to it."""

    copies = 0

    def __init__(self, name: str = "fake") -> None:
        self.name = name
        self.kicked_off = False

    def copy(self) -> FakeCrew:
        FakeCrew.copies += 1
        return FakeCrew(self.name + "-copy")

    def kickoff(self, inputs: dict | None = None) -> str:
        self.kicked_off = True
        return "done"


@pytest.fixture
def module_factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Write a uniquely named module into a sys.path dir; return its name."""
    monkeypatch.syspath_prepend(str(tmp_path))
    created: list[str] = []

    def write(source: str) -> str:
        name = f"regmod_{uuid.uuid4().hex}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        created.append(name)
        return name

    yield write
    for name in created:
        sys.modules.pop(name, None)


FAKE = f"from {__name__} import FakeCrew\n"


def test_registry_error_is_a_value_error() -> None:
    assert issubclass(RegistryError, ValueError)


@pytest.mark.parametrize("spec", ["", "nocolon", "mod:", ":attr", "a b:c", "mod:attr:extra", "mod:1attr", "-mod:x"])
def test_malformed_spec_is_rejected(spec: str) -> None:
    with pytest.raises(RegistryError, match="must look like"):
        load_registry(spec)


def test_non_string_spec_is_rejected() -> None:
    with pytest.raises(RegistryError):
        load_registry(42)  # type: ignore[arg-type]


def test_missing_module_names_the_module() -> None:
    with pytest.raises(RegistryError, match="cannot import module 'no_such_module_xyz'"):
        load_registry("no_such_module_xyz:CREWS")


@pytest.mark.parametrize(
    ("source", "raised"),
    [
        ('SECRET = "sk-live-123"\nraise RuntimeError(SECRET)\n', "RuntimeError at"),
        ("def broken(:\n", "SyntaxError at"),
        ('def CREWS():\n    raise KeyError("sk-live-123")\n', "KeyError at"),
    ],
    ids=["raises", "syntax-error", "callable-raises"],
)
def test_a_registry_whose_own_code_fails_is_refused_naming_the_type_and_place_never_the_text(
    module_factory, source, raised
) -> None:
    name = module_factory(source)
    with pytest.raises(RegistryError) as caught:
        load_registry(f"{name}:CREWS")
    assert raised in str(caught.value) and ".py:" in str(caught.value)
    assert "sk-live-123" not in str(caught.value)


def test_missing_attribute_names_the_attribute(module_factory) -> None:
    name = module_factory("OTHER = {}\n")
    with pytest.raises(RegistryError, match="has no attribute 'CREWS'"):
        load_registry(f"{name}:CREWS")


def test_empty_mapping_is_rejected(module_factory) -> None:
    name = module_factory("CREWS = {}\n")
    with pytest.raises(RegistryError, match="empty"):
        load_registry(f"{name}:CREWS")


def test_callable_returning_empty_mapping_is_rejected(module_factory) -> None:
    name = module_factory("def CREWS():\n    return {}\n")
    with pytest.raises(RegistryError, match="empty"):
        load_registry(f"{name}:CREWS")


def test_callable_returning_non_mapping_is_rejected(module_factory) -> None:
    name = module_factory("def CREWS():\n    return [1, 2]\n")
    with pytest.raises(RegistryError, match="returned list, not a mapping"):
        load_registry(f"{name}:CREWS")


def test_attribute_neither_mapping_nor_callable_is_rejected(module_factory) -> None:
    name = module_factory("CREWS = 5\n")
    with pytest.raises(RegistryError, match="not a mapping or a callable"):
        load_registry(f"{name}:CREWS")


@pytest.mark.parametrize("key", ["1", "b''", "''", "'a\\nb'", "'x' * 257", "None"])
def test_bad_crew_id_is_rejected(module_factory, key: str) -> None:
    name = module_factory(f"CREWS = {{{key}: lambda: None}}\n")
    with pytest.raises(RegistryError, match="crew id"):
        load_registry(f"{name}:CREWS")


@pytest.mark.parametrize("value", ["42", "{'a': 1}", "'text'", "None"])
def test_value_neither_factory_nor_crew_is_rejected_naming_the_key(module_factory, value: str) -> None:
    name = module_factory(f"CREWS = {{'bad-crew': {value}}}\n")
    with pytest.raises(RegistryError, match="'bad-crew'"):
        load_registry(f"{name}:CREWS")


def test_factory_is_called_once_per_new_crew(module_factory) -> None:
    name = module_factory(
        FAKE + "calls = []\n" + "def make():\n    calls.append(1)\n    return FakeCrew()\n" + "CREWS = {'f': make}\n"
    )
    sources = load_registry(f"{name}:CREWS")
    module = sys.modules[name]
    assert module.calls == []  # loading does not build crews
    first, second = sources["f"].new_crew(), sources["f"].new_crew()
    assert first is not second
    assert module.calls == [1, 1]
    assert sources["f"].kind == "factory"


def test_callable_attribute_and_dotted_attribute_are_accepted(module_factory) -> None:
    name = module_factory(FAKE + "class Holder:\n    @staticmethod\n    def crews():\n        return {'x': FakeCrew}\n")
    sources = load_registry(f"{name}:Holder.crews")
    assert list(sources) == ["x"]
    assert isinstance(sources["x"].new_crew(), FakeCrew)


def test_template_is_copied_per_job_and_never_kicked_off(module_factory) -> None:
    name = module_factory(FAKE + "TEMPLATE = FakeCrew('tmpl')\nCREWS = {'t': TEMPLATE}\n")
    sources = load_registry(f"{name}:CREWS")
    template = sys.modules[name].TEMPLATE
    source = sources["t"]
    assert source.kind == "template" and source.template is template
    before = FakeCrew.copies
    crews = [source.new_crew() for _ in range(2)]
    assert FakeCrew.copies == before + 2
    assert all(c is not template for c in crews)
    for crew in crews:
        crew.kickoff({})
    assert template.kicked_off is False


def test_factory_returning_non_crew_fails_at_new_crew() -> None:
    source = CrewSource(crew_id="broken", factory=lambda: "not a crew")
    with pytest.raises(RegistryError, match="'broken'"):
        source.new_crew()


def test_mapping_order_is_kept(module_factory) -> None:
    name = module_factory(FAKE + "CREWS = {'b': FakeCrew, 'a': FakeCrew, 'c': FakeCrew}\n")
    assert list(load_registry(f"{name}:CREWS")) == ["b", "a", "c"]


@pytest.mark.timeout(120)
def test_example_registries_expose_the_documented_crew_ids(crewai_state_dir: Path) -> None:
    testing = load_registry("aip_crewai.examples.testing:CREWS")
    assert set(testing) == {
        "echo",
        "echo-template",
        "slow",
        "failing",
        "chatty",
        "tool_user",
        "knowledge_a",
        "knowledge_b",
    }
    assert testing["echo-template"].kind == "template"
    assert {k for k, v in testing.items() if v.kind == "factory"} == set(testing) - {"echo-template"}
    assert list(load_registry("aip_crewai.examples.support_triage:CREWS")) == ["support-triage"]


def test_registry_module_does_not_import_crewai() -> None:
    source = Path(__import__("aip_crewai.sidecar.registry").sidecar.registry.__file__).read_text()
    assert "import crewai" not in source and "from crewai" not in source


@pytest.mark.processes
def test_locate_registry_finds_a_module_without_importing_it_or_its_packages():
    import subprocess

    code = (
        "import sys; from aip_crewai.sidecar.registry import locate_registry; "
        "print(locate_registry('aip_crewai.examples.testing:CREWS')); "
        "print('aip_crewai.examples' in sys.modules, 'crewai' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    origin, imported = done.stdout.splitlines()
    assert origin.endswith("aip_crewai/examples/testing.py") and imported == "False False"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_module_xyz:CREWS", "no module 'no_such_module_xyz' on the Python path"),
        ("aip_crewai.no_such_xyz:CREWS", "no module 'aip_crewai.no_such_xyz'"),
        ("aip_crewai.plumbing.log.inner:CREWS", "'aip_crewai.plumbing.log' is a module, not a package"),
        ("no colon", "must look like"),
    ],
)
def test_locate_registry_refuses_what_cannot_be_imported(spec, message):
    from aip_crewai.sidecar.registry import locate_registry

    with pytest.raises(RegistryError, match=re.escape(message)):
        locate_registry(spec)
