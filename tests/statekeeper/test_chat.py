import pytest

from statekeeper.chat import ChatFormatter


@pytest.fixture
def formatter(tiny_worker):
    return ChatFormatter(tiny_worker.tokenizer)


def test_turns_only_append_tokens(formatter):
    messages = [{"role": "user", "content": "Hello, how are you today?"}]
    first = formatter.extend([], messages)
    assert first.is_append_only and formatter.decode(first.tokens) == formatter.render(messages, True)
    # The reply as a model would produce it: content tokens then the end-of-turn token.
    reply = "Fine  thanks!  "  # double spaces tokenize differently inside a longer string
    generated = formatter.encode(reply) + [formatter.tokenizer.eos_token_id]
    history = first.tokens + generated
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Tell me about Rome."}]
    second = formatter.extend(history, messages)
    assert second.is_append_only
    assert second.tokens[: len(history)] == history
    assert formatter.decode(second.tokens) == formatter.render(messages, True)


def test_retokenizing_would_shift_tokens_but_extend_does_not(formatter):
    """The reason extend never re-tokenizes: generated token boundaries differ from the canonical ones."""
    messages = [{"role": "user", "content": "Remember it"}]
    prompt = formatter.extend([], messages).tokens
    # A model may emit "fox" as single characters; canonical tokenization merges them.
    generated = [t for ch in "fox jumps" for t in formatter.encode(ch)] + [formatter.tokenizer.eos_token_id]
    messages += [{"role": "assistant", "content": "fox jumps"}, {"role": "user", "content": "ok"}]
    full = formatter.encode(formatter.render(messages, True))
    extended = formatter.extend(prompt + generated, messages)
    assert extended.is_append_only and extended.tokens[: len(prompt + generated)] == prompt + generated
    assert extended.tokens != full


def test_template_that_rewrites_history_is_detected(formatter):
    messages = [{"role": "user", "content": "Hello"}]
    tokens = formatter.extend([], messages).tokens + formatter.encode("Hi") + [formatter.tokenizer.eos_token_id]
    edited = [{"role": "user", "content": "Hello EDITED"}, {"role": "assistant", "content": "Hi"},
              {"role": "user", "content": "again"}]
    result = formatter.extend(tokens, edited)
    assert not result.is_append_only
    assert formatter.decode(result.tokens) == formatter.render(edited, True)


def test_a_chat_template_file_replaces_the_models_and_a_broken_one_is_refused(tiny_model_dir, tmp_path):
    from statekeeper.config import WorkerConfig
    from statekeeper.model_loader import load_model
    from statekeeper.worker import ModelWorker

    from tests.conftest import MODEL_CACHE

    def worker(template: str | None, name="template.jinja"):
        path = None
        if template is not None:
            path = tmp_path / name
            path.write_text(template)
        config = WorkerConfig(model=str(tiny_model_dir), model_cache_dir=MODEL_CACHE, chat_template=path)
        return ModelWorker(load_model(config.model, config.model_cache_dir), config)

    plain = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    formatter = ChatFormatter(worker(plain).tokenizer)
    assert formatter.render([{"role": "user", "content": "hi"}], add_generation_prompt=True) == "[user] hi\n"
    with pytest.raises(ValueError, match="broken.jinja does not render"):
        worker("{% for m in messages %}{{ m['content'] }", "broken.jinja")  # a Jinja syntax error
    with pytest.raises(ValueError, match="raises.jinja does not render"):
        worker("{{ raise_exception('no system prompts') }}", "raises.jinja")
    with pytest.raises(ValueError, match="missing.jinja"):
        config = WorkerConfig(model=str(tiny_model_dir), model_cache_dir=MODEL_CACHE,
                              chat_template=tmp_path / "missing.jinja")
        ModelWorker(load_model(config.model, config.model_cache_dir), config)


THINK_ON = ("{% for message in messages %}"
            "{% set content = message['content'].split('</think>')[-1].lstrip('\\n') if message['role'] == 'assistant' "
            "else message['content'] %}"
            "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}")
THINK_OFF = THINK_ON.replace("<think>\\n'", "<think>\\n\\n</think>\\n\\n'")
assert THINK_OFF != THINK_ON


