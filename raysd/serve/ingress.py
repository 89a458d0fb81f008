"""The OpenAI-compatible HTTP API (FastAPI on the Serve proxy) in front of the round loop.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics, and
GET/PUT /v1/admin/policy (the speculation policy of the whole cluster, switched without a restart).
Every refusal is an OpenAI error object ``{"error": {"message", "type", "param", "code"}}`` with a 4xx
status (503 for a retryable server-side failure).
"""

import asyncio
import hmac
import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError
from ray import serve

from raysd.api import (
    ChatChoice,
    ChatChoiceMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ErrorDetail,
    ErrorResponse,
    SpeculationStats,
    Usage,
    new_id,
    render_chat,
)
from raysd.config import PolicyConfig, SamplingParams, SpeculationMode
from raysd.models import load_tokenizer
from raysd.sequence import process_tag
from raysd.serve.config import RouterConfig
from raysd.serve.metrics_export import ServingMetrics
from raysd.serve.request_trace import end_request_span, start_request_span
from raysd.serve.router import NonFiniteLogitsError, RequestStream, RoundLoop
from raysd.serve.text import IncrementalDetokenizer

logger = logging.getLogger("raysd.ingress")
api = FastAPI(title="raysd", description="Speculative decoding, OpenAI-compatible.")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        body = ErrorResponse(error=ErrorDetail(message=self.message, type=self.type, param=self.param,
                                               code=self.code))
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        return JSONResponse(body.model_dump(), status_code=self.status, headers=headers)


def _validation_error(error: ValidationError) -> APIError:
    first = error.errors()[0]
    param = ".".join(str(part) for part in first.get("loc", ())) or None
    return APIError(400, f"{param}: {first.get('msg')}" if param else first.get("msg", "invalid request"),
                    param=param, code="invalid_value")


@api.exception_handler(APIError)
async def _api_error_handler(request: Request, error: APIError):
    return error.response()


@api.exception_handler(RequestValidationError)
async def _request_validation_handler(request: Request, error: RequestValidationError):
    first = error.errors()[0] if error.errors() else {}
    param = ".".join(str(part) for part in first.get("loc", ())) or None
    return APIError(400, f"{param}: {first.get('msg', 'invalid request')}", param=param,
                    code="invalid_value").response()


@api.exception_handler(404)
async def _not_found(request: Request, error):
    return APIError(404, f"no route {request.method} {request.url.path}", code="not_found").response()


@api.exception_handler(405)
async def _method_not_allowed(request: Request, error):
    return APIError(405, f"method {request.method} not allowed on {request.url.path}").response()


def _openapi_with_request_bodies() -> dict:
    """FastAPI's schema plus the request bodies the generation routes parse themselves (they read the raw
    body to enforce the size limit and answer in OpenAI's error shape), so clients and fuzzers see them."""
    if api.openapi_schema:
        return api.openapi_schema
    from fastapi.openapi.utils import get_openapi

    schema = get_openapi(title=api.title, version="0.1.0", description=api.description, routes=api.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, model in (("/v1/completions", CompletionRequest), ("/v1/chat/completions", ChatCompletionRequest)):
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
        schema["paths"][path]["post"]["requestBody"] = {
            "required": True, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/"
                                                                                   f"{model.__name__}"}}}}
    api.openapi_schema = schema
    return schema


api.openapi = _openapi_with_request_bodies


