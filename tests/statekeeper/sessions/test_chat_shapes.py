"""Chat templates that rewrite an earlier turn when they render the next one (issue 30). A reasoning template
like Qwen3's with thinking off puts an empty think block in the generation prompt and leaves it out of the
history it renders next time, so every turn's prompt differs from the stored tokens a few tokens into the
last reply. The turn keeps the KV of the tokens both share, from memory or from a stored blob, as a prefix
cache would, and its reply is the one a fresh prefill of the new prompt gives."""

import asyncio
import datetime
import threading
import time

import pytest
import torch

from scheduler.plan import ComputeProfile
from statekeeper.chat import ChatFormatter
from statekeeper.sessions import TurnInProgress, TurnRequest
from statekeeper.sessions.next_turn import BACKGROUND_JOB_MS, FOLLOW_TOKENS, LONG_LANE_JOB_MS

# ChatML whose generation prompt opens an empty think block that the rendered history drops.
THINK_OFF = (
    "{% for message in messages %}"
    "{% set content = message['content'].split('</think>')[-1].lstrip('\\n') if message['role'] == 'assistant' "
    "else message['content'] %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}{% endif %}"
)
TURNS = ["Hello, how are you today?", "Tell me about the history of Rome.", "And what about Carthage?"]


@pytest.fixture
def think_off(tiny_worker, monkeypatch):
    monkeypatch.setattr(tiny_worker.tokenizer, "chat_template", THINK_OFF)
    return tiny_worker


@pytest.fixture
def system_last(tiny_worker, monkeypatch):
    """The tiny worker with a template that moves the system prompt before the last user message."""
    from benchmarks.harness.templates import template_text

    monkeypatch.setattr(tiny_worker.tokenizer, "chat_template", template_text("system-last"))
    return tiny_worker


async def _turn(service, session, content, max_tokens=6):
    async for event in service.turn(session, TurnRequest(content, max_tokens=max_tokens)):
        pass
    return event


async def _prepared(service, count: int) -> None:
    """Until `count` next turns have been prepared (the preparation a turn's end started runs after it)."""
    async with asyncio.timeout(30):
        while service.stats()["next_turn"]["prepared"] < count:
            await asyncio.sleep(0.01)


async def _only_appends(service, session, prepared: list[int]) -> None:
    """The next turn on a conversation whose tokens are `prepared` only appends to its KV, and replies as a fresh
    prefill of the same tokens does."""
    live, formatter = service.in_memory(session), service.formatter
    follow_up = live.conversation.chat_messages() + [{"role": "user", "content": TURNS[2]}]
    assert formatter.extend(prepared, follow_up).is_append_only
    result = await _turn(service, session, TURNS[2])
    assert result.restore_source == "active" and result.cached_tokens == len(prepared)
    after = service.history.load(session).tokens
    assert after[result.prompt_tokens:] == _fresh_reply(service.worker, after, result.prompt_tokens,
                                                        result.completion_tokens)


def _fresh_reply(worker, tokens: list[int], prompt_tokens: int, count: int) -> list[int]:
    """Greedy tokens after a prefill of the prompt alone, into an empty cache."""
    cache = worker.new_cache()
    logits, reply = worker.prefill(cache, tokens[:prompt_tokens]), []
    for _ in range(count):
        reply.append(int(torch.argmax(logits)))
        logits = worker.decode(cache, reply[-1])
    return reply


def a_turn_arrives_at_the_first_job(worker, live, monkeypatch):
    """Makes the background preparation's first prefill job mark `live` as taken by a turn, as TurnRunner.slot
    marks it before it waits for the conversation; the preparation runs in several jobs. Returns the worker's
    own prefill (monkeypatch undoes it at the end of the test)."""
    prefill = worker.prefill

    def a_turn_arrives(cache, tokens, stats=None, give_way=None):
        live.in_turn = True
        return prefill(cache, tokens, stats, give_way)

    monkeypatch.setattr(worker.config, "prefill_chunk_tokens", 2)
    monkeypatch.setattr(worker, "prefill", a_turn_arrives)
    return prefill


