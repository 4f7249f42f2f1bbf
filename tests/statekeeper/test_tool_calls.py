"""Tool calls in a reply (statekeeper/tool_calls.py): each format's calls parsed into OpenAI's shape, malformed
ones left as text, the format read from the chat template, and a streamed reply's content held back from
where a call may begin, so that what streams is what the whole reply returns."""

import json
import re

import pytest

from statekeeper.tool_calls import FORMATS, ToolCallStream, format_for

WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}


def calls_of(parsed):
    return [(call["type"], call["function"]["name"], json.loads(call["function"]["arguments"]))
            for call in parsed.tool_calls]


@pytest.mark.parametrize("name, text, content", [
    ("hermes", f"<tool_call>\n{json.dumps(WEATHER)}\n</tool_call>", ""),
    ("hermes", f"Let me look.\n<tool_call>{json.dumps(WEATHER)}</tool_call>", "Let me look.\n"),
    ("hermes", f"  \n<tool_call>{json.dumps(WEATHER)}", ""),  # an unclosed last block still parses
    ("mistral", f"[TOOL_CALLS][{json.dumps(WEATHER)}]", ""),
    ("mistral", f"Sure. [TOOL_CALLS]{json.dumps(WEATHER)}", "Sure. "),
    ("llama3_json", json.dumps({"name": "get_weather", "parameters": WEATHER["arguments"]}), ""),
    ("llama3_json", "<|python_tag|>" + json.dumps(WEATHER), ""),
])
def test_each_format_parses_a_call_into_openais_shape(name, text, content):
    parsed = FORMATS[name].parse(text)
    assert parsed.content == content
    assert calls_of(parsed) == [("function", "get_weather", WEATHER["arguments"])]
    assert parsed.tool_calls[0]["id"].startswith("call_") or name == "mistral"  # its ids: below


@pytest.mark.parametrize("name, text", [
    ("hermes", f"<tool_call>{json.dumps(WEATHER)}</tool_call><tool_call>{json.dumps({**WEATHER, 'name': 'b'})}"
               "</tool_call>"),
    ("mistral", f"[TOOL_CALLS][{json.dumps(WEATHER)}, {json.dumps({**WEATHER, 'name': 'b'})}]"),
    ("llama3_json", f"{json.dumps(WEATHER)}; {json.dumps({**WEATHER, 'name': 'b'})}"),
])
def test_several_calls_come_back_in_order(name, text):
    parsed = FORMATS[name].parse(text)
    assert [call[1] for call in calls_of(parsed)] == ["get_weather", "b"]
    assert len({call["id"] for call in parsed.tool_calls}) == 2


@pytest.mark.parametrize("name, text", [
    ("hermes", "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": </tool_call>"),  # bad JSON
    ("hermes", "<tool_call>{\"arguments\": {}}</tool_call>"),  # no name
    ("hermes", "<tool_call>{\"name\": \"f\", \"arguments\": [1]}</tool_call>"),  # arguments not an object
    ("hermes", f"<tool_call>{json.dumps(WEATHER)}</tool_call> and then some prose"),
    ("mistral", "[TOOL_CALLS] not json"),
    ("llama3_json", "{\"not\": \"a call\"}"),
    ("llama3_json", "{\"name\": \"f\", \"parameters\": {}} trailing"),
])
def test_a_malformed_call_is_the_whole_reply_as_text(name, text):
    parsed = FORMATS[name].parse(text)
    assert parsed.tool_calls is None and parsed.content == text


@pytest.mark.parametrize("name, text", [
    ("hermes", "<tool_call>" + "[" * 5000),  # nested past the JSON parser's recursion limit
    ("mistral", "[TOOL_CALLS]" + "[" * 5000),
    ("llama3_json", "{\"name\": \"f\", \"arguments\": " + "[" * 5000),
    ("hermes", "<tool_call>{\"name\": \"f\", \"arguments\": \"" + "[" * 5000 + "\"}</tool_call>"),
    ("hermes", f"<tool_call>{json.dumps({**WEATHER, 'name': 'functions.get_weather'})}</tool_call>"),  # OpenAI's
    ("hermes", f"<tool_call>{json.dumps({**WEATHER, 'name': 'get weather'})}</tool_call>"),  # name rule refuses
    ("hermes", f"<tool_call>{json.dumps({**WEATHER, 'name': 'f' * 65})}</tool_call>"),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"city": "\\ud800"}}</tool_call>'),  # no UTF-8 form
    ("llama3_json", '{"name": "Alice", "age": 30}'),  # a JSON answer, not a call
    ("mistral", '[TOOL_CALLS][{"name": "Alice", "age": 30}]'),
])
def test_a_call_no_response_could_carry_is_the_whole_reply_as_text(name, text):
    parsed = FORMATS[name].parse(text)
    assert parsed.tool_calls is None and parsed.content == text


