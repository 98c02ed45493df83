"""vLLM's own OpenAI layer in the router, over an engine client that routes.

The router answers `/v1/chat/completions`, `/v1/completions`, `/v1/models`, `/tokenize` and
`/detokenize` with vLLM's serving classes (`OpenAIServingChat`, `OpenAIServingCompletion`, ...),
built as `vllm serve` builds them, so every field, default, chat template, tool call, parser and
error vLLM has is the router's as well. What vLLM would hand its engine, the router hands
`RoutedEngineClient.generate` instead: the rendered prompt's exact token ids (what the policy
prices, with their prefix hashes) and the request's `SamplingParams`. It places the request, runs
the prefill and the KV handoff, fans `n` out, migrates a failed decode, and streams back vLLM's
own outputs, which the serving classes turn into the answer (`dispatcher` does the work).

The router renders once, without an engine: vLLM's render-only recipe (`vllm launch render`), a
`VllmConfig` of the model's config and tokenizer alone (`render_config`). The engines receive
token ids and never render.

Per HTTP request the route enters a `RequestContext` (the SLO class, TTFT limit, λ and the alias's choice)
before calling the serving class; `generate` reads it and records each `Flight` it starts there,
so the route can wait for the first token (a failure before it still gets its status code) and
name the route in the response headers.
"""

from __future__ import annotations

import asyncio
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from disagg.core.types import SloClass
from serve_app.flight import Flight

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from serve_app.config import AppConfig


@dataclass(slots=True)
class RequestContext:
    """What one HTTP request adds to vLLM's request: the router's own headers and choices."""

    slo: SloClass
    ttft_limit_s: float | None  # the alias route's; None: `slo_scale` sets it once the prompt is rendered
    lam: float
    chat: bool
    requested_model: str = ""  # the `model` the client named
    fields: frozenset[str] = frozenset()  # the request fields the client set
    alias: Any = None  # the alias route's pick (`dispatcher.AliasChoice`); None: the request named its model
    flights: list[Flight] = field(default_factory=list)  # one per prompt of the request, in order
    received: float | None = None  # monotonic time the router's handler got the request
    slo_scale: float | None = None  # X-SLO-Scale: targets this many times the request's own unloaded latency


_REQUEST: ContextVar[RequestContext | None] = ContextVar("disagg_request", default=None)


def entered(ctx: RequestContext) -> Any:
    """Make `ctx` the current request's (for `generate`); the token `left` takes."""
    return _REQUEST.set(ctx)


def left(token: Any) -> None:
    _REQUEST.reset(token)


def render_config(cfg: AppConfig) -> VllmConfig:
    """The `VllmConfig` the router renders with: the engines' own model settings (the same
    `AsyncEngineArgs`, so the same tokenizer, chat template and context window), without anything
    an engine needs (vLLM's render-only server does the same)."""
    from vllm import envs
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    from disagg.core.types import Role
    from serve_app.engine_args import engine_kwargs
    from serve_app.engine_server import engine_spec

    kwargs = engine_kwargs(engine_spec(cfg, Role.BOTH if cfg.is_colocated else Role.DECODE, "127.0.0.1", 1))
    kwargs.pop("kv_transfer_config")
    o = cfg.model.openai
    args = AsyncEngineArgs(**kwargs, served_model_name=[cfg.model.served_name],
                           reasoning_parser=o.reasoning_parser or "")
    model_config = args.create_model_config()
    model_config.quantization = None  # rendering runs no kernels
    envs.VLLM_CPU_KVCACHE_SPACE = 0  # ... and allocates no KV cache
    return VllmConfig(model_config=model_config, logging_config=args.create_logging_config(),
                      structured_outputs_config=args.create_structured_outputs_config())


