"""A tier that fails every third call (issue 14's fault list): an SSD with I/O errors. Turns never fail
for it; a state it cannot store or read back is recomputed, and every reply is the one a session that
never left memory gives."""

import asyncio
import itertools

from tests.statekeeper.sessions.test_lifecycle import USER_TURNS, turn

CONTENTS = [*USER_TURNS, "Name three rivers.", "Which is the longest?"]


class EveryThirdCallFails:
    """Wraps a tier; put, get, read and delete raise OSError on every third call among them."""

    def __init__(self, tier):
        self._tier = tier
        self._calls = itertools.count(1)
        self.failures = 0

    def _maybe_fail(self):
        if next(self._calls) % 3 == 0:
            self.failures += 1
            raise OSError(5, "Input/output error")

    def put(self, key, blob):
        self._maybe_fail()
        return self._tier.put(key, blob)

    def get(self, key):
        self._maybe_fail()
        return self._tier.get(key)

    def read(self, key):
        self._maybe_fail()
        return self._tier.read(key)

    def delete(self, key):
        self._maybe_fail()
        return self._tier.delete(key)

    def __getattr__(self, name):
        return getattr(self._tier, name)


def test_a_tier_failing_every_third_call_fails_no_turn(make_service):
    service = make_service(tiers=("ssd",))
    flaky = EveryThirdCallFails(service.tiers.tiers[0])
    service.tiers.tiers[0] = flaky

    async def scenario():
        kept = [(await service.create(None, None)).id for _ in range(2)]  # never leave memory
        moved = [(await service.create(None, None)).id for _ in range(2)]  # offloaded after every turn
        for content in CONTENTS:
            expected = [await turn(service, session, content, max_tokens=6) for session in kept]
            for session in moved:
                result = await turn(service, session, content, max_tokens=6)
                assert result.content == expected[0].content == expected[1].content
                await service.offload(session)
        for session in moved:
            assert [m["content"] for m in await service.messages(session)] == [
                m["content"] for m in await service.messages(kept[0])]

    asyncio.run(scenario())
    assert flaky.failures >= 3