@pytest.mark.parametrize("between_turns", ["active", "offloaded"])
def test_a_rewritten_history_keeps_the_kv_of_the_shared_prefix(make_service, think_off, between_turns):
    service = make_service(tiers=("dram",))
    formatter = ChatFormatter(think_off.tokenizer)

    async def scenario():
        session = (await service.create(None, None)).id
        await _turn(service, session, TURNS[0])
        for content in TURNS[1:]:
            before = service.history.load(session)
            messages = before.chat_messages() + [{"role": "user", "content": content}]
            extension = formatter.extend(before.tokens, messages)
            assert not extension.is_append_only and 0 < extension.common < len(before.tokens)
            if between_turns == "offloaded":
                await service.offload(session)
            result = await _turn(service, session, content)
            assert result.restore_source == ("active" if between_turns == "active" else "dram")
            assert result.cached_tokens == extension.common  # everything before the dropped think block
            after = service.history.load(session).tokens
            assert after[: result.prompt_tokens] == extension.tokens
            assert after[result.prompt_tokens:] == _fresh_reply(think_off, after, result.prompt_tokens,
                                                                 result.completion_tokens)

    asyncio.run(scenario())


def test_after_a_turn_the_next_turns_state_is_prepared_and_it_only_appends(make_service, think_off):
    """In background time after the reply, the KV is cut where the next rendering parts from the stored tokens
    and the rest of that rendering (the answer without its think block) prefilled: the next turn keeps all of
    it, and replies as a fresh prefill of its prompt does."""
    service = make_service(tiers=("dram",))
    formatter = ChatFormatter(think_off.tokenizer)

    async def scenario():
        session = (await service.create(None, None)).id
        await _turn(service, session, TURNS[0])
        for done, content in enumerate(TURNS[1:], start=1):
            live = service.in_memory(session)
            await _prepared(service, done)  # what the turn's end started in the background
            prepared = service.history.load(session).tokens
            assert prepared == live.conversation.tokens and live.cache.num_tokens == len(prepared)
            messages = live.conversation.chat_messages() + [{"role": "user", "content": content}]
            assert formatter.extend(prepared, messages).is_append_only
            result = await _turn(service, session, content)
            assert result.restore_source == "active" and result.cached_tokens == len(prepared)
            after = service.history.load(session).tokens
            assert after[result.prompt_tokens:] == _fresh_reply(think_off, after, result.prompt_tokens,
                                                                 result.completion_tokens)
        counters = service.stats()["next_turn"]
        assert counters["prepared"] == 2 and counters["tokens"] > 0 and counters["abandoned"] == 0

    asyncio.run(scenario())


def test_a_turn_that_arrives_while_the_next_turn_is_prepared_takes_over(make_service, think_off, monkeypatch):
    service = make_service(tiers=("dram",))

    async def scenario():
        session = (await service.create(None, None)).id
        await _turn(service, session, TURNS[0])
        live = service.in_memory(session)
        history_before = service.history.load(session).tokens
        a_turn_arrives_at_the_first_job(think_off, live, monkeypatch)
        await service.next_turn.prepare(live)
        live.in_turn = False
        assert service.stats()["next_turn"]["abandoned"] == 1
        assert service.history.load(session).tokens == history_before == live.conversation.tokens
        assert live.cache.num_tokens <= len(history_before)  # a prefix of the unchanged history

    asyncio.run(scenario())


def test_a_preparation_job_that_gives_way_to_live_work_runs_again_and_the_next_turn_only_appends(
        make_service, think_off, monkeypatch):
    """Another user's prompt comes to the lane while a preparation's job runs: the job stops between two
    layers (that prompt waits a layer, not the job) and runs again after it; the state it leaves is the one a
    job that never stopped leaves: the next turn only appends and replies as a fresh prefill."""
    service = make_service(tiers=("dram",))
    lane = service.executors.background_lane(service.executors.last_background_lane)
    checks = []

    def live_work_at_the_second_layer() -> bool:
        checks.append(None)
        return len(checks) == 2

    async def scenario():
        session = (await service.create(None, None)).id
        monkeypatch.setattr(lane, "live_waiting", live_work_at_the_second_layer)
        await _turn(service, session, TURNS[0])
        await _prepared(service, 1)
        counters = service.stats()["next_turn"]
        assert (counters["gave_way"], counters["abandoned"]) == (1, 0) and counters["gave_way_seconds"] > 0
        assert len(checks) > 2  # it ran again, to its end
        await _only_appends(service, session, service.history.load(session).tokens)

    asyncio.run(scenario())


