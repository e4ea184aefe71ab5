"""Server-sent events shared by the native and the OpenAI routes."""

from __future__ import annotations

from typing import AsyncIterator

SSE_DONE = "data: [DONE]\n\n"


async def peek(gen: AsyncIterator) -> AsyncIterator:
    """Pull the first item now, so that validation errors raise before the
    200 and the stream's headers go out; returns an iterator over all items."""
    first = await gen.__anext__()

    async def chained():
        yield first
        async for item in gen:
            yield item

    return chained()


async def sse_stream(events: AsyncIterator[str]) -> AsyncIterator[bytes]:
    """Encode ``data: ...`` events and close the stream with ``[DONE]``."""
    async for event in events:
        yield event.encode()
    yield SSE_DONE.encode()
