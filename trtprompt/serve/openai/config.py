"""What one OpenAI front end serves and where it finds Triton."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from trtprompt.engine.engine_dir import load_engine_config
from trtprompt.serve.openai.params import ModelLimits
from trtprompt.serve.openai.parser_options import served_parsers
from trtprompt.tokenizer import read_chat_template

API_KEY_ENV = "TRTPROMPT_API_KEY"


def source_model(root: Path) -> str | None:
    """The model's own name the build recorded (trtprompt.json source.model), if any."""
    try:
        meta = json.loads((root / "trtprompt.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):  # a plain TensorRT-LLM engine has no trtprompt.json
        return None
    source = meta.get("source") if isinstance(meta, dict) else None
    model = source.get("model") if isinstance(source, dict) else None
    return model if isinstance(model, str) and model else None


def chat_template_of(root: Path, tokenizer_dir: str | None) -> str | None:
    """The served checkpoint's chat template (the parsers' "auto" reads it): --tokenizer-dir's, else the
    engine's tokenizer/, else the files beside a trtllm-build engine; None where there is none."""
    folder = Path(tokenizer_dir) if tokenizer_dir else root / "tokenizer" if (root / "tokenizer").is_dir() else root
    try:
        return read_chat_template(folder)
    except (OSError, ValueError):  # unreadable: the engine path reports the tokenizer's own problem
        return None


@dataclass(frozen=True)
class FrontendConfig:
    grpc_url: str  # tritonserver's gRPC address, host:port
    limits: ModelLimits
    tokens_per_block: int | None  # cached_tokens = reused blocks x this
    api_key: str | None = None  # None: no authentication
    triton_model: str = "ensemble"
    # Set: requests go straight to this engine process (serve/openai/to_engine.py), not through Triton.
    engine_socket: str | None = None
    engine_dir: str = ""
    tokenizer_dir: str | None = None

    def __post_init__(self) -> None:
        if not self.grpc_url or ":" not in self.grpc_url:
            raise ValueError(f"grpc_url must be host:port, got {self.grpc_url!r}")
        if self.limits.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.limits.max_model_len}")
        if self.tokens_per_block is not None and self.tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be >= 1, got {self.tokens_per_block}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty (leave it unset for no authentication)")
        if self.engine_socket is not None and not self.engine_dir:
            raise ValueError("engine_dir is required with engine_socket")

    @classmethod
    def for_engine(cls, engine_dir: str | Path, grpc_url: str, api_key: str | None = None,
                   name: str | None = None, engine_socket: str | None = None,
                   tokenizer_dir: str | None = None, tool_call_parser: str = "auto",
                   reasoning_parser: str = "auto") -> "FrontendConfig":
        """The served model's id, max_model_len, vocabulary and block size, and its tool-call and reasoning
        parsers (serve/openai/tools.py served_parsers: "auto" reads the chat template), read once.

        The id is `name`, else the model's own name as the build recorded it (trtprompt.json's
        source.model, what routers such as sglang-router read from /v1/models or /server_info),
        else the engine directory's name; the directory's name stays accepted in requests."""
        root = Path(engine_dir).resolve()
        config = load_engine_config(root)  # config.json only: no tokenizer needed here
        build = config["build_config"]
        tpb = (build.get("plugin_config") or {}).get("tokens_per_block", build.get("tokens_per_block"))
        vocab = config["pretrained_config"].get("vocab_size")
        model_id = name or source_model(root) or root.name
        parsers = served_parsers(tool_call_parser, reasoning_parser, chat_template_of(root, tokenizer_dir))
        limits = ModelLimits(model_id, int(build["max_seq_len"]), int(vocab) if vocab is not None else None,
                             tuple(n for n in (root.name,) if n != model_id), parsers)
        return cls(grpc_url, limits, int(tpb) if tpb is not None else None, api_key,
                   engine_socket=engine_socket, engine_dir=str(root), tokenizer_dir=tokenizer_dir)