@pytest.mark.parametrize("template, text, reasoning, content", [
    (THINK_ON, "Let me see.\n</think>\n\nParis.", "Let me see.\n", "Paris."),
    (THINK_ON, "cut before it closed", "cut before it closed", ""),  # max_tokens ended the reply in its block
    (THINK_OFF, "Paris.", "", "Paris."),
    (THINK_OFF, "<think>\nhmm</think>Paris.", "\nhmm", "Paris."),  # a model that thinks anyway
    (None, "Fine </think> thanks", None, "Fine </think> thanks"),  # no think blocks in the template: all answer
])
def test_a_reply_splits_into_reasoning_and_answer_whole_and_streamed(formatter, monkeypatch, template, text,
                                                                     reasoning, content):
    if template is not None:
        monkeypatch.setattr(formatter.tokenizer, "chat_template", template)
    formatter = ChatFormatter(formatter.tokenizer)  # its template answers are cached per formatter
    assert formatter.opens_thinking() == (template is THINK_ON)
    whole = formatter.split_reasoning(text)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    for cut in range(len(text) + 1):  # streamed in two pieces cut anywhere, the closing tag too
        for cut2 in (cut, min(len(text), cut + 3)):
            splitter = formatter.reasoning_splitter()
            if splitter is None:
                continue
            pieces = [*splitter.feed(text[:cut]), *splitter.feed(text[cut:cut2]), *splitter.feed(text[cut2:]),
                      *splitter.finish()]
            assert "".join(p for kind, p in pieces if kind == "reasoning") == reasoning
            assert "".join(p for kind, p in pieces if kind == "content") == content


@pytest.mark.parametrize("template, text, closes", [
    (THINK_ON, "Let me see.\n</think>\n\nParis.", True),
    (THINK_ON, "cut before it closed", False),  # all reasoning
    (THINK_OFF, "Paris.", False),  # no reasoning
    (THINK_OFF, "<think>\nhmm</think>Paris.", True),
    (None, "Fine </think> thanks", False),  # no think blocks in the template: no reasoning
])
def test_reasoning_tokens_end_with_the_one_that_closes_the_block(formatter, monkeypatch, template, text, closes):
    if template is not None:
        monkeypatch.setattr(formatter.tokenizer, "chat_template", template)
    formatter = ChatFormatter(formatter.tokenizer)
    tokens = formatter.encode(text)
    reply = formatter.split_reasoning(text)
    count = formatter.reasoning_tokens(tokens, reply)
    if closes:
        assert "</think>" in formatter.decode(tokens[:count]) and "</think>" not in formatter.decode(tokens[:count - 1])
        assert count < len(tokens)
    else:
        assert count == (len(tokens) if reply.reasoning else 0)


@pytest.mark.parametrize("template, moves", [("system-last", True), ("think-off", False), ("dated", False), (None, False)])
def test_a_template_that_moves_the_system_prompt_is_told_apart(formatter, monkeypatch, template, moves):
    """Only a template that renders a turn's prompt otherwise once a reply follows it gets the next turn's head
    prepared while that reply is generated: for the others the probe finds nothing, once."""
    from benchmarks.harness.templates import template_text

    if template is not None:
        monkeypatch.setattr(formatter.tokenizer, "chat_template", template_text(template))
    assert ChatFormatter(formatter.tokenizer).moves_earlier_turns is moves


# As Llama 3.1's template reads the date: `date_string` if the client gives it, else strftime_now if defined.
LLAMA_DATE = (
    "{%- if not date_string is defined %}{%- if strftime_now is defined %}"
    "{%- set date_string = strftime_now(\"%d %b %Y\") %}{%- else %}{%- set date_string = \"26 Jul 2024\" %}"
    "{%- endif %}{%- endif %}"
    "{{ 'Today Date: ' + date_string + ' (' + strftime_now('%Y-%m-%d') + ')\\n' }}"
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\\n' }}{% endfor %}"
)


@pytest.mark.parametrize("template", ["dated", "llama"])
def test_a_formatter_on_a_date_renders_that_date_where_the_template_writes_today(formatter, monkeypatch, template):
    """The date rollover prepares the turns after a midnight before it (sessions/date_rollover.py): it renders
    the next date as the template will once that date is today."""
    import datetime

    from benchmarks.harness.templates import template_text

    monkeypatch.setattr(formatter.tokenizer, "chat_template", template_text("dated") if template == "dated" else LLAMA_DATE)
    messages = [{"role": "user", "content": "What day is it?"}]
    today = datetime.date.today()
    assert formatter.on_date(today).render(messages, True) == formatter.render(messages, True)
    new_year = formatter.on_date(datetime.date(2031, 1, 1)).render(messages, True)
    assert "01 Jan 2031" in new_year and today.strftime("%d %b %Y") not in new_year
    if template == "llama":
        assert "(2031-01-01)" in new_year
    client_dated = formatter.on_date(datetime.date(2031, 1, 1)).render(messages, True, options={"date_string": "1 May"})
    assert "Today Date: 1 May" in client_dated  # the client's date wins, as it does today


