"""Generated requests against the OpenAPI schema (issue 14), sent over HTTP to the service under uvicorn:
no response is a 5xx, and every response, errors included, is one the schema documents, in the
documented shape. Bounded: EXAMPLES_PER_OPERATION generated requests per operation over the tiny model,
with small limits so that turns stay short."""

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.harness.live_server import live_server

TOKEN = "fuzz-admin-token-0123456789"
EXAMPLES_PER_OPERATION = 150


@pytest.fixture
def base_url(make_service):
    service = make_service(tiers=("dram",), max_content_chars=64, max_tokens_limit=3)
    with live_server(service, admin_token=TOKEN) as url:
        yield url


def test_every_generated_request_gets_a_documented_answer(base_url):
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    # Half the generated session ids are replaced by real sessions', so turns, scoring, offload, prefetch
    # and delete run on live conversations too, not only into 404s.
    sessions = [httpx.post(f"{base_url}/v1/sessions", json={}).json()["id"] for _ in range(4)]
    model = httpx.get(f"{base_url}/v1/models").json()["data"][0]["id"]

    def new_response() -> str:
        body = {"model": model, "input": "Hi", "max_output_tokens": 2}
        return httpx.post(f"{base_url}/v1/responses", json=body).json()["id"]

    responses = [new_response() for _ in range(2)]
    admin = {"Authorization": f"Bearer {TOKEN}"}
    sent, statuses = [], {}
    for result in schema.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy(), real=st.sampled_from([None, *sessions]), exchange=st.booleans())
        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def call(case, real, exchange):
            if real is not None and "session_id" in (case.path_parameters or {}):
                if case.method == "DELETE":  # a fresh one: the shared sessions stay for the other routes
                    real = httpx.post(f"{base_url}/v1/sessions", json={}).json()["id"]
                case.path_parameters["session_id"] = real
                if isinstance(case.body, dict) and case.body.get("max_tokens", 0) > 3:
                    case.body["max_tokens"] = 3  # within the service's limit: the turn runs
                if exchange and case.path.endswith("/move"):  # a tier this service has, not a random name
                    case.body = {"tier": "dram"}
                if exchange and case.path.endswith("/score"):  # random roles rarely make a scorable exchange
                    case.body = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
            if real is not None and "key_id" in (case.path_parameters or {}):  # a real key to revoke
                case.path_parameters["key_id"] = httpx.post(f"{base_url}/v1/admin/keys", json={"tenant": "fuzz"},
                                                            headers=admin).json()["key_id"]
            if real is not None and "response_id" in (case.path_parameters or {}):  # a real response
                case.path_parameters["response_id"] = new_response() if case.method == "DELETE" else responses[0]
            if real is not None and case.path == "/v1/responses" and isinstance(case.body, dict):
                case.body["previous_response_id"] = responses[1] if exchange else None
            if real is not None and case.path in ("/v1/chat/completions", "/v1/responses") and isinstance(case.body, dict):
                case.body["model"] = model  # the served model, so that completions run too, not only 404s
                for limit in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
                    if isinstance(case.body.get(limit), int) and case.body[limit] > 3:
                        case.body[limit] = 3
            response = case.call(base_url=base_url, headers={"Authorization": f"Bearer {TOKEN}"})
            sent.append(response.status_code)
            statuses.setdefault(operation.label, set()).add(response.status_code)
            assert response.status_code < 500, f"{case.method} {case.formatted_path}: {response.text[:300]}"
            # Schema-valid requests the service still refuses (a session id that does not exist, a turn
            # past the model's context, the service's own content limit) are documented errors, not failures.
            case.validate_response(response, excluded_checks=[schemathesis.checks.positive_data_acceptance])

        call()
    assert len(sent) >= 1000
    served = {label for label, codes in statuses.items() if codes & {200, 201, 204}}
    assert served == statuses.keys(), {label: statuses[label] for label in statuses.keys() - served}
