"""``make chaos``: run the reliability scenarios many times and print tried/passed per category.

Usage: ``make chaos``, i.e. ``PYTHONPATH=tests python tests/reliability/chaos.py`` (``tests`` for the kits
package; ``AIP_CREWAI_CHAOS_SCALE=N`` multiplies the trial counts, default 1; ``AIP_CREWAI_CHAOS_SEED`` fixes the random offsets). Exit status 1 when any trial failed;
the failures are listed under the table, and the work directory is kept for inspection.

Categories: crash (kill -9 of either process), race (duplicates, decisions, cancel vs completion),
hostile (fuzzed requests to both apps, the malformed-stream corpus in-process and over real HTTP),
security (credentials on every route, tenant isolation, secrets, start-up refusals), storage (journal
write failures, the size bound, unusable journals), hardening (the regression scenarios of the security
review, ``test_rel_hardening.py``: idempotency poisoning, proxies, metric labels, body bounds and timeouts,
framing, h2c, FIFOs, aborted uploads, anonymous readiness, signed numbers and message ids), outage (the sidecar
down, draining, frozen and killed around approvals, ``test_rel_outage.py``: zero approvals lost, zero actions
left non-final after reconciliation), api (the OpenAPI property test,
``tests/integration/test_openapi_property.py``, with random draws and 200 × scale requests per
operation: one trial per operation). One real sidecar and host serve the race, security and host-crash
trials and every hardening or outage scenario that takes ``shared_pair``; a scenario that takes ``procs``, and the
sidecar-crash and storage trials, start processes of their own.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import chaoslib
import fuzzkit
import securitykit
import storagekit
import streamkit
from relkit import ACME_CREWS, OPERATIONS, TOKEN, AppThread, Processes, Tally, inproc_app

CATEGORIES = ("crash", "race", "hostile", "security", "storage", "hardening", "outage", "api")


class Runner:
    def __init__(self, workdir: Path, scale: int, rng: random.Random) -> None:
        self.workdir = workdir
        self.scale = scale
        self.rng = rng
        self.tally = Tally()
        self.seconds: dict[str, float] = {}
        self._count = 0

    def dir(self, name: str) -> Path:
        self._count += 1
        return self.workdir / f"{self._count:03d}-{name}"

    def trial(self, category: str, name: str, fn: Callable[..., Any]) -> Any:
        """One trial: passed unless it raises. ``fn`` is called without arguments (``...``: mypy cannot match
        ``lambda a=a: ...`` to ``Callable[[], Any]``)."""
        started = time.monotonic()
        try:
            value = fn()
        except Exception as exc:  # noqa: BLE001 - a failed trial is data here
            detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            self.tally.record(category, False, f"{name}: {detail[:500]}")
            value = None
        else:
            self.tally.record(category, True)
        self.seconds[category] = self.seconds.get(category, 0.0) + time.monotonic() - started
        return value

    def checks(self, category: str, name: str, fn: Callable[[], list[tuple[str, bool, str]]]) -> None:
        """Many checks at once (``[(check, ok, detail)]``); each counts as one trial."""
        started = time.monotonic()
        try:
            results = fn()
        except Exception as exc:  # noqa: BLE001
            results = [(name, False, "".join(traceback.format_exception_only(type(exc), exc)).strip()[:500])]
        for check, ok, detail in results:
            self.tally.record(category, ok, f"{name}: {check}: {detail}")
        self.seconds[category] = self.seconds.get(category, 0.0) + time.monotonic() - started

    def fuzz(self, category: str, name: str, strategy: Any, call: Callable[[Any], None], examples: int) -> None:
        from hypothesis import HealthCheck, given, settings

        count = {"n": 0}

        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            derandomize=False,
            suppress_health_check=list(HealthCheck),
        )
        @given(request=strategy)
        def run(request: Any) -> None:
            count["n"] += 1
            call(request)

        started = time.monotonic()
        try:
            run()
            failed = None
        except Exception as exc:  # noqa: BLE001
            failed = "".join(traceback.format_exception_only(type(exc), exc)).strip()[:500]
        row = self.tally.rows.setdefault(category, [0, 0])
        row[0] += count["n"]
        row[1] += count["n"] - (1 if failed else 0)
        if failed:
            self.tally.failures.append(f"{category}: {name}: {failed}")
        self.seconds[category] = self.seconds.get(category, 0.0) + time.monotonic() - started


def crash(r: Runner, shared_pair: tuple[Processes, Any, Any]) -> None:
    for n in range(r.scale):
        procs = Processes(r.dir("sidecar-kill9"))
        try:
            r.trial(
                "crash",
                f"sidecar kill -9 #{n}",
                lambda p=procs: chaoslib.sidecar_kill9(p, runs=6 + 2 * n, running_at_kill=r.rng.randint(1, 4)),
            )
        finally:
            procs.close()
    for _ in range(3 * r.scale):
        after = r.rng.randint(1, 12)
        r.trial(
            "crash",
            f"host kill -9 after {after} events",
            lambda a=after: chaoslib.host_kill9(shared_pair[0], shared_pair[1], after_events=a),
        )


def race(r: Runner, shared_pair: tuple[Processes, Any, Any]) -> None:
    procs, sidecar, host = shared_pair
    for n in range(2 * r.scale):
        r.trial("race", f"duplicates #{n}", lambda: chaoslib.duplicate_requests(procs, sidecar, host, n=20))
    for n in range(5 * r.scale):
        r.trial("race", f"decisions #{n}", lambda: chaoslib.decision_race(host, n=10))
    for _ in range(20 * r.scale):
        delay = r.rng.uniform(0.0, 0.16)
        r.trial("race", f"cancel after {delay:.3f} s", lambda d=delay: chaoslib.cancel_race(sidecar, host, d))


def hostile(r: Runner) -> None:
    from kits.fake_sidecar import FakeSidecar
    from kits.hostapp import SIDECAR_TOKEN, bearer
    from kits.sidecar_fakes import FAKE_CREWS, FakeExecutor, make_settings
    from kits.sidecar_fakes import TOKEN as FAKE_TOKEN

    from aip_crewai.sidecar.http.app import create_app

    host = AppThread(inproc_app(r.dir("fuzz-host"), streamkit.StreamingTransport(FakeSidecar(SIDECAR_TOKEN))))
    root = r.dir("fuzz-sidecar")
    root.mkdir(mode=0o700)
    sidecar = AppThread(
        create_app(make_settings(root, max_retained_runs=10**6), crews=FAKE_CREWS, executor=FakeExecutor()),
        base_url="http://sidecar",
    )
    try:

        def host_call(request: Any) -> None:
            fuzzkit.check_answer(request, *host.request(request[0], request[1], timeout=15, **request[2]))

        def sidecar_call(request: Any) -> None:
            method, url, kwargs = request
            kwargs = {**kwargs, "headers": {**kwargs.get("headers", {}), "Authorization": f"Bearer {FAKE_TOKEN}"}}
            fuzzkit.check_sidecar_answer(request, *sidecar.request(method, url, timeout=15, **kwargs))

        r.fuzz("hostile", "host fuzz", fuzzkit.host_requests(), host_call, 1000 * r.scale)
        r.fuzz("hostile", "sidecar fuzz", fuzzkit.sidecar_requests(), sidecar_call, 1000 * r.scale)
        who = streamkit.Principals(bearer("acme-invoker"), bearer("acme-both"), "cap:crewai:beta")
        for _n in range(r.scale):
            for name in [*streamkit.INPROC, "too_many_events"]:
                r.trial(
                    "hostile",
                    f"stream {name} in-process",
                    lambda c=name: streamkit.check_case(
                        c, streamkit.run_case(host.request, who, c, chaoslib.uid("corpus")), streamkit.stream_case(c)
                    ),
                )
    finally:
        host.close()
        sidecar.close()
    fake = streamkit.FakeSidecarServer(TOKEN, [*ACME_CREWS, "knowledge_b"], OPERATIONS)
    procs = Processes(r.dir("streams-http"))
    try:
        real = procs.host(fake.base_url)
        who = streamkit.Principals(
            {"Authorization": "Bearer tok-acme-app-1"},
            {"Authorization": "Bearer tok-acme-approver-1"},
            "cap:crewai:echo",
        )
        import httpx2

        with httpx2.Client(base_url=real.base_url, timeout=30) as http:

            def request(method: str, url: str, **kwargs: Any) -> Any:
                response = http.request(method, url, **kwargs)
                return response.status_code, response.headers, response.content

            for _n in range(r.scale):
                for name in streamkit.OVER_HTTP:
                    r.trial(
                        "hostile",
                        f"stream {name} over HTTP",
                        lambda c=name: streamkit.check_case(
                            c,
                            streamkit.run_case(request, who, c, chaoslib.uid("http")),
                            streamkit.stream_case(c, big=True),
                        ),
                    )
    finally:
        procs.close()
        fake.close()


def security(r: Runner, shared_pair: tuple[Processes, Any, Any]) -> None:
    procs, sidecar, host = shared_pair
    for _n in range(r.scale):
        r.checks("security", "host credentials", lambda: securitykit.host_credentials(host))
        r.checks("security", "sidecar credentials", lambda: securitykit.sidecar_credentials(sidecar))
        r.checks("security", "tenants", lambda: securitykit.cross_tenant(sidecar, host))
        r.checks("security", "secrets", lambda: securitykit.secrets_absent(procs, sidecar, host))
    r.checks("security", "start-up refusals", lambda: securitykit.startup_refusals(r.dir("refusals")))


def storage(r: Runner) -> None:
    for _n in range(r.scale):
        r.checks(
            "storage",
            "admission write failure",
            lambda: asyncio.run(storagekit.admission_write_failure(r.dir("admission-failure"))),
        )
        r.checks(
            "storage",
            "terminal write failure",
            lambda: asyncio.run(storagekit.terminal_write_failure(r.dir("terminal-failure"))),
        )
    procs = Processes(r.dir("fsize"))
    try:
        r.checks("storage", "file size limit", lambda: storagekit.file_size_limit(procs))
    finally:
        procs.close()
    procs = Processes(r.dir("bound"))
    try:
        r.checks("storage", "journal size bound", lambda: storagekit.journal_size_bound(procs))
    finally:
        procs.close()
    r.checks("storage", "unusable journals", lambda: storagekit.journal_refusals(r.dir("journals")))


def hardening(r: Runner, shared_pair: tuple[Processes, Any, Any]) -> None:
    """Every ``test_rel_*`` scenario of ``test_rel_hardening.py``, ``scale`` times each."""
    import test_rel_hardening

    scenarios(r, shared_pair, "hardening", test_rel_hardening)


def outage(r: Runner, shared_pair: tuple[Processes, Any, Any]) -> None:
    """Every ``test_rel_*`` scenario of ``test_rel_outage.py``, ``scale`` times each: the sidecar down,
    draining, frozen and killed around approvals (each asserts zero approvals lost and every action final)."""
    import test_rel_outage

    scenarios(r, shared_pair, "outage", test_rel_outage)


def api(r: Runner) -> None:
    """The OpenAPI property test against a real host of its own, drawing at random
    (``HYPOTHESIS_PROFILE=explore``) 200 × scale requests per operation; one trial per test."""
    import subprocess

    started = time.monotonic()
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "HYPOTHESIS_PROFILE": "explore", "AIP_CREWAI_API_EXAMPLES": str(200 * r.scale)}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rA",
            "-p",
            "no:cacheprovider",
            "tests/integration/test_openapi_property.py",
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    outcomes = 0
    for line in done.stdout.splitlines():
        if line.startswith("PASSED "):
            r.tally.record("api", True)
            outcomes += 1
        elif line.startswith(("FAILED ", "ERROR ")):
            r.tally.record("api", False, line[:500])
            outcomes += 1
    if outcomes == 0 or done.returncode not in (0, 1):
        r.tally.record("api", False, f"pytest exited {done.returncode}: {done.stdout[-500:]}{done.stderr[-500:]}")
    r.seconds["api"] = r.seconds.get("api", 0.0) + time.monotonic() - started


def scenarios(r: Runner, shared_pair: tuple[Processes, Any, Any], category: str, module: Any) -> None:
    """Every ``test_rel_*`` function of ``module``, ``scale`` times each, counted under ``category``: on the
    shared pair (a ``shared_pair`` parameter), on processes of its own (``procs``) or in a fresh directory
    (``tmp_path``)."""
    import inspect

    for name, fn in inspect.getmembers(module, inspect.isfunction):
        if not name.startswith("test_rel_"):
            continue
        parameter = next(iter(inspect.signature(fn).parameters))
        for n in range(r.scale):
            label = f"{name[len('test_rel_') :]} #{n}"
            if parameter == "shared_pair":
                r.trial(category, label, lambda fn=fn: fn(shared_pair))
            elif parameter == "procs":
                procs = Processes(r.dir(name[9:40]))
                try:
                    r.trial(category, label, lambda fn=fn, procs=procs: fn(procs))
                finally:
                    procs.close()
            else:
                fresh = r.dir(name[9:40])
                fresh.mkdir(mode=0o700, parents=True)
                r.trial(category, label, lambda fn=fn, fresh=fresh: fn(fresh))


def table(runner: Runner) -> str:
    lines = [f"{'category':<10} {'tried':>7} {'passed':>7} {'seconds':>8}", "-" * 35]
    for category in CATEGORIES:
        tried, passed = runner.tally.rows.get(category, [0, 0])
        lines.append(f"{category:<10} {tried:>7} {passed:>7} {runner.seconds.get(category, 0.0):>8.1f}")
    total_tried = sum(row[0] for row in runner.tally.rows.values())
    total_passed = sum(row[1] for row in runner.tally.rows.values())
    lines += ["-" * 35, f"{'total':<10} {total_tried:>7} {total_passed:>7} {sum(runner.seconds.values()):>8.1f}"]
    return "\n".join(lines)


def main() -> int:
    from aip_crewai.plumbing.log import configure_logging

    scale = max(1, int(os.environ.get("AIP_CREWAI_CHAOS_SCALE", "1") or "1"))
    seed = int(os.environ.get("AIP_CREWAI_CHAOS_SEED", str(random.randrange(1 << 30))))
    configure_logging(json=True, level="critical")  # expected errors of the scenarios stay quiet
    workdir = Path(tempfile.mkdtemp(prefix="aip-crewai-chaos-"))
    workdir.chmod(0o700)
    runner = Runner(workdir, scale, random.Random(seed))
    print(f"chaos: scale {scale}, seed {seed}, work directory {workdir}", flush=True)
    stack_procs = Processes(runner.dir("shared-pair"))
    try:
        sidecar = stack_procs.sidecar()
        host = stack_procs.host(sidecar.base_url)
        shared_pair = (stack_procs, sidecar, host)
        for category, run in (
            ("crash", lambda: crash(runner, shared_pair)),
            ("race", lambda: race(runner, shared_pair)),
            ("hostile", lambda: hostile(runner)),
            ("security", lambda: security(runner, shared_pair)),
            ("storage", lambda: storage(runner)),
            ("hardening", lambda: hardening(runner, shared_pair)),
            ("outage", lambda: outage(runner, shared_pair)),
            ("api", lambda: api(runner)),
        ):
            print(f"chaos: {category} ...", flush=True)
            run()
    finally:
        stack_procs.close()
    print()
    print(table(runner))
    if runner.tally.failures:
        print(f"\n{len(runner.tally.failures)} failure(s) (work directory kept: {workdir}):")
        for failure in runner.tally.failures:
            print(f"  - {failure}")
        return 1
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
