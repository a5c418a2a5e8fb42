"""Host test fixtures. The helpers live in ``tests/kits/hostapp.py`` (import them with
``from kits.hostapp import ...``)."""

from kits.hostapp import client, clock, host_files, make_app, settings, sidecar  # noqa: F401  (fixtures)
