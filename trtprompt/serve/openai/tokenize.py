"""vLLM's `/tokenize` and `/detokenize`, answered from the engine path's own prompt conversion.

vllm-router's `kv_aware` policy matches a request's prompt tokens against the workers' KV events
(serve/kv_events), so the ids answered here must be the very ids the engine would be given for the
same /v1/completions or /v1/chat/completions body. The body is therefore parsed by the same
`parse_request` (same model check, same refused options: `add_generation_prompt`,
`continue_final_message` and `add_special_tokens` take vLLM's defaults and only those) and fitted
by the same `EnginePath.inputs_for` (chat template, budget, chat window); no second rendering.

Through Triton (`--grpc-url`, no engine socket) the ensemble tokenizes, not this process: the
endpoints answer 501 there rather than ids that might differ.
"""

from __future__ import annotations

from typing import Any, Mapping

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from trtprompt.serve.openai.config import FrontendConfig
from trtprompt.serve.openai.errors import APIError, bad_request
from trtprompt.serve.openai.json_body import read_json
from trtprompt.serve.openai.params import ModelLimits, parse_request

# vLLM's own tokenize field with no counterpart in a generation request; only its default is served.
TOKEN_STRS = "return_token_strs"


def _engine_path(request: Request) -> Any:
    """The engine path (serve/openai/to_engine.EnginePath), which holds the tokenizer the engine's
    prompts are made with; 501 on the Triton path."""
    cfg: FrontendConfig = request.app.state.cfg
    if cfg.engine_socket is None:
        raise APIError(501, "tokenize and detokenize need the engine path (the torch target's fused layout): "
                       "through Triton the ensemble tokenizes", "invalid_request_error", None, "unsupported")
    return request.app.state.source


def _body(raw: Any) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise bad_request("the request body must be a JSON object", None, "invalid_json")
    return dict(raw)


def _token_strs(body: dict[str, Any]) -> None:
    """Drop `return_token_strs` (null or false); true is refused, naming it."""
    value = body.pop(TOKEN_STRS, None)
    if value not in (None, False):
        raise bad_request(f"{TOKEN_STRS}={value!r} is not supported: only token ids are returned", TOKEN_STRS,
                          "unsupported_parameter")


def _kind(body: Mapping[str, Any]) -> str:
    """'chat' for a body with messages, 'completion' for one with a prompt (exactly one of the two)."""
    has_prompt, has_messages = "prompt" in body, "messages" in body
    if has_prompt == has_messages:
        raise bad_request("give exactly one of 'prompt' (a string) and 'messages' (a chat)",
                          "messages" if has_messages else "prompt")
    if has_prompt and not isinstance(body["prompt"], str):
        raise bad_request("'prompt' must be a string", "prompt")
    return "chat" if has_messages else "completion"


def _with_model(body: dict[str, Any], limits: ModelLimits) -> dict[str, Any]:
    """vLLM's `model` is optional here: absent or null means the served model; any other is checked
    as /v1/completions checks it."""
    if body.get("model") is None:
        body["model"] = limits.name
    return body


async def tokenize(request: Request) -> Response:
    cfg: FrontendConfig = request.app.state.cfg
    body = _body(await read_json(request))
    source = _engine_path(request)
    _token_strs(body)
    kind = _kind(body)
    gen = parse_request(kind, _with_model(body, cfg.limits), cfg.limits)
    (prompt,) = gen.inputs  # one string prompt, or the chat
    inputs = await source.inputs_for(gen, prompt)
    ids = [int(i) for i in inputs.request.prompt_token_ids]
    return JSONResponse({"count": len(ids), "max_model_len": cfg.limits.max_model_len, "tokens": ids})


def _tokens(body: Mapping[str, Any], vocab_size: int | None) -> list[int]:
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise bad_request("'tokens' is required: a list of token ids", "tokens")
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
            raise bad_request(f"tokens[{i}] is not a token id of this model (0 <= id < {vocab_size})", "tokens")
    return tokens


async def detokenize(request: Request) -> Response:
    """The text of `tokens`, special tokens included (vLLM's answer: a round trip of /tokenize)."""
    cfg: FrontendConfig = request.app.state.cfg
    body = _body(await read_json(request))
    source = _engine_path(request)
    unknown = sorted(set(body) - {"model", "tokens"})
    if unknown:
        raise bad_request(f"unrecognized request argument(s): {', '.join(unknown)}", unknown[0],
                          "unrecognized_argument")
    model = _with_model(body, cfg.limits)["model"]
    if not isinstance(model, str) or not cfg.limits.serves(model):
        raise APIError(404, f"the model {str(model)[:200]!r} does not exist; this server serves "
                       f"{cfg.limits.name!r}", "invalid_request_error", "model", "model_not_found")
    tokens = _tokens(body, cfg.limits.vocab_size)
    return JSONResponse({"prompt": source.tokenizer.decode(tokens, skip_special_tokens=False)})
