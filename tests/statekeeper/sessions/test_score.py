import asyncio

import pytest
import torch

from statekeeper.sessions import InvalidRequest, TurnRequest

REPLY = [{"role": "user", "content": "Tell me about Rome."}, {"role": "assistant", "content": "Rome was not built in a day."}]


async def _turn(service, session, content, max_tokens=8):
    async for event in service.turn(session, TurnRequest(content, max_tokens=max_tokens)):
        pass
    return event


def test_scores_equal_an_independent_full_forward_and_leave_the_session_unchanged(make_service):
    service = make_service()
    worker = service.worker

    async def scenario():
        session = (await service.create(None, None)).id
        await _turn(service, session, "Hello, how are you today?")
        kv = [(k.clone(), v.clone()) for k, v in service.in_memory(session).cache.export_layers()]
        history = service.history.load(session)
        result = await service.score(session, REPLY)
        tokens, spans = service.turn_runner.teacher_forced_tokens(history, REPLY)
        (begin, end), = spans
        assert [t.token for t in result.tokens] == tokens[begin:end]
        assert tokens[end - 1] == worker.tokenizer.eos_token_id
        with torch.inference_mode():
            logits = worker.model(input_ids=torch.tensor([tokens])).logits[0]
        expected = torch.log_softmax(logits.float(), dim=-1)
        for offset, scored in enumerate(result.tokens):
            row = expected[begin + offset - 1]  # position i is predicted from position i - 1
            assert abs(scored.logprob - float(row[scored.token])) < 1e-3
            assert scored.greedy_token == int(row.argmax())
        assert service.history.load(session) == history
        for (k, v), (k2, v2) in zip(kv, service.in_memory(session).cache.export_layers()):
            assert torch.equal(k, k2) and torch.equal(v, v2)

    asyncio.run(scenario())


def test_score_from_storage_equals_score_from_memory(make_service):
    service = make_service(tiers=("lmdb",))

    async def scenario():
        session = (await service.create(None, None)).id
        await _turn(service, session, "Hello, how are you today?")
        hot = await service.score(session, REPLY)
        await service.offload(session)
        restored = await service.score(session, REPLY)
        assert restored.restore_source == "lmdb" and hot.restore_source == "active"
        assert [t.logprob for t in restored.tokens] == [t.logprob for t in hot.tokens]
        assert 0.0 <= hot.top1_agreement <= 1.0 and hot.mean_logprob < 0

    asyncio.run(scenario())


def test_score_on_a_new_session_and_after_recompute(make_service):
    service = make_service()

    async def scenario():
        session = (await service.create(None, None)).id
        first = await service.score(session, REPLY)
        assert first.restore_source == "active" and len(first.tokens) > 0
        await _turn(service, session, "Hi")
        await service.offload(session)
        service.tiers.delete(session)
        again = await service.score(session, REPLY)
        assert again.restore_source == "recompute"
        assert (await _turn(service, session, "ok")).restore_source == "active"

    asyncio.run(scenario())


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "only a question"}],
    [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}],
    [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}],
])
def test_bad_message_lists_are_refused(make_service, messages):
    service = make_service()

    async def scenario():
        session = (await service.create(None, None)).id
        with pytest.raises(InvalidRequest):
            await service.score(session, messages)

    asyncio.run(scenario())


@pytest.mark.parametrize("template, request_options", [
    ("tools-hermes", {"tools": [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]}),
    ("think", {"template_options": {"enable_thinking": False}})])
def test_scoring_renders_the_messages_as_the_conversations_turns_do(make_service, tiny_worker, monkeypatch, template,
                                                                     request_options):
    """Scoring rendered the scored messages without the conversation's tools and template options: a conversation
    whose turns offered tools was refused ("the chat template rewrites earlier turns"), and one with thinking
    off was scored after the thinking-on generation prompt. The scored reply follows the prompt a turn renders."""
    from benchmarks.harness.templates import template_text

    monkeypatch.setattr(tiny_worker.tokenizer, "chat_template", template_text(template))
    service = make_service(tiers=("dram",))

    async def scenario():
        session = (await service.create("Be brief.", None)).id
        async for _ in service.turn(session, TurnRequest("Hello there.", max_tokens=4, **request_options)):
            pass
        async with asyncio.timeout(30):  # a think-dropping template's next rendering, prepared after the reply
            while service.stats()["next_turn"]["prepared"] < (template == "think"):
                await asyncio.sleep(0.01)
        conversation = service.history.load(session)
        scored = await service.score(session, REPLY)
        prompt = service.formatter.extend(conversation.tokens, conversation.chat_messages() + REPLY[:1],
                                          conversation.tools, conversation.template_options).tokens
        sequence = prompt + service.formatter.encode(REPLY[1]["content"]) + [tiny_worker.tokenizer.eos_token_id]
        assert [score.token for score in scored.tokens] == sequence[len(prompt):]
        with torch.inference_mode():
            expected = torch.log_softmax(tiny_worker.model(input_ids=torch.tensor([sequence])).logits[0].float(), -1)
        for offset, score in enumerate(scored.tokens):  # position i is predicted from position i - 1
            assert abs(score.logprob - float(expected[len(prompt) + offset - 1][score.token])) < 1e-3

    asyncio.run(scenario())
