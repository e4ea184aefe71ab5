"""Server-sent events shared by the native and the OpenAI routes."""

from __future__ import annotations

import json
import logging
from typing import AsyncIterator

from radixserve.entrypoints.http_guards import error_body
from radixserve.managers.tokenizer_manager import EngineDeadError, RequestTimeoutError, ServerBusyError

logger = logging.getLogger("radixserve.server")

SSE_DONE = "data: [DONE]\n\n"
# The status a stream's error event carries (the HTTP status went out with its first event).
_STATUS = {EngineDeadError: 503, RequestTimeoutError: 504, ServerBusyError: 429}


async def peek(gen: AsyncIterator) -> AsyncIterator:
    """Pull the first item now, so that validation errors raise before the
    200 and the stream's headers go out; returns an iterator over all items."""
    first = await gen.__anext__()

    async def chained():
        yield first
        async for item in gen:
            yield item

    return chained()


async def sse_stream(events: AsyncIterator[str | bytes]) -> AsyncIterator[bytes]:
    """Encode ``data: ...`` events and close the stream with ``[DONE]``. A
    failure after the first event becomes an error event in OpenAI's shape
    (``data: {"error": {...}}``), which OpenAI's clients raise as an APIError."""
    try:
        async for event in events:
            yield event if isinstance(event, bytes) else event.encode()
    except Exception as exc:
        status = _STATUS.get(type(exc), 400 if isinstance(exc, ValueError) else 500)
        if status == 500:
            logger.error("stream failed: %s: %s", type(exc).__name__, exc)
            logger.debug("traceback", exc_info=True)
        message = str(exc) if status != 500 else f"internal server error ({type(exc).__name__})"
        yield f"data: {json.dumps(error_body(message, status))}\n\n".encode()
    yield SSE_DONE.encode()
