"""One inference request, start to end:

    authenticate ─▶ parse body ─▶ parse model ─▶ resolve adapter (tenant-scoped) ─▶ template + tokenize
        ─▶ max_tokens ─▶ quota acquire (prompt + candidates * reservation) ─▶ router.stream(adapter) ─▶ chunks
        ─▶ finally: quota finish (refund unused tokens or charge the excess, release lease) + usage event + metrics

The reservation per candidate is ``max_tokens`` when the request sets it, else
``min(DEFAULT_MAX_TOKENS_RESERVATION, context left)``: a default client under a small tokens/minute quota is not
refused for the whole context it will almost never use. The engine still may generate up to the context left;
tokens used past the reservation are charged at the end (the tenant's bucket runs ahead, later requests wait).

``Generation.chunks()`` yields engine chunks; its ``finally`` does the accounting exactly once whatever ends the
stream (last chunk, engine error, client gone: the consumer closes the iterator, which closes the router's
stream and so aborts the engine request and frees its KV blocks). The accounting is shielded from cancellation.
A whole (non-streamed) request holds its chunks back until the engine's last one, so when its replica dies
mid-generation it runs once more on another replica (``WHOLE_RETRIES``), unseen by the client; a stream that has
sent tokens is not retried (the router alone fails over, before the first chunk).
Metrics go through a ``RequestMeter`` (``metering.py``): the route reports refusals before admission, ``admit``
reports quota denials, and ``Generation``'s cleanup reports every admitted request with its final status.

A completions request with several prompts runs one engine request per prompt (ids ``<request id>-<prompt index>``),
all at once (``fan_in.py``); ``Generation`` sums their token counts, and its chunks (of every prompt, as they come)
are told apart by ``Prepared.prompt_index``. A whole request of several prompts retries each prompt on its own.

An output constraint (``response_format``, ``guided_*``) is compiled without a tokenizer before admission (off the
event loop), so a schema that cannot compile is a 400 naming the feature and the field before anything is queued.

Engine errors reach tenants sanitised (``engine_errors.py``): adapter load and fetch failures and 5xx as a generic
message with the request id, 4xx with blob URIs, endpoints, paths and addresses removed; the full message goes to
the platform log under that request id.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import anyio
from starlette.concurrency import run_in_threadpool

from loraplex.platform.engines.errors import AdapterLoadFailedError, EngineError, EngineUnavailableError
from loraplex.platform.engines.limits import unservable_reason
from loraplex.platform.engines.messages import AdapterReference, EngineChunk, EngineRequest
from loraplex.platform.gateway import fan_in
from loraplex.platform.gateway.adapters import ResolvedAdapter, resolve_adapter, version_is_ready
from loraplex.platform.gateway.auth import TenantInfo
from loraplex.platform.gateway.engine_errors import for_tenant, no_engine_error
from loraplex.platform.gateway.metering import CLIENT_CLOSED, RequestMeter
from loraplex.platform.gateway.state import Gateway
from loraplex.platform.inference.chat_template import ChatTemplateError
from loraplex.platform.inference.errors import InferenceError, model_not_found
from loraplex.platform.inference.model_name import ModelNameError, parse_model
from loraplex.platform.inference.plan import ChoicePlan
from loraplex.platform.inference.protocol import (ChatCompletionRequest, CompletionRequest, new_id, parse_request,
                                                  resolve_max_tokens)
from loraplex.platform.inference.structured_request import check_compiles
from loraplex.platform.quotas import QuotaDecision, QuotaLimits
from loraplex.platform.routing import NoReplicaAvailableError
from loraplex.platform.usage import UsageEvent

logger = logging.getLogger(__name__)

WHOLE_RETRIES = 1  # a whole (non-streamed) request whose replica died mid-generation runs again this many times


def _unauthorized() -> InferenceError:
    return InferenceError(401, "Incorrect or missing API key; send it as 'Authorization: Bearer <key>'.",
                          code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


async def authenticate(gw: Gateway, authorization: str | None) -> TenantInfo:
    """The tenant of the bearer key (401 unknown/revoked key, 403 disabled tenant)."""
    scheme, _, key = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise _unauthorized()
    key = key.strip()
    hit, tenant = gw.auth.cached(key)
    if not hit:
        tenant = await run_in_threadpool(gw.auth.lookup, key)
    if tenant is None:
        raise _unauthorized()
    if tenant.disabled:
        raise InferenceError(403, "This tenant is disabled; contact the operator.", code="tenant_disabled")
    return tenant


@dataclass
class Prepared:
    """A validated request, ready for admission."""

    kind: str                                  # "chat" | "completion"
    request_id: str
    tenant: TenantInfo
    body: ChatCompletionRequest | CompletionRequest
    prompt: str | list[int]                    # the first (usually only) prompt
    prompt_tokens: int                         # of every prompt
    max_tokens: int                            # the engine's completion budget per choice
    sampling: dict[str, Any]
    adapter: ResolvedAdapter | None
    reference: AdapterReference | None
    plan: ChoicePlan
    echo_text: str = ""                        # completions with echo: the prompt as text
    reserve_tokens: int | None = None          # per choice reserved against quotas (None: max_tokens)
    prompts: list[str | list[int]] = field(default_factory=list)   # completions: every prompt (empty: [prompt])
    echo_texts: list[str] = field(default_factory=list)            # echo: every prompt as text

    def __post_init__(self) -> None:
        self.prompts = self.prompts or [self.prompt]
        self.echo_texts = self.echo_texts or [self.echo_text] * len(self.prompts)

    @property
    def num_prompts(self) -> int:
        return len(self.prompts)

    @property
    def candidates(self) -> int:
        """Sequences billed and reserved for: every prompt's choices and best_of candidates."""
        return self.num_prompts * self.plan.candidates

    def engine_request_id(self, prompt_index: int) -> str:
        return self.request_id if self.num_prompts == 1 else f"{self.request_id}-{prompt_index}"

    def prompt_index(self, engine_request_id: str) -> int:
        """The prompt an engine chunk belongs to."""
        if self.num_prompts == 1:
            return 0
        return int(engine_request_id.rsplit("-", 1)[1])

    @property
    def reserved_tokens(self) -> int:
        """What quota acquire reserves: the prompts once, the reservation for every choice and best_of candidate."""
        per_choice = self.max_tokens if self.reserve_tokens is None else self.reserve_tokens
        return self.prompt_tokens + self.candidates * per_choice


