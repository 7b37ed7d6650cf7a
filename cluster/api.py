"""The ingress: FastAPI under `serve.ingress`, speaking the OpenAI API.

Routes: GET /health, GET /metrics, GET /v1/models and /v1/models/{model}, POST
/v1/completions, /v1/chat/completions and /v1/responses (OpenAI's Responses API, as a chat
request), and vLLM's POST /tokenize and /detokenize. A request is authorized, parsed,
templated and tokenized here (on CPU, so worker replicas never tokenize), checked against
the model's context length, then handed to the Dispatcher, which batches and routes it to
a worker replica. Any failure becomes an OpenAI error body with the matching status code;
a streaming request waits for the worker to accept it before answering 200, so 429 and 400
stay statuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from cluster import limits, tools
from cluster.config import ClusterConfig
from cluster.dispatch import CallError, Dispatcher, Group, in_own_context
from cluster.errors import ApiError, from_call, from_validation
from cluster.generation import ChoiceDelta, ClosingStreamingResponse, Generation
from cluster.metrics import CONTENT_TYPE, Metrics, rss_bytes
from cluster.openai_responses import ResponsesRequest, ResponseWriter, item_id, renamed
from cluster.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ChatTemplateFields,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    FieldError,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    Usage,
    new_id,
    now,
    openapi_components,
    template_messages,
)
from cluster.reasoning import thinking
from cluster.responses import ChunkWriter, Collector, Echo, usage_of
from cluster.router import RouteHint
from worker.guided import GuidedDecoding, check_guided
from worker.heap import freeze_heap
from worker.model.demo import resolve_model_path
from worker.page_hash import page_hashes
from worker.sampling import SamplingParams
from worker.tokenizer import Tokenizer
from worker.validation import EngineRequest

log = logging.getLogger(__name__)

REPLICA_HEADER = "x-kvray-replica"  # which worker replica served the request
_INFO_TIMEOUT_S = 30.0
_MODELS_INFO_TIMEOUT_S = 2.0  # /v1/models answers without the context length rather than wait
_INLINE_TOKENIZE_CHARS = 16_384
_STATS_TIMEOUT_S = 5.0
_TEMPLATE_CHARS_PER_MESSAGE = 32  # what a chat template adds around each message, roughly
_INLINE_GRAMMAR_CHARS = 16_384  # longer grammars are checked in a thread

ParsedRequest = ChatCompletionRequest | CompletionRequest
Body = (
    ChatCompletionRequest
    | CompletionRequest
    | ResponsesRequest
    | TokenizeRequest
    | DetokenizeRequest
)


@serve.ingress()
class Ingress:
    """One ingress replica; `app.build_app` wraps it with `serve.deployment`."""

    def __init__(self, config: ClusterConfig, worker: Any):
        self._config = config
        self._worker = worker
        self._tokenizer = Tokenizer.from_dir(str(resolve_model_path(config.engine.model)))
        replica_id = serve.get_replica_context().replica_id.unique_id
        self._metrics = Metrics(config.model_name, replica_id)
        router, self._limits = config.advanced.router, config.advanced.limits
        self._dispatcher = Dispatcher(
            worker,
            router.batch_window_ms / 1000.0,
            router.max_batch_requests,
            self._limits.accept_timeout_s,
            config.advanced.stall_timeout_s,
            on_call=self._metrics.observe_call,
        )
        self._created = now()
        self._info: dict[str, Any] | None = None
        self._info_lock = asyncio.Lock()
        self._token_text_cache: dict[int, str] = {}
        freeze_heap()  # no full collection walks the tokenizer and modules mid-stream

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = FastAPI(
            title="kvray",
            docs_url=None,
            redoc_url=None,
            openapi_url="/openapi.json",
            redirect_slashes=False,  # a POST redirected to another path loses its body in some clients
        )
        app.add_exception_handler(ApiError, self._on_api_error)  # type: ignore[arg-type]
        app.add_exception_handler(StarletteHTTPException, self._on_http_error)  # type: ignore[arg-type]
        app.add_exception_handler(Exception, self._on_unexpected_error)
        app.add_api_route("/health", self.health, methods=["GET"], openapi_extra=_HEALTH_OP)
        app.add_api_route("/metrics", self.metrics, methods=["GET"], openapi_extra=_METRICS_OP)
        # path, handler, method, response schema, request schema (POST)
        routes: list[tuple[str, Callable[..., Any], str, str, str | None]] = [
            ("/v1/models", self.models, "GET", "ModelList", None),
            # `:path`: a model's name may hold slashes (`org/name`)
            ("/v1/models/{model:path}", self.model, "GET", "ModelCard", None),
            ("/v1/completions", self.completions, "POST", "Completion", "CompletionRequest"),
            ("/v1/chat/completions", self.chat_completions, "POST", "ChatCompletion",
             "ChatCompletionRequest"),
            ("/v1/responses", self.responses, "POST", "ResponseObject", "ResponsesRequest"),
        ]  # fmt: skip
        for path, handler, method, answer, body in routes:
            op = _openapi_op(answer, body)
            app.add_api_route(path, handler, methods=[method], openapi_extra=op)
        for path, handler, answer, body in (
            ("/tokenize", self.tokenize, "TokenizeResponse", "TokenizeRequest"),
            ("/detokenize", self.detokenize, "DetokenizeResponse", "DetokenizeRequest"),
        ):
            op = _openapi_op(answer, body, streams=False)
            app.add_api_route(path, handler, methods=["POST"], openapi_extra=op)
        app.openapi = lambda: self._openapi(app)  # type: ignore[method-assign]
        return app

    def _openapi(self, app: FastAPI) -> dict[str, Any]:
        """FastAPI's document plus the body schemas the routes reference by name."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(
                openapi_components()
            )
            app.openapi_schema = schema
        return app.openapi_schema

    # -- routes ---------------------------------------------------------------------------

    async def health(self) -> Response:
        if self._dispatcher.draining:  # load balancers take a draining ingress out
            return self._draining_error().response()
        await self._engine_info()
        return JSONResponse({"status": "ok"})

    async def metrics(self) -> Response:
        try:
            stats = await self._worker.broadcast("stats").results_async(
                timeout_s=_STATS_TIMEOUT_S, return_exceptions=True
            )
        except Exception as exc:  # no replica answered: export the ingress figures alone
            log.warning("could not read worker stats: %r", exc)
            stats = []
        snapshot = [s for s in stats if isinstance(s, dict)]
        return Response(self._metrics.render(snapshot), media_type=CONTENT_TYPE)

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse(ModelList(data=[await self._card()]).model_dump())

    async def model(self, request: Request, model: str) -> Response:
        """OpenAI's model retrieval (`client.models.retrieve`): the served model's card."""
        self._authorize(request)
        if model != self._config.model_name:
            raise ApiError(
                404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
            )
        return JSONResponse((await self._card()).model_dump())

    async def _card(self) -> ModelCard:
        return ModelCard(
            id=self._config.model_name,
            created=self._created,
            max_model_len=await self._max_model_len(),
        )

    async def tokenize(self, request: Request) -> Response:
        """Token ids of a prompt, or of chat messages as the chat route renders them."""
        req = await self._read(request, TokenizeRequest)
        assert isinstance(req, TokenizeRequest)
        if req.messages is not None:
            try:
                req.check_rendering(req.messages)
            except FieldError as exc:
                raise _field_error(exc) from None
            render, size, messages = self._chat_render(req.messages, req.functions, req)
            tokens = await self._run_tokenizer(size, render, messages)
        else:
            assert req.prompt is not None
            encode = functools.partial(
                self._tokenizer.encode, add_special_tokens=req.add_special_tokens
            )
            tokens = await self._run_tokenizer(len(req.prompt), encode, req.prompt)
        strs = None
        if req.return_token_strs:
            strs = list(self._tokenizer.hf_tokenizer.convert_ids_to_tokens(tokens))
        body = TokenizeResponse(
            count=len(tokens),
            max_model_len=await self._max_model_len(),
            tokens=tokens,
            token_strs=strs,
        )
        return JSONResponse(body.model_dump())

    async def detokenize(self, request: Request) -> Response:
        """The text of token ids, special tokens included."""
        req = await self._read(request, DetokenizeRequest)
        assert isinstance(req, DetokenizeRequest)
        vocab = self._tokenizer.vocab_size
        for i, token in enumerate(req.tokens):
            if token >= vocab:
                message = f"token id {token} is outside the vocabulary (size {vocab})"
                raise ApiError(400, message, param=f"tokens.{i}", code="invalid_value")
        text = self._tokenizer.decode(req.tokens, skip_special_tokens=False)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

    async def chat_completions(self, request: Request) -> Response:
        arrival = time.perf_counter()
        req = await self._parse(request, ChatCompletionRequest)
        assert isinstance(req, ChatCompletionRequest)
        render, size, messages = self._chat_render(req.messages, req.functions, req)
        prompt = await self._tokenize(size, render, messages)
        params = thinking(req.sampling_params(), self._config.reasoning_parser)
        return await self._generate(req, [list(prompt)], params, arrival, chat=True)

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API, as a chat request (cluster/openai_responses.py)."""
        arrival = time.perf_counter()
        try:
            body = await self._read(request, ResponsesRequest)
        except ApiError as exc:
            raise renamed(exc) from None
        assert isinstance(body, ResponsesRequest)
        refused = body.refused_field()
        if refused:
            message = f"'{refused}' is not supported by this server (it keeps no responses)"
            raise ApiError(400, message, param=refused, code="unsupported")
        try:
            req = await self._checked(body.chat_request())
            assert isinstance(req, ChatCompletionRequest)
            render, size, messages = self._chat_render(req.messages, req.functions, req)
            prompt = await self._tokenize(size, render, messages)
            rid = item_id("resp")
            params = thinking(req.sampling_params(), self._config.reasoning_parser)
            gen, headers = await self._start(rid, req, [prompt], params, arrival, True)
        except ApiError as exc:
            raise renamed(exc) from None
        reasoning = self._config.reasoning_parser
        writer = ResponseWriter(rid, now(), body, req.parses_tool_calls, reasoning)
        if body.stream:
            events = self._sse(gen, writer.start(), writer.deltas, writer.finish, writer.error)
            return ClosingStreamingResponse(
                events,
                gen.stream.close,
                media_type="text/event-stream",
                headers=headers,
            )
        try:
            async for deltas in gen.deltas():
                writer.deltas(deltas)
                for delta in deltas:
                    if delta.finish_reason:
                        self._metrics.count_finished(delta.finish_reason)
        except CallError as exc:
            raise from_call(exc, self._limits.retry_after_s) from None
        response = writer.response(usage=usage_of(gen))
        return JSONResponse(response.model_dump(), headers=headers)

    async def completions(self, request: Request) -> Response:
        arrival = time.perf_counter()
        req = await self._parse(request, CompletionRequest)
        assert isinstance(req, CompletionRequest)
        texts = req.prompts()
        prompts = [
            await self._tokenize(len(p), self._tokenizer.encode, p) if isinstance(p, str) else p
            for p in texts
        ]
        echo = None
        if req.echo:  # each prompt as sent (token ids: their text), once per choice
            echo = [
                Echo(t if isinstance(t, str) else self._tokenizer.decode(p), list(p), req.logprobs)
                for t, p in zip(texts, prompts, strict=True)
                for _ in range(req.n)
            ]
        return await self._generate(
            req, [list(p) for p in prompts], req.sampling_params(), arrival, chat=False, echo=echo
        )

    # -- request handling -----------------------------------------------------------------

    def _chat_render(
        self,
        messages: list[ChatMessage],
        functions: list[tools.Function],
        template: ChatTemplateFields,
    ) -> tuple[Callable[[list[dict[str, Any]]], list[int]], int, list[dict[str, Any]]]:
        """How the chat template renders `messages` and the tools shown beside them: the
        tokenizing call, the characters it takes, and the messages to give it."""
        takes_tools = self._tokenizer.template_takes_tools
        rendered, shown = tools.template_inputs(
            template_messages(messages, takes_tools), functions, takes_tools
        )
        size = sum(len(m["content"]) for m in rendered) + len(json.dumps(shown or []))
        render = functools.partial(
            self._tokenizer.apply_chat_template,
            add_generation_prompt=template.add_generation_prompt,
            tools=shown,
            continue_final_message=template.continue_final_message,
            template_kwargs=template.chat_template_kwargs,
        )
        return render, size, rendered

    async def _max_model_len(self) -> int | None:
        """The context length, from a worker asked once; None while none can say."""
        if self._info is None:
            with contextlib.suppress(ApiError, TimeoutError):
                await asyncio.wait_for(self._engine_info(), _MODELS_INFO_TIMEOUT_S)
        return (self._info or {}).get("max_seq_len")

    async def _parse(self, request: Request, model: type[ParsedRequest]) -> ParsedRequest:
        """Authorize, read the body under its size limit, validate it and apply the limits."""
        req = await self._read(request, model)
        assert isinstance(req, ChatCompletionRequest | CompletionRequest)
        return await self._checked(req)

    async def _checked(self, req: ParsedRequest) -> ParsedRequest:
        """A valid request's refused fields, limits, sampling parameters and grammars."""
        refused = req.refused_field()
        if refused:
            raise ApiError(
                400,
                f"'{refused}' is not supported by this server",
                param=refused,
                code="unsupported",
            )
        limits.check_request(req, self._limits)
        await self._check_fan_out(req)
        req = limits.with_default_max_tokens(req, self._limits.max_tokens)
        try:  # what the protocol lets through must also make valid SamplingParams
            if isinstance(req, ChatCompletionRequest):
                req.check_rendering(req.messages)
            params = req.sampling_params()
        except ValidationError as exc:
            raise from_validation(exc) from None
        except FieldError as exc:
            raise _field_error(exc) from None
        await self._check_grammars(req, params.guided)
        return req

    async def _read(self, request: Request, model: type[Body]) -> Body:
        """Authorize, read the body under its size limit, validate it, check the model name."""
        self._authorize(request)
        cap = self._limits.max_request_bytes
        limits.check_content_length(request.headers, cap)
        limits.check_content_type(request.headers)
        try:
            body = await limits.read_limited(request.stream(), cap)
        except ClientDisconnect:  # no one to answer; not a server error in the metrics
            raise ApiError(
                400, "the client left while sending the body", code="disconnected"
            ) from None
        try:
            req = model.model_validate_json(body)
        except ValidationError as exc:
            raise from_validation(exc) from None
        if req.model != self._config.model_name:
            raise ApiError(
                404,
                f"The model `{req.model}` does not exist.",
                param="model",
                code="model_not_found",
            )
        return req

    async def _check_grammars(self, req: ParsedRequest, guided: GuidedDecoding | None) -> None:
        """Every schema, regex or grammar of the request compiles (the engine's own check):
        a tool's parameters, and what the output must match."""
        specs: list[tuple[GuidedDecoding, str | None]] = []
        if isinstance(req, ChatCompletionRequest):
            for i, tool in enumerate(req.tools or []):
                if tool.function.parameters is not None:
                    schema = GuidedDecoding.from_schema(tool.function.parameters)
                    specs.append((schema, f"tools.{i}.function.parameters"))
        if guided is not None:
            specs.append((guided, req.guided_param()))
        for spec, param in specs:
            try:
                if len(spec.spec) > _INLINE_GRAMMAR_CHARS:
                    await asyncio.to_thread(check_guided, spec)
                else:
                    check_guided(spec)
            except ValueError as exc:
                raise ApiError(400, f"{param}: {exc}", param=param, code="invalid_value") from None

    async def _generate(
        self,
        req: ParsedRequest,
        prompts: list[list[int]],
        params: SamplingParams,
        arrival: float,
        chat: bool,
        echo: list[Echo] | None = None,
    ) -> Response:
        rid, model = new_id("chatcmpl" if chat else "cmpl"), self._config.model_name
        gen, headers = await self._start(rid, req, prompts, params, arrival, chat)
        stream = gen.stream
        calls = req.parses_tool_calls
        reasoning = self._config.reasoning_parser if chat else "none"
        if req.stream:
            writer = ChunkWriter(
                rid,
                now(),
                model,
                chat,
                self._token_text,
                req.include_usage,
                tool_calls=calls,
                echo=echo,
                reasoning=reasoning,
            )
            opening = writer.start(len(stream.group.requests))
            body = self._sse(
                gen, opening, writer.deltas, writer.usage, ApiError.sse, "data: [DONE]\n\n"
            )
            return ClosingStreamingResponse(
                body, gen.stream.close, media_type="text/event-stream", headers=headers
            )
        scored = req.prompt_logprobs is not None  # each choice's prompt: n in a row per prompt
        collector = Collector(
            len(stream.group.requests),
            params.logprobs is not None,
            tool_calls=calls,
            echo=echo,
            reasoning=reasoning,
            scored_prompts=[p for p in prompts for _ in range(req.n)] if scored else None,
            prompt_alternatives=req.prompt_logprobs or 0,
        )
        try:
            async for deltas in gen.deltas():
                for delta in deltas:
                    collector.add(delta)
        except CallError as exc:
            raise from_call(exc, self._limits.retry_after_s) from None
        self._count_finished(collector.choices.values())
        build = collector.chat if chat else collector.completion
        response = build(rid, now(), model, usage_of(gen), self._token_text)
        return JSONResponse(response.model_dump(), headers=headers)

    async def _start(
        self,
        rid: str,
        req: ParsedRequest,
        prompts: list[list[int]],
        params: SamplingParams,
        arrival: float,
        chat: bool,
    ) -> tuple[Generation, dict[str, str]]:
        """The response's requests checked against the engine, sent, and accepted by a
        replica; their generation, and the headers that name the replica."""
        if self._dispatcher.draining:
            raise self._draining_error()
        info = await self._engine_info()
        for prompt in prompts:
            self._check_length(prompt, params.max_tokens, info, chat)
        limits.check_logit_bias(params, info.get("vocab_size", self._tokenizer.vocab_size))
        group = self._group(rid, prompts, params, req.n, info)
        stream = self._dispatcher.submit(group)
        gen = Generation(
            stream,
            self._tokenizer,
            params,
            arrival,
            self._metrics.observe_choice,
            n=req.n,
            on_engine_metrics=self._metrics.observe_engine,
        )
        try:
            replica_id = await stream.accepted()
        except CallError as exc:
            stream.close()
            raise from_call(exc, self._limits.retry_after_s) from None
        except asyncio.CancelledError:  # the client left while the call was being routed
            stream.close()
            raise
        return gen, {REPLICA_HEADER: replica_id}

    async def _sse(
        self,
        gen: Generation,
        opening: list[str],
        each: Callable[[list[ChoiceDelta]], list[str]],
        closing: Callable[[Usage], list[str]],
        failure: Callable[[ApiError], str],
        end: str = "",
    ) -> AsyncIterator[str]:
        """A streamed response's events: `opening`, then `each` step's deltas, then `closing`
        with the usage; a failure after the stream began is its `failure` event."""
        try:
            for line in opening:
                yield line
            async for deltas in gen.deltas():
                for delta in deltas:
                    if delta.finish_reason:
                        self._metrics.count_finished(delta.finish_reason)
                for line in each(deltas):
                    yield line
            for line in closing(usage_of(gen)):
                yield line
        except CallError as exc:
            error = from_call(exc, self._limits.retry_after_s)
            self._metrics.count_failed(error.status)
            yield failure(error)
        finally:
            gen.stream.close()
        if end:
            yield end

    def _group(
        self,
        rid: str,
        prompts: list[list[int]],
        params: SamplingParams,
        n: int,
        info: dict[str, Any],
    ) -> Group:
        """The engine requests of one response: prompt `p`'s choice `i` is `{rid}-{p}-{i}`, so
        a request id in a worker's log names the response the client got."""
        requests = []
        for p, prompt in enumerate(prompts):
            fitted = limits.fit_context(len(prompt), params.max_tokens, info["max_seq_len"])
            base = params
            if fitted != params.max_tokens:
                assert fitted is not None
                update = {"max_tokens": fitted, "min_tokens": min(params.min_tokens, fitted)}
                base = params.model_copy(update=update)
            for i in range(n):
                seed = base.seed + i if base.seed is not None and n > 1 else base.seed
                one = base.model_copy(update={"seed": seed}) if seed != base.seed else base
                requests.append(EngineRequest(f"{rid}-{p}-{i}", prompt, one))
        hashes: tuple[tuple[int, ...], ...] = ()
        if info.get("prefix_cache") and self._config.advanced.router.hashes_prompts:
            pages = self._config.advanced.router.prompt_pages
            hashes = tuple(
                tuple(page_hashes(prompt, info["page_size"], max_pages=pages)) for prompt in prompts
            )
        return Group(requests, hashes)

    def _check_length(
        self, prompt: list[int], max_tokens: int | None, info: dict[str, Any], chat: bool
    ) -> None:
        """The worker's own rules (`worker.validation`) against the engine's facts: the model's
        vocabulary and context, not the tokenizer's."""
        max_seq_len = info["max_seq_len"]
        field = "messages" if chat else "prompt"
        if not prompt:
            raise ApiError(400, "the prompt is empty", param=field)
        limits.check_prompt_tokens(prompt, self._limits.max_prompt_tokens, field)
        limits.check_prompt_ids(prompt, info.get("vocab_size", self._tokenizer.vocab_size), field)
        cap = self._limits.max_tokens
        limits.check_context(len(prompt), max_tokens, max_seq_len, cap, field)

    # -- draining (shutdown) --------------------------------------------------------------

    async def start_draining(self) -> int:
        """From now on refuse new requests (503 + Retry-After) and fail /health; running
        requests go on. Called by `kvray serve` on SIGTERM before Serve shuts down, since
        Serve tells a replica nothing before its own drain. Returns the requests in flight."""
        self._dispatcher.draining = True
        return self._dispatcher.num_open

    async def drain_status(self) -> dict[str, Any]:
        """Whether this replica drains, how many requests it still serves, its RSS."""
        return {
            "replica_id": serve.get_replica_context().replica_id.unique_id,
            "draining": self._dispatcher.draining,
            "in_flight": self._dispatcher.num_open,
            "rss_bytes": rss_bytes(),
        }

    def _draining_error(self) -> ApiError:
        return ApiError(
            503,
            "the server is shutting down; retry on another replica",
            code="draining",
            retry_after=self._limits.retry_after_s,
        )

    # -- helpers --------------------------------------------------------------------------

    async def _tokenize(self, size: int, fn: Any, arg: Any) -> list[int]:
        """Tokenize inline, or in a thread for long inputs so other streams keep flowing.

        A text too long for the context whatever its tokens is refused untokenized: a 4 MB
        prompt would cost seconds of ingress CPU to learn what its length already says.
        """
        chat = isinstance(arg, list)
        texts = [m["content"] for m in arg] if chat else [arg]
        await self._check_text_size(sum(len(t) for t in texts), "messages" if chat else "prompt")
        return await self._run_tokenizer(size, fn, arg)

    async def _run_tokenizer(self, size: int, fn: Any, arg: Any) -> list[int]:
        """`fn(arg)` inline, or in a thread for long inputs so other streams keep flowing."""
        if isinstance(arg, list):  # many empty messages still make a long template
            size = max(size, len(arg) * _TEMPLATE_CHARS_PER_MESSAGE)
        try:
            if size > _INLINE_TOKENIZE_CHARS:
                return list(await asyncio.to_thread(fn, arg))
            return list(fn(arg))
        except (ValueError, TypeError) as exc:  # e.g. a model without a chat template
            raise ApiError(400, f"cannot tokenize the input: {exc}", code="invalid_input") from None

    async def _check_fan_out(self, req: ParsedRequest) -> None:
        """A request of more sequences than a worker ever queues would get 429 forever."""
        info = await self._engine_info()
        max_waiting = info.get("engine", {}).get("max_waiting")
        if max_waiting is not None:
            prompts = len(req.prompts()) if isinstance(req, CompletionRequest) else 1
            limits.check_fan_out(prompts, req.n, int(max_waiting))

    async def _check_text_size(self, num_chars: int, field: str) -> None:
        info = await self._engine_info()
        most = info["max_seq_len"] - 1
        if self._limits.max_prompt_tokens is not None:
            most = min(most, self._limits.max_prompt_tokens)
        limits.check_text_size(num_chars, self._token_chars, most, field)

    @functools.cached_property
    def _token_chars(self) -> int:
        return limits.longest_token_chars(self._tokenizer.decode, self._tokenizer.vocab_size)

    def _authorize(self, request: Request) -> None:
        keys = self._config.api_keys
        if not keys:
            return
        header = request.headers.get("authorization", "")
        token = header[7:].strip() if header.lower().startswith("bearer ") else ""
        if not any(hmac.compare_digest(token.encode(), k.encode()) for k in keys):
            raise ApiError(401, "Incorrect or missing API key.", code="invalid_api_key")

    async def _engine_info(self) -> dict[str, Any]:
        """The resolved engine facts (context length, page size), asked of a worker once."""
        if self._info is not None:
            return self._info
        async with self._info_lock:
            if self._info is None:
                try:
                    async with asyncio.timeout(_INFO_TIMEOUT_S):
                        self._info = await in_own_context(self._ask_info())
                except Exception as exc:
                    raise ApiError(
                        503,
                        f"no worker replica is available: {exc!r}",
                        retry_after=self._limits.retry_after_s,
                    ) from None
        assert self._info is not None
        return self._info

    async def _ask_info(self) -> dict[str, Any]:
        return dict(await self._worker.info.remote(RouteHint()))

    def _token_text(self, token_id: int) -> str:
        text = self._token_text_cache.get(token_id)
        if text is None:
            text = self._token_text_cache[token_id] = self._tokenizer.decode([token_id])
        return text

    def _count_finished(self, choices: Any) -> None:
        for choice in choices:
            self._metrics.count_finished(choice.finish_reason or "stop")

    def _on_http_error(self, request: Request, exc: StarletteHTTPException) -> Response:
        return self._on_api_error(request, ApiError(exc.status_code, str(exc.detail)))

    def _on_api_error(self, request: Request, exc: ApiError) -> Response:
        self._metrics.count_failed(exc.status)
        return exc.response()

    def _on_unexpected_error(self, request: Request, exc: Exception) -> Response:
        """A bug still answers in OpenAI's error format (Starlette logs the traceback)."""
        return self._on_api_error(request, ApiError(500, "internal server error"))