def test_a_preparation_whose_jobs_always_meet_live_work_still_ends(make_service, think_off, monkeypatch):
    """Live work comes to the lane at every job's last layer: jobs that always gave way would never end, and the
    preparation would hold its conversation for good. They shrink, and the shortest runs to its end."""
    service = make_service(tiers=("dram",))
    lane = service.executors.background_lane(service.executors.last_background_lane)
    checks = []

    def live_work_at_every_last_layer() -> bool:
        checks.append(None)
        return len(checks) % think_off.num_layers == 0

    async def scenario():
        session = (await service.create(None, None)).id
        monkeypatch.setattr(lane, "live_waiting", live_work_at_every_last_layer)
        await _turn(service, session, TURNS[0])
        await _prepared(service, 1)
        assert service.stats()["next_turn"]["gave_way"] >= 1
        await _only_appends(service, session, service.history.load(session).tokens)

    asyncio.run(scenario())


def test_a_preparation_whose_job_fails_leaves_the_kv_of_the_unchanged_history(make_service, think_off, monkeypatch):
    """A background job that fails (not stopped by a turn: e.g. out of memory) leaves no rows of the next
    rendering past what the conversation's tokens share with it (rows a stored blob, or a branch, would take as
    the conversation's), and the next turn replies as a fresh prefill."""
    service = make_service(tiers=("dram",))
    prefill, chunk, jobs = think_off.prefill, think_off.config.prefill_chunk_tokens, []

    def fails_at_the_second_job(cache, tokens, stats=None, give_way=None):
        jobs.append(tokens)
        if len(jobs) == 2:
            raise RuntimeError("out of memory")
        return prefill(cache, tokens, stats, give_way)

    async def scenario():
        session = (await service.create(None, None)).id
        await _turn(service, session, TURNS[0])
        # Before the preparation the turn's end started runs (nothing here awaits): its jobs fail.
        monkeypatch.setattr(think_off.config, "prefill_chunk_tokens", 2)
        monkeypatch.setattr(think_off, "prefill", fails_at_the_second_job)
        live = service.in_memory(session)
        history = service.history.load(session).tokens
        messages = live.conversation.chat_messages() + [{"role": "user", "content": TURNS[1]}]
        common = ChatFormatter(think_off.tokenizer).extend(history, messages).common
        async with asyncio.timeout(30):
            while len(jobs) < 2 or live.lock.locked():
                await asyncio.sleep(0.01)
        monkeypatch.setattr(think_off, "prefill", prefill)
        monkeypatch.setattr(think_off.config, "prefill_chunk_tokens", chunk)
        assert live.conversation.tokens == history and live.cache.num_tokens <= common
        result = await _turn(service, session, TURNS[1])
        after = service.history.load(session).tokens
        assert after[result.prompt_tokens:] == _fresh_reply(think_off, after, result.prompt_tokens,
                                                             result.completion_tokens)

    asyncio.run(scenario())


async def _a_stopped_preparation(service, worker, monkeypatch):
    """After a first turn, a preparation of the next turn's rendering that a turn stops at its first job (of 2
    tokens). Returns the conversation, what `prepare` returned, the history before and the tokens it shares with
    the next rendering."""
    session = (await service.create(None, None)).id
    await _turn(service, session, TURNS[0])
    live = service.in_memory(session)
    before = service.history.load(session)
    messages = before.chat_messages() + [{"role": "user", "content": TURNS[1]}]
    common = ChatFormatter(worker.tokenizer).extend(before.tokens, messages).common
    chunk = worker.config.prefill_chunk_tokens
    prefill = a_turn_arrives_at_the_first_job(worker, live, monkeypatch)
    prepared = await service.next_turn.prepare(live)
    live.in_turn = False
    monkeypatch.setattr(worker, "prefill", prefill)
    monkeypatch.setattr(worker.config, "prefill_chunk_tokens", chunk)
    return session, live, prepared, before, common


def test_a_turn_that_stops_a_preparation_keeps_what_it_computed(make_service, think_off, monkeypatch):
    """The rows of the next turn's rendering that the preparation computed before the turn stopped it are the
    turn's own prompt's: it keeps them (on a slow CPU a think time is shorter than most preparations, and each
    stopped one was computed twice), and replies as a fresh prefill of its prompt does."""
    service = make_service(tiers=("dram",))

    async def scenario():
        session, live, prepared, _, common = await _a_stopped_preparation(service, think_off, monkeypatch)
        assert not prepared
        result = await _turn(service, session, TURNS[1])
        assert result.restore_source == "active" and result.cached_tokens == common + 2
        after = service.history.load(session).tokens
        assert after[result.prompt_tokens:] == _fresh_reply(think_off, after, result.prompt_tokens,
                                                             result.completion_tokens)
        assert live.stopped_preparation is None  # the turn took them: nothing held past it

    asyncio.run(scenario())


