"""Clients that resend the whole conversation (statekeeper/sessions/resend.py, the OpenAI APIs): a conversation
the resend created is kept only once its first turn has ended in its result."""

import asyncio

from statekeeper.sessions import TurnRequest
from statekeeper.sessions.turns import TurnResult
from statekeeper.tenancy import DEFAULT_TENANT

MESSAGES = [{"role": "user", "content": "Hello, how are you today?"}]


def test_a_new_conversation_whose_client_leaves_before_the_result_is_deleted_again(make_service):
    """Its client never learnt its id (the result carries it), nothing would find it again, and it would count
    against its tenant's conversations and stored bytes for good."""
    service = make_service(tiers=("dram",))

    async def scenario():
        _, first, events = await service.chat(MESSAGES, TurnRequest("", max_tokens=20))
        assert not isinstance(first, TurnResult)
        await events.aclose()  # the client goes away mid-stream
        assert service.history.count(DEFAULT_TENANT) == 0
        _, first, events = await service.chat(MESSAGES, TurnRequest("", max_tokens=3))
        async for _ in events:
            pass
        assert service.history.count(DEFAULT_TENANT) == 1

    asyncio.run(scenario())
