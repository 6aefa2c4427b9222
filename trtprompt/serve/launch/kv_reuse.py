"""No silent loss of KV-cache reuse at serve time (issue 27).

A TensorRT-LLM 1.2 engine built without `use_paged_context_fmha` (or without a
paged KV cache) can neither reuse KV blocks nor chunk context. Served as is, it
used to lose both without a word (a plain `trtllm-build` directory got reuse
off in its derived runtime policy). Now `serve` and `inspect` print ONE warning
line naming the build flag and what is off (trtprompt.rules.reuse_loss_warning),
and `serve --require-kv-reuse` refuses such an engine with that message.
"""

from __future__ import annotations

from typing import Callable

from trtprompt import rules
from trtprompt.serve.launch.options import EngineInfo, ServeOptions

REFUSED_BY = "refused by --require-kv-reuse"


def engine_warning(engine: EngineInfo) -> str | None:
    """The one-line warning for an engine that cannot reuse KV blocks; None when it can."""
    if engine.target != "trtllm":  # the torch engine and the LLM API always can
        return None
    return rules.reuse_loss_warning(engine.build_config)


def warn_or_refuse(engine: EngineInfo, require: bool, echo: Callable[[str], None]) -> None:
    """Before the options are resolved: warn once, or refuse under --require-kv-reuse."""
    warning = engine_warning(engine)
    if warning is None:
        return
    if require:
        raise ValueError(f"{engine.path}: {warning}; {REFUSED_BY}")
    echo(f"warning: {engine.path.name}: {warning}")


def require_reuse_on(engine: EngineInfo, options: ServeOptions) -> None:
    """--require-kv-reuse also refuses reuse switched off by the engine's policy or a serve flag."""
    if not options.enable_kv_cache_reuse:
        raise ValueError(f"{engine.path}: KV-cache reuse is off (the engine's runtime policy or "
                         f"--disable-kv-cache-reuse); {REFUSED_BY}")