@pytest.mark.parametrize("meanwhile", [None, "retry", "date change"])
def test_the_next_turns_head_is_prepared_while_the_reply_is_generated(make_service, system_last, meanwhile):
    """A template that moves the system prompt before the last user message renders the first user message
    without it next time: the preparation after the first reply re-prefills all of that message. Its part before
    the reply is known once the prompt is in the KV, so it is prefilled while the reply is generated; after the
    reply only the reply is left, and the next turn only appends and replies as a fresh prefill does. `meanwhile`:
    a second request (a client's retry) is refused, and used to throw the head away on its way out; a date
    change's preparation (DateRollover) leaves the conversation to the turn under way, and used to take its head
    and throw it away."""
    service = make_service(tiers=("dram",))
    formatter = ChatFormatter(system_last.tokenizer)

    async def scenario():
        session = (await service.create("Be brief.", None)).id
        live = service.in_memory(session)
        messages = live.conversation.chat_messages() + [{"role": "user", "content": TURNS[1]}]
        plan = formatter.reply_head(messages)
        head, early = plan.tokens, len(plan.tokens) - plan.common
        assert early > len(head) // 2  # the system prompt came first: the renderings part at once
        events = service.turn(session, TurnRequest(TURNS[1], max_tokens=6))
        await anext(events)  # the first token: the head's prefill has begun; the reply waits here meanwhile
        while service.stats()["next_turn"]["early_tokens"] < early:
            await asyncio.sleep(0.01)
        if meanwhile == "retry":
            with pytest.raises(TurnInProgress):
                await _turn(service, session, TURNS[1])
            await asyncio.sleep(0.1)  # what the refused request leaves behind runs
        elif meanwhile == "date change":
            assert not await service.next_turn.prepare(live, from_storage=True, day=datetime.date.today())
        async for _ in events:
            pass
        await _prepared(service, 1)
        counters = service.stats()["next_turn"]
        assert counters["early_tokens"] - counters["followed_tokens"] == early
        prepared = service.history.load(session).tokens
        assert prepared[: len(head)] == head and live.cache.num_tokens == len(prepared)
        # After the reply: what follows the head and the part of the reply followed meanwhile.
        assert counters["tokens"] - counters["early_tokens"] == len(prepared) - len(head) - counters["followed_tokens"]
        await _only_appends(service, session, prepared)

    asyncio.run(scenario())


def test_a_later_turns_head_that_parts_late_is_prepared_while_its_reply_is_generated(make_service, system_last):
    """After the first turn, the next rendering parts from a turn's prompt only where its user message begins (the
    history before it renders alike): most of the head is copied, and the message, past the parting, is
    prefilled while the reply is generated. Only heads that parted in their first half were begun, and every
    later turn's preparation re-prefilled the whole message after the reply."""
    service = make_service(tiers=("dram",))
    formatter = ChatFormatter(system_last.tokenizer)
    message = "Tell me about the history of Carthage and of its wars with Rome, in a few short words please."

    async def scenario():
        session = (await service.create("Be brief.", None)).id
        await _turn(service, session, " ".join([TURNS[1]] * 6))
        await _prepared(service, 1)
        live = service.in_memory(session)
        plan = formatter.reply_head(live.conversation.chat_messages() + [{"role": "user", "content": message}])
        early = len(plan.tokens) - plan.common
        assert plan.common > early >= FOLLOW_TOKENS  # a late parting, past it a job's worth
        before = service.stats()["next_turn"]
        events = service.turn(session, TurnRequest(message, max_tokens=6))
        await anext(events)  # the first token: the head's prefill has begun
        async with asyncio.timeout(30):
            while service.stats()["next_turn"]["early_tokens"] - before["early_tokens"] < early:
                await asyncio.sleep(0.01)
        async for _ in events:
            pass
        await _prepared(service, 2)
        counters = service.stats()["next_turn"]
        assert (counters["early_tokens"] - counters["followed_tokens"]
                - (before["early_tokens"] - before["followed_tokens"])) == early
        prepared = service.history.load(session).tokens
        assert prepared[: len(plan.tokens)] == plan.tokens and live.cache.num_tokens == len(prepared)
        await _only_appends(service, session, prepared)

    asyncio.run(scenario())