class RoutedEngineClient:
    """What vLLM's serving classes call an engine client, for one served model: `generate`
    places and runs the request through the disaggregated engines (`start`, then `outputs`)."""

    def __init__(self, vllm_config: VllmConfig, renderer: Any, start: Callable[[Flight], Any],
                 outputs: Callable[[Flight], AsyncIterator], new_flight: Callable[..., Flight]) -> None:
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.renderer = renderer
        # vLLM's own, for what its serving layer asks of it (beam search's watermarking check); the
        # engines process each request's inputs themselves
        from vllm.v1.engine.input_processor import InputProcessor

        self.input_processor = InputProcessor(vllm_config, renderer)
        self._start, self._outputs, self._new_flight = start, outputs, new_flight

    errored = False
    is_running = True
    is_stopped = False
    dead_error = RuntimeError("no engine client error")  # never raised: `errored` is False

    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        """vLLM's queue limits: the router's admission control (`shed`) came before."""

    def generate(self, prompt: Any, sampling_params: Any, request_id: str, **_: Any) -> AsyncIterator:
        """Start the request now (so the route can wait for its first token) and return its outputs."""
        ctx = _REQUEST.get()
        if ctx is None:
            raise RuntimeError("generate outside a routed request")
        f = self._new_flight(ctx, request_id, prompt, sampling_params)
        ctx.flights.append(f)
        f.started = asyncio.get_running_loop().create_task(self._start(f))
        return self._outputs(f)

    async def abort(self, request_id: Any) -> None:
        """Cancelling the outputs' iterator aborts in the engines; nothing else is held here."""

    async def notify_kv_transfer_request_rejected(self, *_: Any, **__: Any) -> None:
        """Clients may not send KV-transfer parameters (refused by the route), so none is pending."""

    async def is_tracing_enabled(self) -> bool:
        return False


@dataclass(slots=True)
class ServingSurface:
    """vLLM's serving objects for one served model, as `vllm serve` builds them."""

    chat: Any  # OpenAIServingChat
    completion: Any  # OpenAIServingCompletion
    models: Any  # OpenAIServingModels
    tokenization: Any  # ServingTokenization
    tokenizer: Any  # the renderer's tokenizer (the router's token counts come from it)
    vllm_config: Any


def build_surface(cfg: AppConfig, start: Callable, outputs: Callable, new_flight: Callable) -> ServingSurface:
    """vLLM's serving classes for `cfg`'s model over a `RoutedEngineClient`; the parser options
    come from `model.openai` (the flags `vllm serve` takes)."""
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.entrypoints.serve.tokenize.serving import ServingTokenization
    from vllm.renderers import renderer_from_config
    from vllm.renderers.chat_utils import load_chat_template
    from vllm.renderers.online_renderer import OnlineRenderer

    vllm_config = render_config(cfg)
    renderer = renderer_from_config(vllm_config)
    client = RoutedEngineClient(vllm_config, renderer, start, outputs, new_flight)
    o = cfg.model.openai
    template = load_chat_template(o.chat_template)
    tools = {"enable_auto_tools": o.enable_auto_tool_choice, "tool_parser": o.tool_call_parser,
             "exclude_tools_when_tool_choice_none": o.exclude_tools_when_tool_choice_none,
             "tool_strict_level": o.tool_strict_level}
    template_kw = {"chat_template": template, "chat_template_content_format": o.chat_template_content_format,
                   "trust_request_chat_template": o.trust_request_chat_template,
                   "default_chat_template_kwargs": o.default_chat_template_kwargs}
    online = OnlineRenderer(model_config=vllm_config.model_config, renderer=renderer, request_logger=None,
                            trust_request_mm_kwargs=False, reasoning_parser=o.reasoning_parser or "",
                            log_error_stack=False, **template_kw, **tools)
    online.warmup()
    models = OpenAIServingModels(engine_client=client, base_model_paths=[
        BaseModelPath(name=cfg.model.served_name, model_path=vllm_config.model_config.model)])
    usage = {"enable_prompt_tokens_details": o.enable_prompt_tokens_details,
             "enable_force_include_usage": o.enable_force_include_usage,
             "return_tokens_as_token_ids": o.return_tokens_as_token_ids}
    chat = OpenAIServingChat(engine_client=client, models=models, response_role=o.response_role,
                             online_renderer=online, request_logger=None, reasoning_parser=o.reasoning_parser or "",
                             **template_kw, **tools, **usage)
    completion = OpenAIServingCompletion(client, models, online_renderer=online, request_logger=None, **usage)
    tokenization = ServingTokenization(models, online, request_logger=None, **template_kw)
    return ServingSurface(chat=chat, completion=completion, models=models, tokenization=tokenization,
                          tokenizer=renderer.tokenizer, vllm_config=vllm_config)
