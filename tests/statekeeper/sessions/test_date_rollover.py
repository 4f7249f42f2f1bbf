"""A template that writes today's date (Llama 3.x's "Today Date") renders another system turn after midnight, so
the first turn after it shared only the few tokens before the date with the stored state: a full recompute.
At the service's date change its conversations' next turns are prepared in background time, from memory or
from storage, and that turn only appends, replying as a fresh prefill of its prompt does. The service's day is
its local time (TZ); these tests move it by changing TZ between a zone 12 hours behind UTC and one 12 hours
ahead, whose dates always differ by one day."""

import asyncio
import datetime
import os
import time

import pytest

from statekeeper.chat import ChatFormatter
from statekeeper.sessions import TurnRequest
from tests.statekeeper.sessions.test_chat_shapes import TURNS, _fresh_reply, _turn, a_turn_arrives_at_the_first_job

DATED = (
    "{%- if date_string is not defined -%}{%- set date_string = strftime_now('%d %b %Y') -%}{%- endif -%}"
    "{{ '<|im_start|>system\\nToday Date: ' + date_string + '<|im_end|>\\n' }}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
BEHIND, AHEAD = "WEST+12", "EAST-12"  # POSIX TZ: UTC-12 and UTC+12


async def _conversations_with_a_turn(service, count: int = 1, offloaded: bool = False) -> list[str]:
    """`count` new conversations, each with its first turn done before the midnight (and what the turns left to
    run: their own next-turn checks, the same day, nothing to do); offloaded, their KV is stored."""
    sessions = [(await service.create(None, None)).id for _ in range(count)]
    for session in sessions:
        await _turn(service, session, TURNS[0])
    await asyncio.sleep(0.01)
    if offloaded:
        for session in sessions:
            await service.offload(session)
    return sessions


async def _appends_and_replies_as_a_fresh_prefill(service, worker, session, content, cached: int):
    """The next turn restores nothing (its KV is active), keeps `cached` tokens, and replies as a fresh prefill
    of its prompt does; its result."""
    result = await _turn(service, session, content)
    assert result.restore_source == "active" and result.cached_tokens == cached
    after = service.history.load(session).tokens
    assert after[result.prompt_tokens:] == _fresh_reply(worker, after, result.prompt_tokens, result.completion_tokens)
    return result


def _after_midnight(worker, history, content: str):
    """The rendering of a turn sending `content` after the midnight onto `history`: it shares only the few tokens
    before the date with the history's."""
    messages = history.chat_messages() + [{"role": "user", "content": content}]
    extension = ChatFormatter(worker.tokenizer).extend(history.tokens, messages)
    assert extension.common < 20
    return extension


async def _renders_and_replies_as_a_fresh_prefill(service, worker, session, content, prompt: list[int]):
    """The turn sending `content` has `prompt` for its prompt and replies as a fresh prefill of it does; its
    result."""
    result = await _turn(service, session, content)
    after = service.history.load(session).tokens
    assert after[: result.prompt_tokens] == prompt
    assert after[result.prompt_tokens:] == _fresh_reply(worker, after, result.prompt_tokens, result.completion_tokens)
    return result


@pytest.fixture
def dated(tiny_worker, monkeypatch):
    monkeypatch.setattr(tiny_worker.tokenizer, "chat_template", DATED)
    return tiny_worker


@pytest.fixture
def time_zone():
    """Sets the process's time zone (what strftime_now and date.today read); restored afterwards."""
    before = os.environ.get("TZ")

    def set_zone(zone: str) -> None:
        os.environ["TZ"] = zone
        time.tzset()

    yield set_zone
    if before is None:
        os.environ.pop("TZ", None)
    else:
        os.environ["TZ"] = before
    time.tzset()


@pytest.mark.parametrize("between_turns", ["active", "offloaded"])
def test_at_midnight_the_next_turns_state_is_prepared_and_the_turn_after_it_only_appends(
        make_service, dated, time_zone, between_turns):
    time_zone(BEHIND)
    service = make_service(tiers=("dram",))
    formatter = ChatFormatter(dated.tokenizer)
    assert formatter.renders_today

    async def scenario():
        [session] = await _conversations_with_a_turn(service, offloaded=between_turns == "offloaded")
        assert await service.date_rollover.check() == 0  # the same day: nothing to do
        time_zone(AHEAD)  # midnight passed
        before = service.history.load(session)
        messages = before.chat_messages() + [{"role": "user", "content": TURNS[1]}]
        extension = formatter.extend(before.tokens, messages)
        assert not extension.is_append_only and extension.common < 20  # the date, in the system turn, parts them
        assert await service.date_rollover.check() == 1
        prepared = service.history.load(session).tokens
        live = service.in_memory(session)
        assert prepared == live.conversation.tokens and live.cache.num_tokens == len(prepared)
        assert formatter.extend(prepared, messages).is_append_only
        result = await _appends_and_replies_as_a_fresh_prefill(service, dated, session, TURNS[1], len(prepared))
        after = service.history.load(session).tokens
        assert after[: result.prompt_tokens] == extension.tokens  # the prompt a fresh rendering gives
        counters = service.stats()["next_turn"]
        assert counters["date_changes"] == 1 and counters["after_date_change"] == 1

    asyncio.run(scenario())


def test_a_conversation_whose_client_sends_the_date_is_left_alone(make_service, dated, time_zone):
    time_zone(BEHIND)
    service = make_service(tiers=("dram",))

    async def scenario():
        session = (await service.create(None, None)).id
        request = TurnRequest(TURNS[0], max_tokens=6, template_options={"date_string": "25 Nov 2026"})
        async for _ in service.turn(session, request):
            pass
        tokens = service.history.load(session).tokens
        time_zone(AHEAD)
        assert await service.date_rollover.check() == 0
        assert service.history.load(session).tokens == tokens

    asyncio.run(scenario())


def test_a_turn_that_arrives_while_a_stored_state_is_prepared_restores_the_stored_blob(
        make_service, dated, time_zone, monkeypatch):
    time_zone(BEHIND)
    service = make_service(tiers=("dram",))

    async def scenario():
        [session] = await _conversations_with_a_turn(service, offloaded=True)
        live = service.in_memory(session)
        history_before = service.history.load(session).tokens
        prefill = a_turn_arrives_at_the_first_job(dated, live, monkeypatch)
        time_zone(AHEAD)
        assert await service.date_rollover.check() == 0
        live.in_turn = False
        monkeypatch.setattr(dated, "prefill", prefill)
        assert service.stats()["next_turn"]["abandoned"] == 1
        assert live.cache is None and service.history.load(session).tokens == history_before
        result = await _turn(service, session, TURNS[1])  # the stored blob's shared prefix, then the rest
        assert result.restore_source == "dram"

    asyncio.run(scenario())


def test_a_date_change_prepares_conversations_on_every_background_lane_at_once(make_service, dated, time_zone):
    """At a date change most returning users are still away: where the CPU has the long lane's core, a second
    conversation is prepared there meanwhile (at its lower priority), not after the first."""
    time_zone(BEHIND)
    service = make_service(tiers=("dram",))
    if service.stats()["long_prefill_lane"] is None:
        pytest.skip("one model lane on this machine")

    async def scenario():
        sessions = await _conversations_with_a_turn(service, 4)
        await service.offload(sessions[0])
        time_zone(AHEAD)
        assert await service.date_rollover.check() == 4
        for session in sessions:
            live = service.in_memory(session)
            assert live.cache is not None and live.cache.num_tokens == len(service.history.load(session).tokens)

    asyncio.run(scenario())
    stats = service.stats()
    assert stats["long_prefill_lane"]["background_jobs"] > 0 and stats["model_thread"]["background_jobs"] > 0


def _next_turn_counters(service) -> dict:
    return service.stats()["next_turn"]


@pytest.mark.parametrize("between_turns", ["active", "offloaded"])
def test_before_midnight_the_next_dates_state_is_prepared_and_the_change_has_nothing_left_to_do(
        make_service, dated, time_zone, between_turns):
    """Users who came back a second after a midnight found their state not yet begun and recomputed it: the
    states for the next date are prefilled before the midnight, and at the change only taken up."""
    time_zone(BEHIND)
    service = make_service(tiers=("dram",))
    formatter = ChatFormatter(dated.tokenizer)

    async def scenario():
        [session] = await _conversations_with_a_turn(service, offloaded=between_turns == "offloaded")
        history = service.history.load(session).tokens
        assert await service.date_rollover.prepare_ahead() == 1
        assert service.history.load(session).tokens == history  # the conversation as it was: still today
        before_change = _next_turn_counters(service)
        assert before_change["ahead_tokens"] > 0 and before_change["prepared"] == 0
        time_zone(AHEAD)  # midnight passed
        assert await service.date_rollover.check() == 1
        counters = _next_turn_counters(service)
        assert counters["ready_at_date_change"] == 1 and counters["tokens"] == before_change["tokens"]
        prepared = service.history.load(session).tokens
        messages = service.history.load(session).chat_messages() + [{"role": "user", "content": TURNS[1]}]
        assert formatter.extend(prepared, messages).is_append_only
        assert service.in_memory(session).cache.num_tokens == len(prepared)
        result = await _appends_and_replies_as_a_fresh_prefill(service, dated, session, TURNS[1], len(prepared))
        after = service.history.load(session).tokens
        assert after[: result.prompt_tokens] == formatter.extend(history, messages).tokens  # a fresh rendering's

    asyncio.run(scenario())


def test_a_turn_before_midnight_extends_the_next_dates_state_by_what_it_added(make_service, dated, time_zone):
    time_zone(BEHIND)
    service = make_service(tiers=("dram",))

    async def scenario():
        [session] = await _conversations_with_a_turn(service)
        tomorrow = ChatFormatter(dated.tokenizer).on_date(datetime.date.today() + datetime.timedelta(days=1))

        def next_dates_rendering() -> list[int]:
            conversation = service.history.load(session)
            return tomorrow.next_turn(conversation.tokens, conversation.chat_messages()).tokens

        assert await service.date_rollover.prepare_ahead() == 1
        first, rendered_before = _next_turn_counters(service)["ahead_tokens"], next_dates_rendering()
        await _turn(service, session, TURNS[1])  # still today: it appends
        await asyncio.sleep(0.01)
        rendered_after = next_dates_rendering()
        assert rendered_after[: len(rendered_before)] == rendered_before
        assert await service.date_rollover.prepare_ahead() == 1
        # What the turn added to the next date's rendering, not the history again.
        assert _next_turn_counters(service)["ahead_tokens"] - first == len(rendered_after) - len(rendered_before)
        time_zone(AHEAD)
        assert await service.date_rollover.check() == 1
        assert _next_turn_counters(service)["ready_at_date_change"] == 1
        assert service.history.load(session).tokens == rendered_after
        await _appends_and_replies_as_a_fresh_prefill(service, dated, session, TURNS[2], len(rendered_after))

    asyncio.run(scenario())


def test_the_next_dates_states_take_only_the_room_the_active_kv_leaves(make_service, dated, time_zone):
    """The states prepared before a midnight hold memory of their own: together with the active KV, within its
    budget; where one no longer fits, it gives its room back (to the likelier conversations before it)."""
    time_zone(BEHIND)
    service = make_service(tiers=("dram",))

    async def scenario():
        sessions = await _conversations_with_a_turn(service, 2)
        one_state = (len(service.history.load(sessions[0]).tokens) + 16) * dated.kv_bytes_per_token
        service.config.active_kv_budget_bytes = service.sessions.active_bytes() + one_state
        assert await service.date_rollover.prepare_ahead() == 1  # room for one of the two
        ahead = _next_turn_counters(service)["ahead_tokens"]
        assert 0 < ahead
        tomorrow = datetime.date.today() + datetime.timedelta(days=1)
        prepared = [s for s in sessions if service.next_turn.is_ready_ahead(service.in_memory(s), tomorrow)]
        assert len(prepared) == 1
        service.config.active_kv_budget_bytes = service.sessions.active_bytes()  # no room left
        await _turn(service, prepared[0], TURNS[1])  # its state must grow: it no longer fits, nor the other's
        await asyncio.sleep(0.01)
        assert await service.date_rollover.prepare_ahead() == 0
        assert _next_turn_counters(service)["ahead_tokens"] == ahead
        time_zone(AHEAD)
        assert await service.date_rollover.check() == 2  # prepared at the change, as without room
        assert _next_turn_counters(service)["ready_at_date_change"] == 0

    asyncio.run(scenario())


def test_a_turn_that_stops_a_stored_states_preparation_after_midnight_keeps_what_it_computed(
        make_service, dated, time_zone, monkeypatch):
    """The stored blob shares only the tokens before the date with the new rendering: where the preparation had
    computed more than that when a turn stopped it, the turn takes its rows instead of the blob's."""
    time_zone(BEHIND)
    service = make_service(tiers=("dram",))

    async def scenario():
        [session] = await _conversations_with_a_turn(service, offloaded=True)
        live = service.in_memory(session)
        history = service.history.load(session)
        prefill = dated.prefill

        def a_turn_arrives_once_rows_are_computed(cache, tokens, stats=None, give_way=None):
            logits = prefill(cache, tokens, stats, give_way)
            live.in_turn = cache.num_tokens >= 40
            return logits

        monkeypatch.setattr(dated.config, "prefill_chunk_tokens", 8)
        monkeypatch.setattr(dated, "prefill", a_turn_arrives_once_rows_are_computed)
        time_zone(AHEAD)
        extension = _after_midnight(dated, history, TURNS[1])
        assert await service.date_rollover.check() == 0
        live.in_turn = False
        monkeypatch.setattr(dated, "prefill", prefill)
        assert service.stats()["next_turn"]["abandoned"] == 1
        result = await _renders_and_replies_as_a_fresh_prefill(service, dated, session, TURNS[1], extension.tokens)
        assert result.cached_tokens >= 40 > extension.common  # the preparation's rows, not the blob's few

    asyncio.run(scenario())


@pytest.mark.parametrize("between_turns", ["active", "offloaded"])
def test_a_turn_after_midnight_before_its_conversation_is_prepared_takes_the_state_prepared_ahead(
        make_service, dated, time_zone, between_turns):
    """A user back a second after the midnight, before the date change's preparation reached their conversation,
    keeps what was prepared for the new date before it (here in part) instead of recomputing the history."""
    time_zone(BEHIND)
    service = make_service(tiers=("dram",))
    formatter = ChatFormatter(dated.tokenizer)

    async def scenario():
        [session] = await _conversations_with_a_turn(service, offloaded=between_turns == "offloaded")
        assert await service.date_rollover.prepare_ahead() == 1
        time_zone(AHEAD)  # midnight passed; the date change's check has not run yet
        history = service.history.load(session)
        extension = _after_midnight(dated, history, TURNS[1])
        result = await _renders_and_replies_as_a_fresh_prefill(service, dated, session, TURNS[1], extension.tokens)
        ahead = formatter.next_turn(history.tokens, history.chat_messages()).tokens  # what was prepared
        assert result.cached_tokens == len(ahead) > extension.common
        assert await service.date_rollover.check() == 0  # the turn has taken it; nothing left to prepare

    asyncio.run(scenario())