def test_the_next_turns_head_takes_only_the_room_the_active_kv_budget_leaves(make_service, system_last):
    """The head is a second copy of most of the conversation's KV while the reply is generated: with the active
    KV budget taken by the active conversations it is not begun (counted), the preparation after the reply does
    its work, and the next turn replies as a fresh prefill does."""
    one = system_last.new_cache()  # one conversation's first allocation (a chunk of rows): nothing beside it
    system_last.prefill(one, [1, 2, 3])
    service = make_service(tiers=("dram",), active_kv_budget_bytes=one.allocated_bytes)

    async def scenario():
        session = (await service.create("Be brief.", None)).id
        await _turn(service, session, TURNS[1])
        await _prepared(service, 1)
        counters = service.stats()["next_turn"]
        assert (counters["early_without_room"], counters["early_tokens"]) == (1, 0)
        result = await _turn(service, session, TURNS[2])
        after = service.history.load(session).tokens
        assert after[result.prompt_tokens:] == _fresh_reply(service.worker, after, result.prompt_tokens,
                                                             result.completion_tokens)

    asyncio.run(scenario())


def test_the_next_turns_head_follows_the_reply_as_it_is_generated(make_service, system_last, monkeypatch):
    """Once the head is in, the reply's tokens are prefilled into it as they are sampled (FOLLOW_TOKENS at a
    time): a long reply is not left to re-prefill after it. Each decode step here waits until the head has
    followed the whole pieces of the reply sampled so far; the preparation after the reply then has the rest of
    the reply and the template's tokens after it left, and the next turn only appends and replies as a fresh
    prefill does."""
    service = make_service(tiers=("dram",), long_prefill_lane="on")  # the head's jobs beside the decode steps
    formatter = ChatFormatter(system_last.tokenizer)
    step, decode_steps = system_last.step, []

    def waits_for_the_head(segments):
        if len(segments) == 1 and len(segments[0].token_ids) == 1:  # the turn's decode step
            decode_steps.append(time.monotonic())
            # The reply's tokens so far, the one this step feeds the last: the head may take all of them, so a
            # step waits for whole pieces of them (waiting for those before it alone let the head take 17).
            sampled = len(decode_steps)
            deadline = time.monotonic() + 10
            while (service.next_turn.counters.followed_tokens < sampled // FOLLOW_TOKENS * FOLLOW_TOKENS
                   and time.monotonic() < deadline):
                time.sleep(0.005)
        return step(segments)

    # The reply: plain text, whose tokens the template renders back as they are (a random-weight model's tokens
    # need not re-tokenize so, and the preparation would keep only what matches of them).
    said = formatter.encode(" Rome was founded on seven hills by the river Tiber, and it grew for centuries. " * 3)
    length = 2 * FOLLOW_TOKENS + 4
    assert formatter.encode(formatter.decode(said[:length])) == said[:length]

    async def scenario():
        session = (await service.create("Be brief.", None)).id
        messages = service.in_memory(session).conversation.chat_messages() + [{"role": "user", "content": TURNS[1]}]
        head = formatter.reply_head(messages).tokens
        script, sample = iter(said), system_last.sample
        monkeypatch.setattr(system_last, "step", waits_for_the_head)
        monkeypatch.setattr(system_last, "sample", lambda *args: next(script))
        result = await _turn(service, session, TURNS[1], max_tokens=length)
        monkeypatch.setattr(system_last, "step", step)
        monkeypatch.setattr(system_last, "sample", sample)
        await _prepared(service, 1)
        counters = service.stats()["next_turn"]
        prepared = service.history.load(session).tokens
        reply = len(prepared) - len(head)  # the reply and the template's tokens after it, as rendered next
        assert counters["followed_tokens"] == (result.completion_tokens - 1) // FOLLOW_TOKENS * FOLLOW_TOKENS > 0
        assert counters["tokens"] - counters["early_tokens"] == reply - counters["followed_tokens"] < reply
        await _only_appends(service, session, prepared)

    asyncio.run(scenario())


