"""Schemathesis over ``/openapi.json`` against a real ``colocd serve`` process and a real reference engine.

Two properties, for every generated request, stateless and stateful (schemathesis chains operations
through the OpenAPI links, e.g. a session id from ``POST /v1/weights/sessions`` into its chunks, commit and
abort), with the token supplied through the document's ``securitySchemes`` (``bearerAuth``), not by hand:
  * never a 500: a caller's mistake is a 4xx, an engine's failure a 502/503/504;
  * a rejected request (4xx) leaves ``/v1/status`` exactly as it was.
Each answer is also checked against the OpenAPI document (declared status, error body shape).

Bounded (the ``fuzz`` marker): few examples per operation, short engine budgets in the node config, and
no example database, so it runs in the default suite in about two minutes on two cores.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.config import SchemathesisConfig
from schemathesis.specs.openapi.checks import status_code_conformance
from support import DaemonNode, daemon_node, reference_engine

pytestmark = [pytest.mark.fuzz, pytest.mark.timeout(420)]

TOKEN = "fuzz-token"
# Where the status legitimately moves with no request at all: health probes, the reconciliation reports of
# the health loop ("last", "at"), a session's idle clock, and "busy_with" while the health loop's own
# reconcile holds the transition lock for a moment ("reconcile:health").
_TICKING = frozenset({"healthy", "last_error", "last_seen", "checked_at", "observed_at", "uptime_s", "at", "last",
                      "idle_for_s", "busy_with"})

# Per operation: valid requests reach deeper (state rules, engines), so they get more of the time box.
_EXAMPLES = {GenerationMode.POSITIVE: 6, GenerationMode.NEGATIVE: 4}
_SETTINGS = settings(max_examples=6, deadline=None, database=None, derandomize=False, print_blob=True,
                     suppress_health_check=list(HealthCheck))


AUTH = {"Authorization": f"Bearer {TOKEN}"}  # this test's own setup calls; generated ones get it from the scheme


def _status(node: DaemonNode) -> dict[str, Any]:
    """The node's status minus fields that tick on their own."""
    response = httpx.get(f"{node.url}/v1/status", timeout=30, trust_env=False)
    response.raise_for_status()
    return _comparable(response.json())


def _comparable(value: Any) -> Any:
    """The status minus fields that tick on their own."""
    if isinstance(value, dict):
        return {k: _comparable(v) for k, v in value.items() if k not in _TICKING}
    if isinstance(value, list):
        return [_comparable(v) for v in value]
    return value


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def node(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[DaemonNode]:
    """``colocd serve`` (its own process: the generated requests reach the real server) over its own engine."""
    work = tmp_path_factory.mktemp("fuzz")
    async with reference_engine(log_path=work / "engine.log") as engine, daemon_node(
            {"ref0": str(engine.url)}, subprocess=True, workdir=work, token=TOKEN,
            # Short budgets: a generated request that waits on a rank or a group must not eat the time box.
            timeouts={"default_s": 10, "chunk_s": 2, "health_interval_s": 5, "master_reach_s": 0.3},
            limits={"max_body_bytes": 1024 * 1024}) as daemon:
        yield daemon


@pytest.fixture(scope="module")
def api_schema(node: DaemonNode) -> Any:
    config = SchemathesisConfig.from_dict({"auth": {"openapi": {"bearerAuth": {"bearer": TOKEN}}}})
    return schemathesis.openapi.from_url(f"{node.url}/openapi.json", config=config)


def _check(node: DaemonNode, case: Any, response: Any, before: dict[str, Any]) -> None:
    """The properties every answer must have; a failure names the request so it can be replayed."""
    request = f"{case.method} {case.formatted_path} body={str(getattr(case, 'body', None))[:300]!r}"
    status = response.status_code
    # The scheme supplies the token: a 401 only where the case spoiled it on purpose (negative security).
    assert status != 401 or (case.headers or {}).get("Authorization") != f"Bearer {TOKEN}", \
        f"{request} -> 401 though the security scheme gave it the token"
    assert status != 500, f"{request} -> 500 {response.text[:500]}\n{node.process.log_tail(3000)}"
    assert status < 500 or status in (502, 503, 504), f"{request} -> {status} {response.text[:300]}"
    if status >= 400:
        body = response.json()
        assert isinstance(body, dict) and body.get("error") and body.get("message"), \
            f"{request} -> {status} without the error shape: {response.text[:300]}"
    if 400 <= status < 500:
        after = _status(node)
        assert after == before, f"{request} -> {status} changed /v1/status:\nbefore {before}\nafter  {after}"


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_generated_request_gets_a_500_and_rejected_ones_change_nothing(
        api_schema: Any, node: DaemonNode, mode: GenerationMode) -> None:
    # Operations one by one in this test (schemathesis' own pytest parametrisation needs a newer pytest API).
    for result in api_schema.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(_SETTINGS, max_examples=_EXAMPLES[mode])
        def one(case: Any) -> None:
            if mode is GenerationMode.POSITIVE and case.method.upper() not in ("GET", "HEAD", "OPTIONS"):
                # Valid requests carry the token because the OpenAPI document says how (securitySchemes).
                assert (case.headers or {}).get("Authorization") == f"Bearer {TOKEN}", case.operation.label
            before = _status(node)
            response = case.call(timeout=60)
            _check(node, case, response, before)
            case.validate_response(response, checks=[status_code_conformance])

        try:
            one()
        except Unsatisfiable:
            assert mode is GenerationMode.NEGATIVE, f"{operation.label}: no valid request can be generated"
            # Nothing invalid can be written for it (e.g. GET /healthz takes no input).


def _enter_sync(node: DaemonNode) -> None:
    """Put the node where weight sessions may open, so generated sequences reach chunks, commits and aborts."""
    with httpx.Client(base_url=node.url, headers=AUTH, timeout=60, trust_env=False) as http:
        status = http.get("/v1/status").json()
        # A generated request (the previous sequence, or the stateless test) may have left a weight session
        # open, and a phase change is refused (409) while one is: end it first, as a trainer would.
        session = status.get("weight_session") or {}
        if session.get("state") == "open":
            http.post(f"/v1/weights/sessions/{session['id']}/abort")
        step, phase = int(status["node"]["step"]), status["node"]["phase"]

        def phase_to(target: str) -> None:
            r = http.post("/v1/phase", json={"step": step, "phase": target})
            assert r.status_code == 200, f"setup: {target}@{step} -> {r.status_code} {r.text[:500]}"

        if phase == "rollout":
            step += 1
            phase_to("train")
            phase = "train"
        if phase == "train":
            phase_to("sync")


def test_no_generated_sequence_gets_a_500_and_rejected_steps_change_nothing(api_schema: Any, node: DaemonNode) -> None:

    class Workflow(api_schema.as_state_machine()):  # type: ignore[misc]
        def setup(self) -> None:
            # Every sequence starts from one node state. The bundles (a session id, say) fill from the
            # daemon's replies, so a sequence that met a session its predecessor left open would draw other
            # rules for the same choices, and hypothesis refuses that as an inconsistent (flaky) strategy.
            _enter_sync(node)

        def get_call_kwargs(self, case: Any) -> dict[str, Any]:
            return {"timeout": 60}

        def before_call(self, case: Any) -> None:
            self.before = _status(node)

        def validate_response(self, response: Any, case: Any, additional_checks: Any = None, **kw: Any) -> None:
            _check(node, case, response, self.before)
            case.validate_response(response, checks=[status_code_conformance])

    Workflow.run(settings=settings(_SETTINGS, max_examples=8, stateful_step_count=8))
