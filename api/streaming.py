"""What both streaming APIs share: a turn's events after its 200 went out."""

from __future__ import annotations

from collections.abc import AsyncIterator


async def after_the_200(first, events: AsyncIterator) -> AsyncIterator:
    """The turn's events, `first` (already taken, so errors before it were plain HTTP errors) included;
    an exception raised after it is yielded, last, instead of raised: the 200 is already sent, so the
    error can only travel in the stream."""
    yield first
    while True:
        try:
            event = await anext(events)
        except StopAsyncIteration:
            return
        except Exception as exc:
            yield exc
            return
        yield event