def test_a_turn_never_waits_for_a_background_re_prefill_that_other_users_work_keeps_in_line(make_service, think_off):
    """The next turn's state is prepared by background jobs, which run only when no live work waits. While
    other users keep the model lanes busy, such a job waits in line, and it used to hold the conversation
    meanwhile: a turn on it waited for the whole busy spell (2.5 s in benchmarks/chat_shapes.py). A turn now
    cancels the preparation, and a job still in line never runs."""
    service = make_service(tiers=("dram",))
    busy_seconds = 2.0

    async def scenario():
        session = (await service.create(None, None)).id

        async def another_users_work(tokens: int):  # live jobs back to back: the line is never empty of live work
            ends = time.monotonic() + busy_seconds
            while time.monotonic() < ends:
                await service.executors.in_model_thread(time.sleep, 0.02, tokens=tokens)

        long_prompt = think_off.config.prefill_chunk_tokens + 1  # on the long lane, where there is one
        busy = [asyncio.create_task(another_users_work(tokens)) for tokens in (0, 0, long_prompt, long_prompt)]
        await _turn(service, session, TURNS[0])  # its next turn's preparation starts now, and waits in line
        await asyncio.sleep(0.1)
        assert service.in_memory(session).lock.locked()  # the preparation holds the conversation
        second = await _turn(service, session, TURNS[1])
        waited = second.lock_wait_ms
        await asyncio.gather(*busy)
        return waited

    waited_ms = asyncio.run(scenario())
    assert waited_ms < busy_seconds * 1000 / 4  # not the busy spell
    assert service.stats()["next_turn"]["abandoned"] >= 1  # the one the turn cancelled


def test_the_next_turns_state_is_prepared_on_the_long_lane_where_there_is_one(make_service, think_off):
    """The long lane's core is idle but for long prompts: a preparation there goes on while the model thread
    runs other users' turns."""
    service = make_service(tiers=("dram",))
    if service.stats()["long_prefill_lane"] is None:
        pytest.skip("one model lane on this machine")

    async def scenario():
        session = (await service.create(None, None)).id
        await _turn(service, session, TURNS[0])
        before = service.stats()["model_thread"]["background_jobs"]
        await _prepared(service, 1)  # the preparation the turn's end started
        return before

    before = asyncio.run(scenario())
    stats = service.stats()
    assert stats["long_prefill_lane"]["background_jobs"] > 0 and stats["model_thread"]["background_jobs"] == before


@pytest.mark.parametrize("long_lane", ["on", "off"])
def test_background_jobs_are_longer_on_the_long_lane_than_on_the_model_thread(make_service, system_last, monkeypatch,
                                                                              long_lane):
    """A background job on the model thread holds every user's decode step: about BACKGROUND_JOB_MS of work. One
    on the long lane holds only a short prompt that takes that lane meanwhile: about LONG_LANE_JOB_MS, in which
    more rows a forward cost less a token. Here a token costs 1 ms, so a job of N ms is N tokens; the system-last
    template's preparation after the first reply re-prefills the whole (long) first message."""
    service = make_service(tiers=("dram",), long_prefill_lane=long_lane)
    if long_lane == "on" and service.stats()["long_prefill_lane"] is None:
        pytest.skip("one model lane on this machine")
    service.next_turn.compute = ComputeProfile(0.0, 1.0, 0.0)
    monkeypatch.setattr(system_last.config, "prefill_chunk_tokens", 512)  # a job is at most a chunk
    jobs = []  # (lane, tokens) of each background job
    in_model_thread = service.executors.in_model_thread

    async def recorded(fn, *args, background=False, lane=0, **kwargs):
        if background:
            jobs.append((lane, len(args[1])))
        return await in_model_thread(fn, *args, background=background, lane=lane, **kwargs)

    monkeypatch.setattr(service.executors, "in_model_thread", recorded)

    async def scenario():
        session = (await service.create("Be brief.", None)).id
        await _turn(service, session, " ".join(["the history of Rome"] * 60))
        await _prepared(service, 1)

    asyncio.run(scenario())
    budget = LONG_LANE_JOB_MS if long_lane == "on" else BACKGROUND_JOB_MS
    assert {lane for lane, _ in jobs} == ({1} if long_lane == "on" else {0})
    assert max(tokens for _, tokens in jobs) == budget  # the first message is longer than one job