@pytest.mark.parametrize("template", [
    "{{ strftime_now(fmt) }}{% for m in messages %}{{ m['content'] }}{% endfor %}",  # a format not known in advance
    "{% for m in messages %}{{ m['content'] }}{% endfor %}",  # no date at all
    "{{ strftime_now('%d %b %Y %H:%M') }}{% for m in messages %}{{ m['content'] }}{% endfor %}",  # the time of day
])
def test_a_template_that_reads_the_date_otherwise_has_no_formatter_on_a_date(formatter, monkeypatch, template):
    import datetime

    monkeypatch.setattr(formatter.tokenizer, "chat_template", template)
    assert formatter.on_date(datetime.date(2031, 1, 1)) is None


def test_resent_call_arguments_nested_past_the_json_parsers_limit_render_as_the_text_they_are(formatter, monkeypatch):
    """A client's assistant message whose call arguments are JSON text too deep for the parser (RecursionError,
    not ValueError): rendered as text, as arguments that are not JSON are."""
    from benchmarks.harness.templates import template_text

    monkeypatch.setattr(formatter.tokenizer, "chat_template", template_text("tools-hermes"))
    deep = "[" * 5000
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": deep}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    assert deep in formatter.render(messages, add_generation_prompt=False)


def test_options_of_a_type_the_template_cannot_use_are_the_requests_fault(formatter, monkeypatch):
    from benchmarks.harness.templates import template_text
    from statekeeper.chat import TemplateRefused

    monkeypatch.setattr(formatter.tokenizer, "chat_template", template_text("dated"))
    with pytest.raises(TemplateRefused, match="chat template"):
        formatter.render([{"role": "user", "content": "hi"}], True, options={"date_string": 5})


# Mistral's layout: the system prompt inside the last user turn, after that turn's last special token.
SYSTEM_IN_LAST_USER = (
    "{%- set system = messages[0]['content'] if messages[0]['role'] == 'system' else '' -%}"
    "{%- set turns = messages[1:] if system else messages -%}"
    "{%- set last = namespace(user=-1) -%}"
    "{%- for m in turns %}{% if m['role'] == 'user' %}{% set last.user = loop.index0 %}{% endif %}{% endfor -%}"
    "{%- for m in turns -%}"
    "{%- if m['role'] == 'user' -%}{{ '<|im_start|>[INST] ' }}{% if loop.index0 == last.user and system %}"
    "{{ system + '\\n\\n' }}{% endif %}{{ m['content'] + ' [/INST]' }}"
    "{%- else -%}{{ ' ' + m['content'] + '<|im_end|>' }}{%- endif -%}"
    "{%- endfor -%}"
)


@pytest.mark.parametrize("template", ["system-last", "think-off", "dated", "system-in-last-user"])
@pytest.mark.parametrize("text", ["\n\nWhat comes next?", "  Two spaces first.", "Plain text."])
def test_a_prepared_next_turn_tokenizes_the_users_text_as_a_fresh_rendering_does(smollm2_worker, monkeypatch,
                                                                                  template, text):
    """The next turn's state prepared in background time ends where what follows cannot change its tokens: the
    next turn's text is encoded with the rest, as a fresh rendering encodes it. Ended after "user\\n", SmolLM2's
    tokenizer split a message that starts with newlines or spaces otherwise than that rendering does ("\\n" then
    "\\n\\n" for "\\n\\n\\n"), so a prepared conversation was fed other tokens than an unprepared one. Ended at the
    last special token, a template that writes the system prompt after it (Mistral's) left the whole system
    prompt to prefill at every turn: what is left is about the user's text."""
    import datetime

    from benchmarks.harness.templates import template_text

    tokenizer = smollm2_worker.tokenizer
    chat_template = SYSTEM_IN_LAST_USER if template == "system-in-last-user" else template_text(template)
    monkeypatch.setattr(tokenizer, "chat_template", chat_template)
    formatter = ChatFormatter(tokenizer)
    # Long enough that its end alone is probed (ChatFormatter._settled) where it follows the last special token
    system = "Be brief. " + "Answer as a careful historian would, citing the sources you know. " * 12
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hello there."}]
    prompt = formatter.extend([], messages).tokens
    reply = "Hi! How can I help?"
    if template == "think-off":
        reply = "<think>\nA greeting.\n</think>\n\n" + reply
    history = messages + [{"role": "assistant", "content": reply}]
    tokens = prompt + formatter.encode(reply) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    if template == "dated":  # renders otherwise only after a midnight, as the date rollover prepares it
        formatter = formatter.on_date(datetime.date.today() + datetime.timedelta(days=1))
    plan = formatter.next_turn(tokens, history)
    assert plan is not None
    follow_up = history + [{"role": "user", "content": text}]
    extension = formatter.extend(plan.tokens, follow_up)
    assert extension.is_append_only
    assert extension.tokens == formatter.encode(formatter.render(follow_up, add_generation_prompt=True))
    rendered = formatter.render(follow_up, add_generation_prompt=True)
    after = rendered[rendered.rindex(text) + len(text) :]  # the template's own, after the text
    assert len(extension.tokens) - len(plan.tokens) <= len(formatter.encode(text)) + len(formatter.encode(after)) + 4