async def prepare(gw: Gateway, tenant: TenantInfo, data: Any, kind: str) -> Prepared:
    """Parse, resolve and tokenize; every problem is an ``InferenceError`` (400 / 404)."""
    body = parse_request(ChatCompletionRequest if kind == "chat" else CompletionRequest, data)
    try:
        target = parse_model(body.model, base_names=gw.base_names)
    except ModelNameError:
        raise model_not_found(body.model) from None
    adapter = None
    if not target.base:
        adapter = await run_in_threadpool(_resolve, gw, tenant.id, target)
        if adapter is None:
            raise model_not_found(body.model)
        reason = unservable_reason(gw.serving_limits, rank=adapter.rank, targets=adapter.targets)
        if reason is not None:   # stored under other limits: no engine loads it (GET /v1/models marks it)
            raise InferenceError(400, f"the model `{body.model}` cannot be served by this deployment: {reason}",
                                 param="model", code="adapter_not_servable")
    # templates and tokenization are CPU work that grows with the prompt (seconds for a few MB): off the event loop
    prompts, lengths = await run_in_threadpool(_tokenize, gw, body, kind)
    prompt = prompts[0]
    n_prompt = lengths[0] if kind == "chat" else sum(lengths)
    requested = body.requested_max_tokens if kind == "chat" else body.max_tokens
    if min(lengths) == 0:
        where = "" if len(lengths) == 1 else f" (prompt {lengths.index(0)})"
        raise InferenceError(400, f"the prompt is empty{where}; send at least one token", param="prompt")
    max_tokens = resolve_max_tokens(requested, max(lengths), gw.max_model_len)
    reserve = max_tokens if requested is not None else min(gw.settings.default_max_tokens_reservation, max_tokens)
    sampling = body.sampling_params(max_tokens)
    structured = body.structured
    if structured is not None:
        if kind == "chat" and gw.tokenizer.harmony is not None:
            raise InferenceError(400, f"'{structured.param}' is not supported on harmony-format models (GPT-OSS) yet: "
                                      "the grammar would also constrain the reasoning channel; leave it unset, or "
                                      "use /v1/completions", param=structured.param, code="unsupported_parameter")
        await run_in_threadpool(check_compiles, structured)
    if kind == "chat":
        added = gw.tokenizer.chat_sampling(body)   # GPT-OSS: harmony's stop tokens; forced tool calls' grammar
        if "structured" in added and "structured" in sampling:
            raise InferenceError(400, f"'tool_choice' {json.dumps(body.tool_choice)} makes the output tool calls, "
                                      f"which '{structured.param}' cannot constrain as well; send one of them",
                                 param="tool_choice", code="invalid_value")
        sampling.update(added)
    plan = body.choice_plan()
    limit = gw.settings.engine_max_num_seqs   # None: the engines refuse what they cannot run (400 as well)
    if limit is not None and plan.engine_n > limit:
        param = "best_of" if plan.pick_best else "n"
        raise InferenceError(400, f"'{param}' asks for {plan.engine_n} sequences but engines run at most {limit} per "
                                  f"request; lower '{param}'", param=param)
    echo_texts = [_prompt_text(gw, raw) for raw in body.prompts()] if plan.echo else []
    reference = None
    if adapter is not None:
        reference = await run_in_threadpool(gw.references.reference, adapter)
    return Prepared(kind=kind, request_id=new_id("chatcmpl" if kind == "chat" else "cmpl"), tenant=tenant,
                    body=body, prompt=prompt, prompt_tokens=n_prompt, max_tokens=max_tokens, sampling=sampling,
                    adapter=adapter, reference=reference, plan=plan, echo_text=echo_texts[0] if echo_texts else "",
                    reserve_tokens=reserve, prompts=prompts, echo_texts=echo_texts)