def test_an_early_head_copies_rows_only_where_they_hold_its_tokens(make_service, system_last, monkeypatch):
    """The head's rows before the parting were copied where the head's tokens agreed with the prompt's text
    tokenized afresh, but the prompt's ids keep an earlier reply as the model sampled it (here after a tool
    result, where the template only appends): a reply sampled a character at a time is tokenized otherwise.
    Rows were copied under ids they were not computed from, and the turn after read that state."""
    service = make_service(tiers=("dram",))
    formatter = ChatFormatter(system_last.tokenizer)
    text = " Rome is old."
    by_character = [token for character in text for token in formatter.encode(character)]
    assert by_character != formatter.encode(text)
    end = system_last.tokenizer.convert_tokens_to_ids("<|im_end|>")

    async def scenario():
        session = (await service.create("Be brief.", None)).id
        live = service.in_memory(session)
        await _turn(service, session, "What is the weather?")
        await _prepared(service, 1)
        script, sample = iter(by_character + [end]), system_last.sample
        monkeypatch.setattr(system_last, "sample", lambda *args: next(script))
        async for _ in service.turn(session, TurnRequest("sunny", message={"role": "tool", "content": "sunny"},
                                                         max_tokens=len(by_character) + 1)):
            pass
        monkeypatch.setattr(system_last, "sample", sample)
        assert service.history.load(session).tokens[-len(by_character) - 1:] == by_character + [end]
        await _turn(service, session, "Tell me everything about the history of Rome and Carthage. " * 12, 4)
        async with asyncio.timeout(30):
            while service.stats()["next_turn"]["prepared"] < 2 or live.lock.locked():
                await asyncio.sleep(0.01)
        result = await _turn(service, session, "And Carthage?", 8)
        after = service.history.load(session).tokens
        assert after[result.prompt_tokens:] == _fresh_reply(system_last, after, result.prompt_tokens,
                                                            result.completion_tokens)

    asyncio.run(scenario())


def test_a_turn_that_comes_while_the_preparation_renders_takes_the_early_head(make_service, system_last, monkeypatch):
    """The preparation after a reply takes the early head up, then renders the next turn off the event loop (a
    long history's rendering takes up to hundreds of ms). A turn that came meanwhile found no preparation to
    stop and recomputed all but the few tokens both renderings share; it takes the head instead."""
    service = make_service(tiers=("dram",))
    formatter, next_turn = ChatFormatter(system_last.tokenizer), service.formatter.next_turn

    def slow_next_turn(*args):
        time.sleep(0.5)
        return next_turn(*args)

    async def scenario():
        session = (await service.create("Be brief.", None)).id
        messages = service.in_memory(session).conversation.chat_messages() + [{"role": "user", "content": TURNS[1]}]
        head = formatter.reply_head(messages)
        await _turn(service, session, TURNS[1])
        monkeypatch.setattr(service.formatter, "next_turn", slow_next_turn)
        await asyncio.sleep(0.1)  # the preparation has taken the head up and renders
        result = await _turn(service, session, TURNS[2])
        assert result.cached_tokens >= len(head.tokens) > 2 * head.common
        after = service.history.load(session).tokens
        assert after[result.prompt_tokens:] == _fresh_reply(service.worker, after, result.prompt_tokens,
                                                             result.completion_tokens)
        await asyncio.sleep(0.6)  # the preparations after it have run
        assert service.next_turn.held_bytes() == 0

    asyncio.run(scenario())



def test_a_turn_that_took_a_stopped_preparations_rows_and_did_not_happen_keeps_only_the_historys(
        make_service, think_off, monkeypatch):
    """A turn took the rows a preparation it stopped had computed (the next rendering's), then its client left:
    it rolled the KV back to where its prompt's prefill began, past the rows the history's own tokens share with
    that rendering. The KV held rows of tokens the history does not hold, and an offload meanwhile would store
    them as the history's state."""
    service = make_service(tiers=("dram",))

    async def scenario():
        session, live, _, before, common = await _a_stopped_preparation(service, think_off, monkeypatch)
        if live.stopped_preparation is None:
            pytest.skip("the preparation the turn's end started had prepared it already")
        events = service.turn(session, TurnRequest(TURNS[1], max_tokens=6))
        await anext(events)  # the reply has begun on the preparation's rows
        await events.aclose()  # the client left: no turn happened
        assert service.history.load(session).tokens == before.tokens
        assert live.cache.num_tokens <= common

    asyncio.run(scenario())


def _threads_that_render(formatter, monkeypatch) -> set[int]:
    """The threads that call the formatter's renderings of a whole history, from now on."""
    threads = set()
    for name in ("extend", "next_turn", "reply_head", "append_turns"):
        def recorded(*args, _call=getattr(formatter, name), **kwargs):
            threads.add(threading.get_ident())
            return _call(*args, **kwargs)
        monkeypatch.setattr(formatter, name, recorded)
    return threads