def test_a_call_to_a_tool_that_was_not_offered_is_text():
    text = f"<tool_call>{json.dumps(WEATHER)}</tool_call>"
    assert FORMATS["hermes"].parse(text, {"get_time"}).tool_calls is None
    assert calls_of(FORMATS["hermes"].parse(text, {"get_time", "get_weather"}))[0][1] == "get_weather"


def test_mistral_calls_get_the_ids_its_templates_take():
    parsed = FORMATS["mistral"].parse(f"[TOOL_CALLS][{json.dumps(WEATHER)}]")
    assert re.fullmatch(r"[A-Za-z0-9]{9}", parsed.tool_calls[0]["id"])


def test_plain_text_is_content():
    for format_ in FORMATS.values():
        parsed = format_.parse("The weather in Paris is mild.")
        assert parsed.tool_calls is None and parsed.content == "The weather in Paris is mild."


def test_the_format_is_read_from_the_template_or_the_setting():
    assert format_for("{{ messages }}") is None  # no tools in the template
    assert format_for("{% if tools %}<tool_call>{% endif %}").name == "hermes"
    assert format_for("{% if tools %}[TOOL_CALLS]{% endif %}").name == "mistral"
    assert format_for("{% if tools %}<|python_tag|>{% endif %}").name == "llama3_json"
    assert format_for("{{ messages }}", "mistral").name == "mistral"
    assert format_for("{% if tools %}<tool_call>{% endif %}", "none") is None


def stream(name: str, pieces: list[str]) -> tuple[str, str, list[dict] | None]:
    """What a streamed reply sends as content, and what the whole reply parses to (content, calls)."""
    format_ = FORMATS[name]
    parsed = format_.parse("".join(pieces))
    held = ToolCallStream(format_)
    sent = "".join(held.feed(piece) for piece in pieces) + held.finish(parsed.tool_calls)
    return sent, parsed.content, parsed.tool_calls


def pieces_of(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("name, text", [
    ("hermes", f"Let me look.\n<tool_call>{json.dumps(WEATHER)}</tool_call>"),
    ("hermes", f"\n\n<tool_call>{json.dumps(WEATHER)}</tool_call>"),
    ("hermes", "A plain answer with < and <tool and <tool_cal in it."),
    ("hermes", f"<tool_call>{json.dumps(WEATHER)}</tool_call> then prose"),  # malformed: all of it, as text
    ("mistral", f"Sure. [TOOL_CALLS][{json.dumps(WEATHER)}]"),
    ("llama3_json", json.dumps(WEATHER)),
    ("llama3_json", "<|python_tag|>" + json.dumps(WEATHER)),
    ("llama3_json", "{ not a call at all"),
    ("llama3_json", "Plain text, no call."),
])
@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_streamed_content_is_what_the_whole_reply_returns(name, text, size):
    sent, content, calls = stream(name, pieces_of(text, size))
    assert sent == (content if calls else text)


def test_nothing_after_a_call_marker_streams_before_the_turn_ends():
    held = ToolCallStream(FORMATS["hermes"])
    assert held.feed("Checking. <tool") == "Checking. "  # "<tool" may begin a call
    assert held.feed("_call>{\"name\"") == ""
    assert held.holding
