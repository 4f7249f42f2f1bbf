"""No session id or API key reaches the log (issue 15): uvicorn's access lines and the service's own lines
carry a short tag instead, the same for the same conversation."""

import logging

import httpx

from api.logs import redact
from benchmarks.harness.live_server import live_server

ADMIN = "admin-token-0123456789abcdef"


class Captured(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(self.format(record))


def test_no_session_id_or_key_in_the_log(make_service):
    captured = Captured()
    loggers = [logging.getLogger(), logging.getLogger("uvicorn.access")]  # uvicorn's does not propagate
    for logger in loggers:
        logger.addHandler(captured)
    previous = logging.getLogger().level
    logging.getLogger().setLevel(logging.INFO)
    try:
        service = make_service()
        with live_server(service, log_level="info", admin_token=ADMIN, auth="api_key") as url:
            created = httpx.post(f"{url}/v1/admin/keys", json={"tenant": "acme"},
                                 headers={"Authorization": f"Bearer {ADMIN}"}).json()
            key = created["key"]
            auth = {"Authorization": f"Bearer {key}"}
            session = httpx.post(f"{url}/v1/sessions", json={}, headers=auth).json()["id"]
            httpx.post(f"{url}/v1/sessions/{session}/messages", json={"content": "Hi", "max_tokens": 2}, headers=auth)
            httpx.post(f"{url}/v1/sessions/{session}/offload", headers=auth)  # the service logs the offload
            httpx.get(f"{url}/v1/sessions/{session}", headers=auth)
            # A stored response's id names its conversation (GET /v1/responses/{id}): as secret as the session id
            response = httpx.post(f"{url}/v1/responses", json={"model": service.model_id, "input": "Hi",
                                                                "max_output_tokens": 2}, headers=auth).json()["id"]
            httpx.get(f"{url}/v1/responses/{response}", headers=auth)
            httpx.delete(f"{url}/v1/admin/keys/{created['key_id']}", headers={"Authorization": f"Bearer {ADMIN}"})
    finally:
        for logger in loggers:
            logger.removeHandler(captured)
        logging.getLogger().setLevel(previous)
    log = "\n".join(captured.lines)
    assert f"/v1/sessions/{redact(session)}/messages" in log  # the access lines were there, redacted
    assert "offloaded" in log  # and the service's own
    assert f"/v1/responses/{redact(response)}" in log
    for secret in (session, key, key.split(".")[1], created["key_id"], response, response.removeprefix("resp_")):
        assert secret not in log


class Formatted(Captured):
    """Formats with uvicorn's own AccessFormatter, as its default logging config does, and keeps what
    fails to format instead of letting logging print '--- Logging error ---'."""

    def __init__(self):
        super().__init__()
        from uvicorn.logging import AccessFormatter

        self.setFormatter(AccessFormatter('%(client_addr)s - "%(request_line)s" %(status_code)s', use_colors=False))
        self.errors = []

    def emit(self, record):
        try:
            super().emit(record)
        except Exception as error:  # noqa: BLE001 - what logging would have printed as a traceback
            self.errors.append(repr(error))


def test_access_lines_of_requests_naming_a_conversation_format_with_uvicorns_formatter(make_service):
    formatted = Formatted()
    access = logging.getLogger("uvicorn.access")
    with live_server(make_service(), log_level="info") as url:
        access.addHandler(formatted)  # after uvicorn's logging config, which replaces the logger's handlers
        try:
            session = httpx.post(f"{url}/v1/sessions", json={}).json()["id"]
            httpx.get(f"{url}/v1/sessions/{session}")
            httpx.get(f"{url}/v1/sessions/{session}/messages?limit=5")
        finally:
            access.removeHandler(formatted)
    assert formatted.errors == []
    log = "\n".join(formatted.lines)
    assert f'"GET /v1/sessions/{redact(session)} HTTP/1.1" 200' in log
    assert f'"GET /v1/sessions/{redact(session)}/messages?limit=5 HTTP/1.1" 200' in log
    assert '"POST /v1/sessions HTTP/1.1" 201' in log and session not in log
