"""aip-crewai: a governed gateway between AIP agent platforms and CrewAI crews (README.md)."""


def package_version() -> str:
    """The installed distribution's version (``aip-crewai``), or ``unknown`` in a source tree without an install."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("aip-crewai")
    except PackageNotFoundError:
        return "unknown"