def _tokenize(gw: Gateway, body: ChatCompletionRequest | CompletionRequest,
              kind: str) -> tuple[list[str | list[int]], list[int]]:
    """(what the engine gets, prompt token count) of every prompt of ``body``: the chat template (harmony for
    GPT-OSS) for chat, each prompt tokenized for completions. Run it in a worker thread."""
    if kind == "chat":
        try:   # the model's chat template; harmony for GPT-OSS
            prompt, n_prompt = gw.tokenizer.chat_prompt(body)
        except ChatTemplateError as e:
            raise InferenceError(400, str(e), param="messages") from None
        return [prompt], [n_prompt]
    prompts, lengths = [], []
    for raw in body.prompts():
        if isinstance(raw, list):
            prompts.append(raw)
            lengths.append(len(raw))
        else:
            ids, n = gw.tokenizer.prompt(raw, add_special_tokens=True)
            prompts.append(ids)
            lengths.append(n)
    return prompts, lengths


def _prompt_text(gw: Gateway, raw: str | list[int]) -> str:
    """The prompt as ``echo`` returns it: the text sent, or the token ids decoded."""
    if isinstance(raw, str):
        return raw
    if not gw.tokenizer.available:
        raise InferenceError(400, "'echo' of a token-id prompt needs the base model's tokenizer, which this "
                                  "deployment lacks; send the prompt as text", param="echo")
    return gw.tokenizer.decode(raw)


def _resolve(gw: Gateway, tenant_id: str, target) -> ResolvedAdapter | None:
    with gw.sessions() as session:
        return resolve_adapter(session=session, tenant_id=tenant_id, target=target)


async def admit(gw: Gateway, prep: Prepared, meter: RequestMeter | None = None) -> QuotaDecision:
    """Quota check; a denial is an ``InferenceError`` (429 / 400 / 503) carrying the rate-limit headers (and is
    counted by ``meter`` as a quota rejection of its kind)."""
    if meter is not None and prep.adapter is not None:
        meter.resolved(prep.adapter.name, prep.adapter.number)   # the version label of every admitted-or-not request
    limits = QuotaLimits.resolve(prep.tenant, gw.settings)
    decision = await gw.quotas.acquire(prep.tenant.id, limits, tokens=prep.reserved_tokens,
                                       request_id=prep.request_id)
    if not decision.allowed:
        if meter is not None:
            meter.quota_rejected(decision.reason or "unknown")
        code = {"store_unavailable": "quota_store_unavailable", "request_too_large": "request_too_large"}.get(
            decision.reason or "", "rate_limit_exceeded")
        message, param = decision.message, None
        if decision.reason == "request_too_large":
            plan = prep.plan
            param = "max_tokens" if plan.candidates == 1 else "best_of" if plan.candidates > plan.n else "n"
            if prep.num_prompts > 1:
                message = (f"{prep.num_prompts} prompts ({prep.prompt_tokens} tokens) + {prep.candidates} sequences "
                           f"x max_tokens ({prep.reserve_tokens}) = {prep.reserved_tokens} tokens exceed the "
                           f"tenant's tokens-per-minute burst; send fewer prompts or lower max_tokens")
                param = "prompt"
            elif plan.candidates > 1:
                message = (f"prompt ({prep.prompt_tokens}) + {param} ({plan.candidates}) x max_tokens "
                           f"({prep.reserve_tokens}) = {prep.reserved_tokens} tokens exceed the tenant's "
                           f"tokens-per-minute burst; lower '{param}' or max_tokens")
        raise InferenceError(decision.status_code, message, code=code, param=param, headers=decision.headers())
    return decision