@serve.ingress(api)
class Router:
    """Serve ingress deployment: tokenizes, submits to the round loop, answers in OpenAI's shapes."""

    def __init__(self, config: RouterConfig, tokenizer_dir: str, monitor_handle, worker_handles: list,
                 drafts_configured: bool):
        """``worker_handles`` (target, draft) are bound only so Serve deploys them: rounds go to the workers'
        model actors directly, found through the monitor's cluster view."""
        self.config = config
        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.monitor = monitor_handle
        self.worker_handles = worker_handles
        self.other_routers_pressure = 0.0  # the other routers' load, as the monitor last had it
        self.router_id = f"router-{process_tag()}"  # the tag in every sequence id this router makes
        self.loop = RoundLoop(config, self.tokenizer.eos_token_id, pressure_source=lambda: self.cluster_pressure,
                              drafts_configured=drafts_configured)
        self._pressure_task: asyncio.Task | None = None
        self.metrics = ServingMetrics()
        self.loop.on_round.append(self.metrics.record_round)

    # --------------------------------------------------------------------------------- pressure
    @property
    def local_pressure(self) -> float:
        """This router's load now: sequences running and waiting."""
        return float(len(self.loop.engine.running) + len(self.loop.engine.waiting))

    @property
    def cluster_pressure(self) -> float:
        """The cluster's load as of this round: the other routers' last reports plus this router's own load now.
        Its own report is up to a reporting period (and a remote call) old; read back from the monitor, a load
        step on this router reached its own gate that much late."""
        return self.other_routers_pressure + self.local_pressure

    async def _pressure_reporter(self) -> None:
        while True:
            local = self.local_pressure
            try:
                view = await self.monitor.report.remote(self.router_id, local)
                self.other_routers_pressure = max(0.0, view.pressure - view.sources.get(self.router_id, local))
                self.loop.update_view(view)
            except Exception as error:  # monitor restarting: fall back to our own load and last view
                logger.warning("cluster monitor unavailable: %s", error)
                self.other_routers_pressure = 0.0
            self.metrics.update_state(self._state())
            await asyncio.sleep(0.2)

    def _ensure_reporter(self) -> None:
        if self.monitor is not None and (self._pressure_task is None or self._pressure_task.done()):
            self._pressure_task = asyncio.get_running_loop().create_task(self._pressure_reporter())

    async def check_health(self) -> None:
        """Serve's periodic health check; also starts the cluster reporter as soon as the replica is up."""
        self._ensure_reporter()

    # ----------------------------------------------------------------------------------- parsing
    def _authorize(self, request: Request) -> None:
        """With an API key configured, require ``Authorization: Bearer <key>`` (constant-time compare)."""
        if self.config.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        expected = self.config.api_key.get_secret_value().encode()
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
            raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                           type_="authentication_error", code="invalid_api_key")

    async def _parse(self, request: Request, schema):
        payload = await self._json_body(request)
        try:
            parsed = schema.model_validate(payload)
        except ValidationError as error:
            raise _validation_error(error) from None
        if parsed.model != self.config.model_alias:
            raise APIError(404, f"model {parsed.model!r} does not exist; available: {self.config.model_alias!r}",
                           param="model", code="model_not_found")
        return parsed

    async def _json_body(self, request: Request) -> dict:
        """The authorized request's body as a JSON object (401 / 413 / 400 otherwise)."""
        self._authorize(request)
        body = await request.body()
        if len(body) > self.config.max_body_bytes:
            raise APIError(413, f"request body of {len(body)} bytes exceeds the limit of "
                                f"{self.config.max_body_bytes}", code="request_too_large")
        try:
            payload = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise APIError(400, f"request body is not valid JSON: {error}", code="invalid_json") from None
        if not isinstance(payload, dict):
            raise APIError(400, "request body must be a JSON object", code="invalid_json")
        return payload

    def _sampling(self, parsed, prompt_len: int, max_tokens: int | None, route: str,
                  workload_header: str | None = None) -> tuple[SamplingParams, str]:
        limit = self.config.engine.max_model_len
        if prompt_len >= limit:
            raise APIError(400, f"prompt is {prompt_len} tokens; the context is {limit} tokens",
                           param="prompt", code="context_length_exceeded")
        max_tokens = max_tokens if max_tokens is not None else limit - prompt_len
        if prompt_len + max_tokens > limit:
            raise APIError(400, f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the context of "
                                f"{limit} tokens; lower max_tokens", param="max_tokens",
                           code="context_length_exceeded")
        params = SamplingParams(
            max_tokens=max_tokens, temperature=parsed.temperature, top_p=parsed.top_p,
            top_k=max(parsed.top_k, 0), seed=parsed.seed, ignore_eos=parsed.ignore_eos,
            speculation=SpeculationMode.off if parsed.speculation == "off" else None)
        workload = parsed.workload or workload_header or "default"
        if len(workload) > 64 or not all(c.isalnum() or c in "-_." for c in workload):
            raise APIError(400, "workload tag must be 1-64 characters of letters, digits, '-', '_' or '.'",
                           param="metadata.workload", code="invalid_value")
        segment = f"{route}:{self.config.model_alias}:{workload}"
        return params, segment

    # ------------------------------------------------------------------------------- generation
    async def _collect(self, stream: RequestStream, stops: list[str], started: float):
        """Yield ``(text_delta, token_ids_delta)`` until the sequence ends; enforces stop strings; records
        time to first token (from ``started``, the request's arrival) and the gap before each burst."""
        detokenizer = IncrementalDetokenizer(self.tokenizer, stops)
        segment, last = stream.sequence.segment, None
        try:
            while True:
                burst = await stream.queue.get()
                now = time.perf_counter()
                if burst:
                    if last is None:
                        self.metrics.observe_ttft(segment, now - started)
                    else:
                        self.metrics.observe_gap(segment, now - last)
                    last = now
                if burst is None:
                    if isinstance(stream.error, NonFiniteLogitsError):
                        raise APIError(500, str(stream.error), type_="server_error", code="non_finite_logits")
                    if stream.error is not None:
                        raise APIError(503, str(stream.error), type_="service_unavailable",
                                       code="worker_unavailable")
                    tail = detokenizer.flush()
                    if tail:
                        yield tail, []
                    return
                delta, stopped = detokenizer.push(burst)
                yield delta, burst
                if stopped:
                    stream.sequence.finish_reason = "stop"
                    self.loop.cancel(stream.sequence.seq_id)
                    return
        finally:
            if not stream.sequence.finished:
                self.loop.cancel(stream.sequence.seq_id)  # client went away: free its slots now

    def _stats(self, stream: RequestStream) -> SpeculationStats:
        stats = stream.sequence.stats
        return SpeculationStats(
            num_draft_tokens=stats.drafted_tokens, num_accepted_draft_tokens=stats.accepted_tokens,
            draft_acceptance_rate=stats.acceptance_rate, mean_acceptance_length=stats.mean_acceptance_length,
            num_spec_steps=stats.spec_rounds, num_rounds=stats.rounds, policy_reason=stats.last_reason,
            rounds_by_reason=dict(stats.rounds_by_reason), segment=stream.sequence.segment)

    async def _respond(self, parsed, prompt_ids: list[int], max_tokens: int | None, route: str, chat: bool,
                       request: Request, started: float):
        params, segment = self._sampling(parsed, len(prompt_ids), max_tokens, route,
                                         request.headers.get("x-raysd-workload"))
        self._ensure_reporter()
        if len(self.loop.engine.waiting) >= self.config.max_waiting:
            raise APIError(503, f"the server is at capacity ({len(self.loop.engine.waiting)} requests already wait "
                                "for a batch slot); retry after a moment", type_="service_unavailable",
                           code="overloaded")
        span = start_request_span(request.headers, "chat" if chat else "text_completion", parsed,
                                  len(prompt_ids), segment)
        stream = self.loop.submit(prompt_ids, params, segment, span=span)
        if parsed.stream:
            return StreamingResponse(self._sse(parsed, stream, chat, started), media_type="text/event-stream")
        text, token_ids = "", []
        try:
            async for delta, ids in self._collect(stream, parsed.stop_list, started):
                text += delta
                token_ids += ids
        except APIError as error:
            end_request_span(span, len(token_ids), "error", None, error.message)
            raise
        sequence = stream.sequence
        token_ids = sequence.output_token_ids if not parsed.stop_list else token_ids
        usage = Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(token_ids),
                      total_tokens=len(prompt_ids) + len(token_ids))
        extra = {"prompt_token_ids": prompt_ids, "token_ids": token_ids} if parsed.return_token_ids else {}
        finish = sequence.finish_reason
        stats = self._stats(stream)
        end_request_span(span, len(token_ids), finish, stats.model_dump())
        if chat:
            choice = ChatChoice(message=ChatChoiceMessage(content=text), finish_reason=finish, **extra)
            response = ChatCompletionResponse(model=parsed.model, choices=[choice], usage=usage, speculation=stats)
        else:
            choice = CompletionChoice(text=text, finish_reason=finish, **extra)
            response = CompletionResponse(model=parsed.model, choices=[choice], usage=usage, speculation=stats)
        return JSONResponse(response.model_dump(exclude_none=True))

    async def _sse(self, parsed, stream: RequestStream, chat: bool, started: float):
        response_id = new_id("chatcmpl" if chat else "cmpl")
        kind = "chat.completion.chunk" if chat else "text_completion"
        prompt_len = len(stream.sequence.prompt_token_ids)
        emitted = 0

        def chunk(delta_text: str, ids: list[int], finish: str | None, first: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": delta_text} if first else {"content": delta_text}
                choice = {"index": 0, "delta": delta if delta_text or first else {}, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta_text, "finish_reason": finish, "logprobs": None}
            if parsed.return_token_ids:
                choice["token_ids"] = ids
            body = {"id": response_id, "object": kind, "model": parsed.model, "choices": [choice]}
            return f"data: {json.dumps(body)}\n\n"

        first, error_message = True, "client disconnected"
        try:
            async for delta, ids in self._collect(stream, parsed.stop_list, started):
                emitted += len(ids)
                yield chunk(delta, ids, None, first)
                first = False
            error_message = None
        except APIError as error:
            error_message = error.message
            yield f"data: {json.dumps({'error': ErrorDetail(message=error.message, type=error.type, code=error.code).model_dump()})}\n\n"  # noqa: E501
            yield "data: [DONE]\n\n"
            return
        finally:
            end_request_span(stream.span, emitted, stream.sequence.finish_reason, self._stats(stream).model_dump(),
                             error_message)
        yield chunk("", [], stream.sequence.finish_reason)
        if parsed.stream_options is not None and parsed.stream_options.include_usage:
            usage = Usage(prompt_tokens=prompt_len, completion_tokens=emitted, total_tokens=prompt_len + emitted)
            body = {"id": response_id, "object": kind, "model": parsed.model, "choices": [],
                    "usage": usage.model_dump(), "speculation": self._stats(stream).model_dump()}
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"

    # ----------------------------------------------------------------------------------- routes
    @api.post("/v1/completions")
    async def completions(self, request: Request):
        started = time.perf_counter()
        try:
            parsed = await self._parse(request, CompletionRequest)
            prompt_ids = parsed.prompt if isinstance(parsed.prompt, list) else self.tokenizer.encode(parsed.prompt)
            if any(not 0 <= token < len(self.tokenizer) for token in prompt_ids):
                raise APIError(400, f"prompt token ids must be in [0, {len(self.tokenizer)})", param="prompt")
            return await self._respond(parsed, prompt_ids, parsed.max_tokens, "completions", chat=False,
                                       request=request, started=started)
        except APIError as error:
            return error.response()

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        started = time.perf_counter()
        try:
            parsed = await self._parse(request, ChatCompletionRequest)
            prompt_ids = self.tokenizer.encode(render_chat(parsed.messages, self.tokenizer))
            max_tokens = parsed.max_completion_tokens or parsed.max_tokens
            return await self._respond(parsed, prompt_ids, max_tokens, "chat", chat=True, request=request,
                                       started=started)
        except APIError as error:
            return error.response()

    @api.get("/v1/models")
    async def models(self, request: Request):
        try:
            self._authorize(request)
        except APIError as error:
            return error.response()
        return {"object": "list", "data": [{"id": self.config.model_alias, "object": "model", "owned_by": "raysd",
                                            "max_model_len": self.config.engine.max_model_len}]}

    @api.get("/v1/admin/policy")
    async def get_policy(self, request: Request):
        try:
            self._authorize(request)
        except APIError as error:
            return error.response()
        return self._policy_state()

    @api.put("/v1/admin/policy")
    async def put_policy(self, request: Request):
        """Switch the cluster's speculation policy: a JSON object of PolicyConfig fields (e.g. ``{"mode": "off"}``,
        ``{"mode": "on", "k": 2}``); fields left out take their configured values, not the previous change's.
        This router switches at its next round, the others at their next cluster report (~0.2 s)."""
        try:
            changes = await self._json_body(request)
            try:
                policy = PolicyConfig.model_validate({**self.config.policy.model_dump(), **changes})
            except ValidationError as error:
                raise _validation_error(error) from None
            try:
                self.loop.engine.use_policy(policy)
            except ValueError as error:
                raise APIError(400, str(error), param="k", code="invalid_value") from None
            version = self.loop.policy_version + 1
            if self.monitor is not None:
                try:
                    version = await self.monitor.set_policy.remote(policy.model_dump(mode="json"))
                except Exception as error:  # monitor restarting
                    self.loop.use_policy(policy, self.loop.policy_version)
                    raise APIError(503, f"the cluster monitor is unavailable ({type(error).__name__}): the policy "
                                        "applies to this router only for now; retry to reach every router",
                                   type_="server_error", code="monitor_unavailable") from None
            self.loop.use_policy(policy, version)
        except APIError as error:
            return error.response()
        return self._policy_state()

    def _policy_state(self) -> dict:
        return {"policy": self.loop.engine.policy.config.model_dump(mode="json"), "version": self.loop.policy_version}

    @api.get("/health")
    async def health(self):
        self._ensure_reporter()
        return {"status": "ok", **self._state()}

    def _state(self) -> dict:
        return {"cluster_pressure": self.cluster_pressure, **self.loop.state()}

    @api.get("/metrics")
    async def metrics(self, request: Request):
        try:
            self._authorize(request)
        except APIError as error:
            return error.response()
        return PlainTextResponse(self.metrics.render(self._state()), media_type="text/plain; version=0.0.4")
