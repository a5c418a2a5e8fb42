"""The suite's shared test helpers (importable as ``kits.*``: ``tests/`` is on the path through pytest's
``pythonpath`` option in pyproject.toml, and through ``PYTHONPATH=tests`` for ``make chaos`` and mypy).

- :mod:`kits.poll`: ``until`` (and its coroutine twin ``until_async``), the one way a test waits for a condition.
- :mod:`kits.sidecar`: the sidecar launcher (a real ``aip-crewai sidecar`` process on loopback).
- :mod:`kits.host`: the host launcher (a real ``aip-crewai host`` process on loopback).
- :mod:`kits.aip`: the ``envelope`` builder and the ``sse_events`` reader.
- :mod:`kits.hostapp`: the host in-process (configuration on disk, fixtures, ``running``, signing).
- :mod:`kits.fake_sidecar`: a scripted in-memory sidecar for in-process hosts.
- :mod:`kits.asgi_stream`: an in-process SSE client for endless streams.
- :mod:`kits.sidecar_fakes`: the sidecar app in-process over fake crews.
- :mod:`kits.otlp_receiver`: a real OTLP/HTTP trace receiver on loopback and the variables pointing at it.
- :mod:`kits.sqlite_schema`: a SQLite database's schema as text (the snapshots in tests/snapshots).
"""