_ERROR_CONTENT = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
_HEALTH_OP = {
    "responses": {
        "200": {
            "description": "ready",
            "content": {"application/json": {"schema": {"type": "object"}}},
        },
        "503": {"description": "no worker replica, or draining", "content": _ERROR_CONTENT},
    }
}
_SSE_EVENT = {
    "type": "object",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "required": ["data"],
}
_METRICS_OP = {
    "responses": {
        "200": {
            "description": "Prometheus text format",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        }
    }
}


def _field_error(exc: FieldError) -> ApiError:
    """A value the protocol let through that the request's other fields rule out."""
    return ApiError(400, exc.message, param=exc.param, code="invalid_value")


def _openapi_op(response: str, body: str | None = None, streams: bool = True) -> dict[str, Any]:
    """OpenAPI operation fields of a route taking a raw Request: its body and answers (an
    event stream too where the body can ask for one)."""

    def content(name: str) -> dict[str, Any]:
        return {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}

    error = {"description": "OpenAI error body", "content": _ERROR_CONTENT}
    ok: dict[str, Any] = {"description": "success", "content": content(response)}
    op: dict[str, Any] = {"responses": {"200": ok, "401": error, "404": error, "503": error}}
    if body is not None:
        if streams:
            ok["content"]["text/event-stream"] = {"schema": _SSE_EVENT}  # 3.1: one event
        op["requestBody"] = {"required": True, "content": content(body)}
        for status in ("400", "413", "415", "429", "500"):
            op["responses"][status] = error
    return op
