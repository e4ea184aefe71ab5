"""The OpenAI routes (/v1/models, /v1/completions, /v1/chat/completions): a
thin loop between the TokenizerManager and the pure adapters."""

from __future__ import annotations

import time
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from radixserve.entrypoints.openai import adapters as A
from radixserve.entrypoints.streaming import peek, sse_stream
from radixserve.entrypoints.openai.chat_parsing import ChatParsing, chat_parsing
from radixserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from radixserve.managers.io_struct import GenerateReqInput
from radixserve.managers.tokenizer_manager import TokenizerManager


def lora_adapter(model: str | None, own_names: set[str]) -> str | None:
    """The LoRA adapter a request's ``model`` names in SGLang's
    ``base-model:adapter-name`` form (after its first colon), or None. Any
    other name means the loaded model, as in SGLang, where the name is not
    checked (sglang-router fills one in when the client gives none); a name
    this model goes by (``own_names``) is never read as base and adapter."""
    if model is None or model in own_names or ":" not in model:
        return None
    return model.split(":", 1)[1].strip() or None


def _adapter(tm: TokenizerManager, model: str | None) -> tuple[str | None, JSONResponse | None]:
    """The LoRA adapter ``model`` selects (``BASE:ADAPTER``, or a loaded
    adapter's name alone), or None; or the 400 naming an adapter that is not
    loaded (SGLang refuses any adapter when started without --enable-lora)."""
    adapter = lora_adapter(model, tm.model_names)
    if adapter is None and tm.lora_names is not None and model in tm.lora_names:
        adapter = model
    if adapter is None or (tm.lora_names is not None and adapter in tm.lora_names):
        return adapter, None
    if tm.lora_names is None:
        message = (f"model: '{model}' names the LoRA adapter '{adapter}', but this server serves no LoRA adapters "
                   f"(start it with --enable-lora); use '{tm.served_model_name}'")
    else:
        message = (f"model: '{model}' names the LoRA adapter '{adapter}', which is not loaded "
                   f"(loaded: {', '.join(sorted(tm.lora_names)) or 'none'})")
    return None, JSONResponse(A.openai_error(message, param="model", code=400), 400)


def _lora(adapter: str | None) -> dict:
    """The ``lora_path`` a model's adapter sets (it wins over the body's field)."""
    return {} if adapter is None else {"lora_path": adapter}


def _reply_model(tm: TokenizerManager, model: str | None) -> str:
    """The ``model`` of a reply: the request's, as SGLang echoes it, or the served name."""
    return model or tm.served_model_name


class _Deltas:
    """Per-choice bookkeeping that turns cumulative outputs into deltas."""

    def __init__(self):
        self.text: dict[int, int] = {}
        self.logprobs: dict[int, int] = {}

    def text_delta(self, out: dict) -> tuple[int, str, bool]:
        i = out.get("index", 0)
        first = i not in self.text
        start, self.text[i] = self.text.get(i, 0), len(out["text"])
        return i, out["text"][start:], first

    def new_logprobs(self, out: dict) -> tuple[list, list | None]:
        i, meta = out.get("index", 0), out["meta_info"]
        tokens, tops = meta.get("output_token_logprobs", []), meta.get("output_top_logprobs")
        start, self.logprobs[i] = self.logprobs.get(i, 0), len(tokens)
        return tokens[start:], (tops[start:] if tops else None)


