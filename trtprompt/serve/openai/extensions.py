"""vLLM's and SGLang's extension fields of the OpenAI API that this server does not act on.

Routers re-send every field they know at its default value (sglang-router 0.3.2 adds
`no_stop_trim`, `ignore_eos`, `continue_final_message`, `skip_special_tokens`,
`separate_reasoning`, `stream_reasoning`, `return_hidden_states` and, on completions, `echo`
to each request), and benchmark clients send vLLM's. Each field here is, by its value:

- null, or a value in `same` (what this server does anyway): accepted, silently;
- any other value, when the field changes nothing here (`NOTE`): accepted, and the request
  logs one line naming such fields;
- any other value, when the answer would differ from what the client asked (`REFUSE`): 400
  naming the field, never ignored.

The extensions this server honours (top_k, min_p, min_tokens, repetition_penalty, ignore_eos,
stop_token_ids, cache_salt, skip_special_tokens, retention, use_beam_search, length_penalty,
early_stopping, SGLang's lora_path (lora.py) and trtprompt's own speculative_decoding; prompt_logprobs,
allowed_token_ids, bad_words, include_stop_str_in_output in answer_params.py; the structured-output fields, guided_* and
structured_outputs, SGLang's regex, ebnf and json_schema, in guided.py) are parsed in params.py. docs/openai.md,
"Extension fields", is the table of both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

from trtprompt.serve.openai.errors import bad_request

NOTE, REFUSE = "note", "refuse"
BOTH = ("completion", "chat")


@dataclass(frozen=True)
class Extension:
    name: str
    same: tuple[Any, ...]  # values that ask for this server's behaviour (null always does)
    action: str  # NOTE | REFUSE, for any other value
    why: str
    kinds: tuple[str, ...] = BOTH

    def __post_init__(self) -> None:
        if self.action not in (NOTE, REFUSE):
            raise ValueError(f"action must be {NOTE!r} or {REFUSE!r}, got {self.action!r}")

    def asks_nothing(self, value: Any) -> bool:
        """value is null, empty or one of `same` (by type too: false is not 0)."""
        if value is None or (isinstance(value, (list, dict, str)) and not value):
            return True
        return any(type(value) is type(s) and value == s for s in self.same)


def _e(name: str, same: tuple[Any, ...], action: str, why: str, kinds: tuple[str, ...] = BOTH) -> Extension:
    return Extension(name, same, action, why, kinds)


# chat_template_kwargs, include_reasoning and separate_reasoning are honoured (tools.py).
STREAMED_REASONING = "reasoning_content is always streamed as it is generated (--reasoning-parser)"
EXTENSIONS: tuple[Extension, ...] = (
    # vLLM and SGLang sampling and output controls
    _e("no_stop_trim", (False,), REFUSE, "a matched stop string is always trimmed from the output"),
    _e("spaces_between_special_tokens", (True,), NOTE,
       "the tokenizers library's decoder has no such option (vLLM's fast detokenizer ignores it too)"),
    _e("truncate_prompt_tokens", (), REFUSE, "prompts are fitted by the profile's overflow policy "
       "(docs/profiles.md)"),
    _e("return_tokens_as_token_ids", (False,), REFUSE, "log probabilities name their tokens as text"),
    _e("logits_processors", (), REFUSE, "no custom logits processors"),
    _e("custom_logit_processor", (), REFUSE, "no custom logits processors"),
    _e("custom_params", (), REFUSE, "no custom logits processors"),
    _e("vllm_xargs", (), REFUSE, "no custom extensions"),
    _e("kv_transfer_params", (), REFUSE, "no disaggregated prefill (KV transfer)"),
    _e("bootstrap_host", (), REFUSE, "no prefill/decode disaggregation"),
    _e("bootstrap_port", (), REFUSE, "no prefill/decode disaggregation"),
    _e("bootstrap_room", (), REFUSE, "no prefill/decode disaggregation"),
    _e("routed_dp_rank", (0,), REFUSE, "one data-parallel rank (0)"),
    _e("data_parallel_rank", (0,), REFUSE, "one data-parallel rank (0)"),
    _e("disagg_prefill_dp_rank", (0,), REFUSE, "no prefill/decode disaggregation"),
    _e("stop_regex", (), REFUSE, "stop strings only, no stop regexes"),
    _e("priority", (0,), REFUSE, "no priority scheduling (vLLM refuses it as well without one)"),
    _e("session_id", (), REFUSE, "no sessions"),
    _e("session_params", (), REFUSE, "no sessions"),
    _e("extra_key", (), REFUSE, "cache_salt is this server's key for keeping prefix caches apart"),
    _e("return_hidden_states", (False,), REFUSE, "no hidden states are returned"),
    _e("return_routed_experts", (False,), REFUSE, "no mixture-of-experts routing data is returned"),
    _e("routed_experts_start_len", (0,), NOTE, "only used with return_routed_experts"),
    _e("return_cached_tokens_details", (False,), REFUSE, "cached tokens come in usage.prompt_tokens_details only"),
    _e("return_token_ids", (False,), REFUSE, "the answer carries text, not token ids"),
    _e("return_prompt_token_ids", (False,), REFUSE, "the answer carries text, not token ids", ("chat",)),
    _e("return_meta_info", (False,), REFUSE, "no SGLang meta_info in answers", ("chat",)),
    _e("request_id", (), NOTE, "answers carry this server's own ids"),
    _e("rid", (), NOTE, "answers carry this server's own ids"),
    _e("custom_labels", (), NOTE, "this server's metrics have fixed labels"),
    _e("ngram_corpus_id", (), NOTE, "not taken: n-gram drafts come from the request's own tokens and from recent "
       "requests with the same cache_salt, which picks the pool here (docs/speculative-decoding.md); drafts never "
       "change the tokens"),
    _e("mm_processor_kwargs", (), NOTE, "text-only models: no multimodal processor"),
    _e("images_config", (), NOTE, "text-only models: no multimodal processor"),
    _e("max_dynamic_patch", (), NOTE, "text-only models: no multimodal processor", ("chat",)),
    _e("min_dynamic_patch", (), NOTE, "text-only models: no multimodal processor", ("chat",)),
    _e("use_audio_in_video", (False,), NOTE, "text-only models: no multimodal processor", ("chat",)),
    # prompts: how they are built
    _e("add_special_tokens", (True,), REFUSE, "completion prompts are encoded with the tokenizer's special "
       "tokens (BOS)", ("completion",)),
    _e("add_special_tokens", (False,), REFUSE, "the chat template writes the special tokens itself", ("chat",)),
    _e("prompt_embeds", (), REFUSE, "prompts are text or token ids", ("completion",)),
    _e("echo", (False,), REFUSE, "the last message is not prepended to the answer", ("chat",)),
    _e("add_generation_prompt", (True,), REFUSE, "the chat template always opens the assistant's turn", ("chat",)),
    _e("continue_final_message", (False,), REFUSE, "the chat template always opens a new assistant turn "
       "after the last message", ("chat",)),
    _e("chat_template", (), REFUSE, "the checkpoint's own chat template is used", ("chat",)),
    _e("documents", (), REFUSE, "the chat template is rendered without documents", ("chat",)),
    _e("input_ids", (), REFUSE, "send token ids as /v1/completions' prompt", ("chat",)),
    _e("task", (), REFUSE, "no DeepSeek task tokens", ("chat",)),
    _e("reasoning_effort", (), REFUSE, "not passed to the chat template", ("chat",)),
    _e("stream_reasoning", (True,), NOTE, STREAMED_REASONING, ("chat",)),
)


def names(kind: str) -> tuple[str, ...]:
    return tuple(e.name for e in EXTENSIONS if kind in e.kinds)


def check(kind: str, body: Mapping[str, Any]) -> tuple[str, ...]:
    """The notes for the fields of body that change nothing here; 400 naming a refused one."""
    notes = []
    for ext in EXTENSIONS:
        if kind not in ext.kinds or ext.name not in body or ext.asks_nothing(body[ext.name]):
            continue
        value = body[ext.name]
        if ext.action == REFUSE:
            raise bad_request(f"{ext.name}={_shown(value)} is not supported: {ext.why}", ext.name,
                              "unsupported_parameter")
        notes.append(f"{ext.name}={_shown(value)} ({ext.why})")
    return tuple(notes)


def _shown(value: Any, limit: int = 80) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "..."
