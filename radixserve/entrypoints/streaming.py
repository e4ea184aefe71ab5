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


async def incremental(outputs: AsyncIterator[dict]) -> AsyncIterator[dict]:
    """``--incremental-streaming-output`` (SGLang's flag): each output of a
    native stream carries what is new since that prompt's previous one, its
    text, ``output_ids`` and output logprobs; input logprobs come in its
    first (empty after). The outputs are cumulative (see TokenizerManager)."""
    sent: dict = {}  # index -> (characters, output ids) sent
    async for out in outputs:
        index = out.get("index")
        chars, ids = sent.get(index, (0, 0))
        meta = dict(out["meta_info"])
        for key in ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs"):
            if key in meta:
                meta[key] = meta[key][ids:]
        for key in ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs"):
            if key in meta and index in sent:
                meta[key] = []
        sent[index] = (len(out["text"]), len(out["output_ids"]))
        yield {**out, "text": out["text"][chars:], "output_ids": out["output_ids"][ids:], "meta_info": meta}


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