class Generation:
    """The engine side of one admitted request. Iterate ``chunks()`` once; close it to abort. ``meter`` gets the
    request's final status, tokens and latencies in the cleanup."""

    def __init__(self, gw: Gateway, prep: Prepared, decision: QuotaDecision,
                 meter: RequestMeter | None = None) -> None:
        self.gw, self.prep, self.decision = gw, prep, decision
        self.meter = meter
        self._counts: dict[str, tuple[int, int, int]] = {}   # engine request id -> prompt, completion, cached tokens
        self.finish_reasons: dict[str, str | None] = {}      # engine request id -> its finish reason, once ended
        self.started = False
        self.retries = 0                 # runs again after a replica died (<= WHOLE_RETRIES per engine request)
        self._renewed = 0.0              # when the quota lease was last renewed

    @property
    def prompt_tokens(self) -> int:
        """As the engines counted, over every prompt (0 until the first chunk)."""
        return sum(c[0] for c in self._counts.values())

    @property
    def completion_tokens(self) -> int:
        """Billed completion tokens (every choice and candidate), over every prompt."""
        return sum(c[1] for c in self._counts.values())

    @property
    def cached_tokens(self) -> int:
        return sum(c[2] for c in self._counts.values())

    @property
    def finish_reason(self) -> str | None:
        """None until every prompt's engine request ended; then the last one's reason."""
        if len(self.finish_reasons) < self.prep.num_prompts:
            return None
        return list(self.finish_reasons.values())[-1]

    async def chunks(self) -> AsyncIterator[EngineChunk]:
        gw, prep = self.gw, self.prep
        if gw.router is None:
            await self._finish(503, "engine_unavailable")
            raise no_engine_error(prep.request_id, gw.engine_error or "LORAPLEX_ENGINE_MODE=none")
        weight = QuotaLimits.scheduling_weight(prep.tenant, gw.settings)
        requests = [EngineRequest(request_id=prep.engine_request_id(i), tenant_id=prep.tenant.id, prompt=prompt,
                                  sampling=prep.sampling, adapter=prep.reference, tenant_weight=weight)
                    for i, prompt in enumerate(prep.prompts)]
        self._renewed = time.monotonic()
        status, error = 200, None
        try:
            if prep.body.stream:
                attempt = (self._attempt(requests[0]) if len(requests) == 1
                           else fan_in.merge([self._attempt(r) for r in requests]))
                try:
                    async for chunk in attempt:
                        yield chunk
                finally:
                    with anyio.CancelScope(shield=True):
                        await attempt.aclose()   # aborts the engine request if it is still running
            else:
                for chunk in await self._whole_all(requests):
                    yield chunk
        except NoReplicaAvailableError as e:
            status, error = 503, "engine_unavailable"
            retry = max(1, int(e.retry_after_s or 1))
            raise InferenceError(503, f"No engine replica is available right now; retry shortly (request id "
                                      f"{prep.request_id}).", code="engine_unavailable",
                                 headers={"retry-after": str(retry), "x-request-id": prep.request_id}) from None
        except AdapterLoadFailedError as e:
            if self.prep.adapter is not None and not await run_in_threadpool(self._still_ready):
                # resolved, then deleted before the engine fetched it: the model is gone, not broken
                status, error = 404, "model_not_found"
                raise model_not_found(self.prep.body.model) from None
            status, error = e.status_code, e.type_
            raise for_tenant(e, prep) from None
        except EngineError as e:
            status, error = e.status_code, e.type_
            raise for_tenant(e, prep) from None
        except BaseException as e:
            if self.finish_reason is None:  # the consumer left before the end (GeneratorExit, cancel), or a bug
                gone = isinstance(e, (GeneratorExit, anyio.get_cancelled_exc_class()))
                status, error = (CLIENT_CLOSED, "client_closed") if gone else (500, "internal_error")
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await self._finish(status, error)

    async def _whole_all(self, requests: list[EngineRequest]) -> list[EngineChunk]:
        """``_whole`` of every prompt's request, run at once; their chunks in prompt order."""
        if len(requests) == 1:
            return await self._whole(requests[0])
        held = await fan_in.gather([self._whole(r) for r in requests])
        return [chunk for chunks in held for chunk in chunks]

    async def _whole(self, request: EngineRequest) -> list[EngineChunk]:
        """Every chunk of a whole (non-streamed) request, held back until the engine's last one. Nothing has reached
        the client yet, so when the replica dies mid-generation (``EngineUnavailableError``: connection reset, stream
        cut before its last chunk, engine gone; the router marks it down) the request runs again from the start on
        another replica, ``WHOLE_RETRIES`` times at most. Only the last run's tokens are counted; the quota lease
        is held throughout. Engine-side refusals (4xx), adapter errors and client disconnects are never retried."""
        failed: list[str] = []      # replicas this request died on
        retries = 0                 # of this engine request (each prompt of a list has its own)
        while True:
            used: list[str] = []
            held: list[EngineChunk] = []
            attempt = self._attempt(request, exclude=failed, used=used)
            try:
                async for chunk in attempt:
                    held.append(chunk)
                return held
            except EngineUnavailableError as e:
                if retries >= WHOLE_RETRIES:
                    raise
                retries += 1
                self.retries += 1
                failed.extend(used)
                logger.warning("request %s: replica %s died after %d engine chunks (%s); retrying the whole request "
                               "on another replica (retry %d of %d)", request.request_id,
                               used[-1] if used else "?", len(held), e, retries, WHOLE_RETRIES)
                self._reset(request.request_id)
            finally:
                with anyio.CancelScope(shield=True):
                    await attempt.aclose()

    async def _attempt(self, request: EngineRequest, exclude: list[str] | None = None,
                       used: list[str] | None = None) -> AsyncIterator[EngineChunk]:
        """Engine chunks of one run of ``request`` (the router fails over while no chunk came yet), counted as they
        come; the lease is renewed every third of its TTL. ``used`` gets the ids of the replicas tried (the last
        one ran it); ``exclude``: replicas not to try. Closing it closes the router's stream (engine abort)."""
        gw, prep = self.gw, self.prep

        def open_stream(replica):
            if used is not None:
                used.append(replica.replica_id)
            return replica.client.generate(request)

        stream = gw.router.stream(prep.reference.adapter_id if prep.reference else None, open_stream,
                                  exclude=exclude or ())
        lease_renew_s = (self.decision.limits.lease_ttl_s / 3) if self.decision.lease_id else None
        try:
            async for chunk in stream:
                self.started = True
                if chunk.completion_tokens and self.meter is not None:
                    self.meter.first_token()
                self._counts[request.request_id] = (chunk.prompt_tokens,
                                                    chunk.completion_tokens * prep.plan.bill_factor,
                                                    chunk.cached_tokens)
                if chunk.finished:
                    self.finish_reasons[request.request_id] = chunk.finish_reason
                yield chunk
                if lease_renew_s and time.monotonic() - self._renewed > lease_renew_s:
                    self._renewed = time.monotonic()
                    await gw.quotas.renew(self.decision)
        finally:
            with anyio.CancelScope(shield=True):
                await stream.aclose()   # aborts the engine request if it is still running

    def _reset(self, request_id: str) -> None:
        """Forget a run of ``request_id`` that died: the next one is counted (tokens, first token) from zero."""
        self._counts.pop(request_id, None)
        self.finish_reasons.pop(request_id, None)
        if not self._counts:
            self.started = False
            if self.meter is not None:
                self.meter.first_token_at = None

    def _still_ready(self) -> bool:
        with self.gw.sessions() as session:
            return version_is_ready(session=session, version_id=self.prep.adapter.version_id)

    async def _finish(self, status: int, error: str | None) -> None:
        """Refund the unused reservation, release the lease, record usage and metrics (once)."""
        used = self.prompt_tokens + self.completion_tokens if self.started else 0
        try:
            await self.gw.quotas.finish(self.decision, used_tokens=used)
        except Exception:  # noqa: BLE001 - accounting must not turn a served request into an error
            logger.exception("quota finish failed for %s", self.prep.request_id)
        if self.started:
            a = self.prep.adapter
            self.gw.usage.record(UsageEvent(
                tenant_id=self.prep.tenant.id, request_id=self.prep.request_id, model=self.prep.body.model,
                prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                adapter_name=a.name if a else None, adapter_version_id=a.version_id if a else None))
        if self.meter is not None:
            self.meter.finish(status, prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                              error=error, sequences=self.prep.candidates)
