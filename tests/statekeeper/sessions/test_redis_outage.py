"""Redis killed and restarted under load (issue 14's fault list). Turns run on several sessions at once
while a real redis-server is SIGKILLed and later started again on the same port: no turn fails, a state
Redis could not take or give back is recomputed, every reply is the one a session that never left memory
gives, the history holds exactly what the clients were told, and once Redis is back, offloads land in it
and turns restore from it again, without a restart of the service."""

import asyncio
import time

from tests.statekeeper.sessions.test_lifecycle import turn
from benchmarks.harness.redis_server import RedisServer

CONTENTS = ["Hello, how are you today?", "Tell me about the history of Rome.", "What is the capital of France?",
            "Name three rivers.", "Which is the longest?", "And the shortest?", "Thank you."]
KILL_AT, RESTART_AT = 2, 4  # rounds during which Redis dies and comes back


def _redis_available(service) -> bool:
    return next(tier["available"] for tier in service.tiers.stats() if tier["name"] == "redis")


async def _wait_for(condition, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


def test_redis_killed_and_restarted_under_load_fails_no_turn(make_service, tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    service = make_service(tiers=("redis",), redis_url=server.url, data_dir=tmp_path / "data")

    async def moved_turn(session, content):
        """A turn, then the state leaves memory for Redis (or nowhere, while Redis is down)."""
        result = await turn(service, session, content, max_tokens=6)
        await service.offload(session)
        return result

    async def scenario():
        nonlocal server
        kept = (await service.create(None, None)).id  # never leaves memory: the reference
        moved = [(await service.create(None, None)).id for _ in range(3)]
        sources = []
        for round_index, content in enumerate(CONTENTS):
            expected = (await turn(service, kept, content, max_tokens=6)).content
            load = asyncio.gather(*(moved_turn(session, content) for session in moved))
            if round_index == KILL_AT:
                await asyncio.sleep(0.01)  # the turns are under way
                await asyncio.to_thread(server.kill)
            if round_index == RESTART_AT:
                await asyncio.sleep(0.01)
                server = await asyncio.to_thread(RedisServer(tmp_path / "redis", port=server.port).start)
            results = await load
            assert [result.content for result in results] == [expected] * len(moved)
            sources += [result.restore_source for result in results]
        assert "recompute" in sources  # the outage was felt: states Redis could not keep were recomputed

        assert await _wait_for(lambda: _redis_available(service))  # back on its own, no request needed
        expected = (await turn(service, kept, "One more thing.", max_tokens=6)).content
        assert [r.content for r in await asyncio.gather(*(moved_turn(s, "One more thing.") for s in moved))] == [
            expected] * len(moved)
        expected = (await turn(service, kept, "And the last one?", max_tokens=6)).content
        for session in moved:
            assert (await service.view(session)).tier == "redis"  # offloads land in Redis again
            result = await turn(service, session, "And the last one?", max_tokens=6)
            assert result.restore_source == "redis" and result.content == expected
            assert await service.messages(session) == await service.messages(kept)

    try:
        asyncio.run(scenario())
    finally:
        server.stop()