def test_a_chat_template_file_serves_a_model_that_has_none(base_model_dir):
    """A base model's directory has no chat template: the loader refused it before CHAT_TEMPLATE's file (as
    vLLM's --chat-template, made for this) could be applied. Without a file it is still refused, and says so."""
    from statekeeper.config import WorkerConfig
    from statekeeper.model_loader import load_model
    from statekeeper.worker import ModelWorker

    from tests.conftest import MODEL_CACHE

    base, template = base_model_dir
    config = WorkerConfig(model=str(base), model_cache_dir=MODEL_CACHE, chat_template=template)
    worker = ModelWorker(load_model(config.model, config.model_cache_dir), config)
    assert worker.tokenizer.chat_template == template.read_text()
    with pytest.raises(RuntimeError, match="no chat template.*CHAT_TEMPLATE"):
        bare = WorkerConfig(model=str(base), model_cache_dir=MODEL_CACHE)
        ModelWorker(load_model(bare.model, bare.model_cache_dir), bare)


# Phi-4-reasoning's shape: the think tags named in a default system prompt, every reply rendered as sent.
VERBATIM_REASONING = (
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nThink first, inside <think> </think>, then answer.<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_a_reasoning_template_that_renders_replies_as_sent_still_prepares_the_next_turn(tiny_worker, monkeypatch):
    """The service keeps a reply's answer in the history and its whole text (think block included) in the
    tokens, so the next turn of a template that knows think blocks renders otherwise than the tokens even where
    the template drops nothing itself: the probe found such a template append-only, and the next turn's
    preparation was never made (found by review)."""
    monkeypatch.setattr(tiny_worker.tokenizer, "chat_template", VERBATIM_REASONING)
    formatter = ChatFormatter(tiny_worker.tokenizer)
    user = {"role": "user", "content": "What is 2+2?"}
    text = "<think>\nTwo and two.\n</think>\n\nIt is 4."
    tokens = formatter.encode(formatter.render([user], add_generation_prompt=True) + text + "<|im_end|>")
    history = [user, {"role": "assistant", "content": formatter.split_reasoning(text).content}]
    assert not formatter.extend(tokens, history + [{"role": "user", "content": "And 3+3?"}]).is_append_only
    assert formatter.next_turn(tokens, history) is not None


@pytest.mark.parametrize("template, rewrites", [(None, False), ("think-off", True), ("think", True),
                                                ("system-last", True), ("dated", True), ("tools-hermes", True)])
def test_only_a_template_that_rewrites_earlier_turns_renders_the_next_turn(formatter, monkeypatch, template,
                                                                             rewrites):
    """A turn's end rendered the whole history again to find what the next turn renders otherwise: for a
    template that only appends (the bundled ChatML) nothing, at every turn, on a thread beside the model
    thread's. The template is probed once instead."""
    from benchmarks.harness.templates import template_text

    if template is not None:
        monkeypatch.setattr(formatter.tokenizer, "chat_template", template_text(template))
    probed = ChatFormatter(formatter.tokenizer)
    assert probed.rewrites_history is rewrites
    if not rewrites:
        probed.render = None  # next_turn renders nothing
        assert probed.next_turn([1, 2, 3], [{"role": "user", "content": "Hi"}]) is None
