"""How failures reach the caller: an engine refusing the caller's data is a 422 with the engine's words, an
engine failing stays a 5xx, no message is ever empty, and an unexpected error keeps the connection usable."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI
from support import serve_app

from colocd.api.errors import install_error_handlers
from colocd.api.guard import RequestGuard
from colocd.engines.httpmap import caller_payload, map_http_errors
from colocd.errors import EngineRejected, EngineUnreachable, PayloadRejected


def test_an_engine_refusing_the_callers_payload_becomes_a_422_carrying_the_engines_words() -> None:
    with pytest.raises(PayloadRejected) as caught, caller_payload("handle"):
        raise EngineRejected("ref0", "update_weights_from_tensor#3: HTTP 400: shm segment 'x' does not exist",
                             status=400)
    assert caught.value.http_status == 422
    assert caught.value.field == "handle" and caught.value.engine == "ref0"
    assert "shm segment 'x' does not exist" in str(caught.value)


@pytest.mark.parametrize("status", [500, 503, 404])
def test_an_engine_failing_under_the_callers_payload_stays_an_engine_error(status: int) -> None:
    with pytest.raises(EngineRejected) as caught, caller_payload("handle"):
        raise EngineRejected("ref0", f"HTTP {status}: boom", status=status)
    assert caught.value.http_status == 502


@pytest.mark.parametrize("error", [httpx.ReadError(""), httpx.RemoteProtocolError(""), httpx.ConnectError("")])
def test_a_transport_error_without_text_still_says_what_happened(error: httpx.HTTPError) -> None:
    with pytest.raises(EngineUnreachable) as caught, map_http_errors("ref0", "update_weights_from_tensor#369"):
        raise error
    message = str(caught.value)
    assert message.startswith("engine 'ref0': update_weights_from_tensor#369: ")
    assert not message.rstrip().endswith(":") and len(caught.value.detail.split(": ", 2)[-1]) > 10, message


async def test_an_unexpected_error_is_a_500_in_the_error_shape_and_the_connection_survives() -> None:
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(RequestGuard, token=None, max_body_bytes=1024)

    @app.get("/bug")
    async def bug() -> None:
        raise KeyError("planted")

    @app.get("/fine")
    async def fine() -> dict[str, str]:
        return {"ok": "yes"}

    async with serve_app(app, ready_path="/fine") as url, httpx.AsyncClient(base_url=url) as client:
        r = await client.get("/bug")
        assert r.status_code == 500
        assert r.json()["error"] == "InternalError" and "planted" in r.json()["message"]
        assert (await client.get("/fine")).json() == {"ok": "yes"}  # same keep-alive connection
