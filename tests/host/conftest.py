"""Host test fixtures. The helpers live in ``hostkit.py`` (import them with
``from hostkit import ...``; test modules here are rootdir-relative, no package)."""

from hostkit import client, clock, host_files, make_app, settings, sidecar  # noqa: F401  (fixtures)