def test_a_turns_renderings_run_off_the_event_loop(make_service, system_last, monkeypatch):
    """A turn rendered and encoded its whole history on the event loop, where every other user's stream waited
    (tens to hundreds of ms for a long history), as the next turn's preparation did before it moved off."""
    service = make_service(tiers=("dram",))
    threads = _threads_that_render(service.formatter, monkeypatch)

    async def scenario():
        session = (await service.create(None, None)).id
        for content in TURNS[:2]:
            await _turn(service, session, content)
            await _prepared(service, 1)
        return threading.get_ident()

    loop_thread = asyncio.run(scenario())
    assert threads and loop_thread not in threads


def test_scoring_renders_off_the_event_loop(make_service, monkeypatch):
    service = make_service(tiers=("dram",))
    threads = _threads_that_render(service.formatter, monkeypatch)

    async def scenario():
        session = (await service.create(None, None)).id
        await _turn(service, session, TURNS[0])
        await service.score(session, [{"role": "user", "content": TURNS[1]}, {"role": "assistant", "content": "Yes."}])
        return threading.get_ident()

    loop_thread = asyncio.run(scenario())
    assert threads and loop_thread not in threads


def test_a_turns_rendering_never_waits_for_the_next_turns_preparations(make_service, system_last, monkeypatch):
    """A turn's rendering went to the threads the preparations' renderings used: with two users' turns just
    ended, the third user's first token waited for both of theirs (up to hundreds of ms each for a long history)."""
    service = make_service(tiers=("dram",))
    next_turn, rendering = service.formatter.next_turn, []

    def slow_next_turn(*args, **kwargs):
        rendering.append(1)
        time.sleep(0.5)
        return next_turn(*args, **kwargs)

    async def scenario():
        sessions = [(await service.create(None, None)).id for _ in range(3)]
        monkeypatch.setattr(service.formatter, "next_turn", slow_next_turn)
        for session in sessions[:2]:
            await _turn(service, session, TURNS[0])  # each end starts a preparation: half a second of rendering
        while len(rendering) < 2:  # both preparations render
            await asyncio.sleep(0.005)
        started = time.monotonic()
        events = service.turn(sessions[2], TurnRequest(TURNS[0], max_tokens=6))
        await anext(events)
        waited = time.monotonic() - started
        async for _ in events:
            pass
        return waited

    assert asyncio.run(scenario()) < 0.3


def test_of_two_preparations_at_once_the_one_with_fewer_tokens_left_runs_to_its_end_first(make_service, think_off,
                                                                                           monkeypatch):
    """Preparations send their jobs one at a time. Served in order of asking, two at once took turns job by job,
    so both were unfinished until near the end and a user who came back meanwhile found hers undone (a quarter of
    system-last's returning turns on the AVX2 path). The one with fewer tokens left now runs to its end first."""
    service = make_service(tiers=("dram",), long_prefill_lane="on")
    if service.stats()["long_prefill_lane"] is None:
        pytest.skip("one model lane on this machine")
    monkeypatch.setattr(think_off.config, "prefill_chunk_tokens", 2)  # a preparation in many jobs
    jobs = []  # the cache each background job prefilled
    in_model_thread = service.executors.in_model_thread

    async def recorded(fn, *args, background=False, **kwargs):
        if background:
            jobs.append(args[0])
        return await in_model_thread(fn, *args, background=background, **kwargs)

    monkeypatch.setattr(service.executors, "in_model_thread", recorded)

    async def scenario():
        long_reply, short_reply = (await service.create(None, None)).id, (await service.create(None, None)).id
        gate = threading.Event()  # holds the long lane until both preparations wait for it
        long_prompt = service.executors.lanes.main.limits.chunk_tokens + 1  # on the long lane
        held = asyncio.ensure_future(in_model_thread(gate.wait, tokens=long_prompt))
        await _turn(service, long_reply, TURNS[1], max_tokens=16)
        await _turn(service, short_reply, TURNS[0], max_tokens=3)
        await asyncio.sleep(0.2)  # both have rendered their next turn; the first one's job waits for the lane
        gate.set()
        await held
        await _prepared(service, 2)
        return [{id(service.in_memory(session).cache): session
                 for session in (long_reply, short_reply)}[id(cache)] for cache in jobs], short_reply

    order, short_reply = asyncio.run(scenario())
    assert 2 <= order.count(short_reply) < len(order) - order.count(short_reply)
    first, last = order.index(short_reply), len(order) - 1 - order[::-1].index(short_reply)
    assert order[first : last + 1] == [short_reply] * order.count(short_reply)  # no job of the other's between