def add_openai_routes(app: FastAPI, tm: TokenizerManager, tool_call_parser: str | None = None,
                      reasoning_parser: str | None = None) -> None:
    """The routes; the parsers (``--tool-call-parser``, ``--reasoning-parser``)
    split chat output into reasoning, content and tool calls."""

    @app.get("/v1/models")
    async def models():
        created = int(time.time())
        cards = [ModelCard(id=tm.served_model_name, created=created, owned_by="radixserve",
                           max_model_len=tm.context_len)]
        cards += [ModelCard(id=name, created=created, owned_by="radixserve", root=path, parent=tm.served_model_name,
                            max_model_len=tm.context_len) for name, path in sorted(tm.lora_adapters.items())]
        return ModelList(data=cards).model_dump()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        adapter, err = _adapter(tm, req.model)
        if err is not None:
            return err
        obj = GenerateReqInput(**{**A.completion_to_generate(req), **_lora(adapter)})
        gen = _naming_fields(tm.generate_request(obj, request), req)
        created, rid, model = int(time.time()), A.new_request_id("cmpl"), _reply_model(tm, req.model)
        prompts = A.prompt_texts(req, tm.tokenizer) if req.echo else None
        if not req.stream:
            outputs = [o async for o in gen]
            return A.build_completion_response(
                req, outputs, model, created, request_id=rid, prompts=prompts).model_dump()
        outs = await peek(gen)
        return StreamingResponse(sse_stream(_completion_events(req, model, outs, rid, created, prompts)),
                                 media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request):
        adapter, err = _adapter(tm, req.model)
        if err is not None:
            return err
        kwargs = await tm.run_blocking(A.chat_to_generate, req, tm.tokenizer, tool_call_parser)
        obj = GenerateReqInput(**{**kwargs, **_lora(adapter)})
        gen = _naming_fields(tm.generate_request(obj, request), req)
        created, rid, model = int(time.time()), A.new_request_id("chatcmpl"), _reply_model(tm, req.model)
        parsing = chat_parsing(req, tool_call_parser, reasoning_parser)
        if not req.stream:
            outputs = [o async for o in gen]
            return A.build_chat_response(
                req, outputs, model, created, request_id=rid, parsing=parsing).model_dump()
        outs = await peek(gen)
        return StreamingResponse(sse_stream(_chat_events(req, model, outs, rid, created, parsing)),
                                 media_type="text/event-stream")


async def _naming_fields(gen: AsyncIterator[dict], req) -> AsyncIterator[dict]:
    """``gen``, with a refused grammar, prompt or sampling parameter named by the request's field
    (``A.name_request_error``)."""
    try:
        async for out in gen:
            yield out
    except ValueError as exc:
        raise A.name_request_error(exc, req) from None
    finally:
        await gen.aclose()  # now, not when collected: a client that left aborts its request at once


async def _completion_events(req, model: str, outs, rid, created, prompts) -> AsyncIterator[str]:
    deltas, finals, n = _Deltas(), [], req.n or 1
    async for out in outs:
        i, text, is_first = deltas.text_delta(out)
        if is_first and prompts is not None:
            text = prompts[i // n] + text
        logprobs = None
        if req.logprobs is not None:
            tokens, tops = deltas.new_logprobs(out)
            logprobs = A.completion_logprobs(tokens, tops)
        reason = out["meta_info"]["finish_reason"]
        yield A.sse_event(A.completion_stream_chunk(rid, created, model, i, text,
                                                    finish_reason=reason, logprobs=logprobs))
        if reason is not None:
            finals.append(out)
    if req.stream_options and req.stream_options.include_usage:
        yield A.sse_event(A.usage_chunk(rid, created, model, finals, n, chat=False))


async def _chat_events(req, model: str, outs, rid, created, parsing: ChatParsing) -> AsyncIterator[str]:
    deltas, finals, parsers = _Deltas(), [], {}
    async for out in outs:
        i, text, is_first = deltas.text_delta(out)
        if is_first:  # parsed output may be only calls, whose message has null content
            yield A.sse_event(A.chat_stream_chunk(rid, created, model, i, role="assistant",
                                                  content=None if parsing.active else ""))
        logprobs = None
        if req.logprobs:
            tokens, tops = deltas.new_logprobs(out)
            logprobs = A.chat_logprobs(tokens, tops)
        reason = out["meta_info"]["finish_reason"]
        if reason is not None:
            finals.append(out)
        if not parsing.active:
            yield A.sse_event(A.chat_stream_chunk(rid, created, model, i, content=text,
                                                  finish_reason=reason, logprobs=logprobs))
            continue
        parser = parsers.setdefault(i, parsing.choice_parser())
        piece = parser.feed(text, final=reason is not None)
        if piece or reason is not None or (logprobs is not None and logprobs.content):
            yield A.sse_event(A.chat_stream_chunk(
                rid, created, model, i, content=piece.content or None,
                reasoning_content=piece.reasoning or None, tool_calls=piece.calls, logprobs=logprobs,
                finish_reason=A.tool_calls_finish(reason, parser.made_calls)))
    if req.stream_options and req.stream_options.include_usage:
        yield A.sse_event(A.usage_chunk(rid, created, model, finals, req.n or 1))
