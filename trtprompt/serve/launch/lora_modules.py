"""`trtprompt serve --lora-modules NAME=DIR`: the PEFT adapters the engine process loads when it starts
(docs/lora.md, "From a PEFT training run to a served adapter").

vLLM's flag, in both of its spellings: `NAME=DIR`, or a JSON object `{"name": ..., "path": ...}`. Each
adapter is read and checked against the engine here, before anything starts, so a bad one fails `serve` with
the adapter's own message (its name and what is wrong) instead of an engine process that dies at load and is
restarted in a loop. The engine process gets them as one JSON-valued parameter of the `tensorrt_llm` model,
`lora_modules` ({name: absolute directory}), beside max_loras and max_cpu_loras (lora_parameters).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from trtprompt.serve.wire.lora_modules import PARAMETER, encode_lora_modules

if TYPE_CHECKING:
    from trtprompt.engine.engine_dir import EngineDir
    from trtprompt.serve.launch.options import ServeOptions

FLAG = "--lora-modules"
LoraModules = tuple[tuple[str, str], ...]  # (name, absolute directory), in the order given


def _one(text: str) -> tuple[str, str]:
    """(name, directory) of one --lora-modules value."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"{FLAG} {text!r}: not a JSON object ({exc})") from None
        name, path = spec.get("name"), spec.get("path")
    else:
        name, _, path = text.partition("=")
    if not isinstance(name, str) or not name.strip() or not isinstance(path, str) or not path.strip():
        raise ValueError(f"{FLAG} {text!r}: expected NAME=DIR (or {{\"name\": ..., \"path\": ...}}) with both "
                         "non-empty")
    return name.strip(), str(Path(path.strip()).expanduser().resolve())


def parse_lora_modules(values: Iterable[str]) -> LoraModules:
    """The --lora-modules values as (name, absolute directory); a name given twice is refused."""
    out: dict[str, str] = {}
    for text in values:
        name, path = _one(text)
        if name in out:
            raise ValueError(f"{FLAG}: adapter name {name!r} is given twice ({out[name]} and {path})")
        out[name] = path
    return tuple(out.items())


def check_lora_modules(engine: EngineDir, modules: LoraModules) -> None:
    """Read each adapter as the engine process will and check it against the engine (shapes, modules,
    rank); ValueError with the adapter's own message. Only the torch engine loads adapters by name."""
    if not modules:
        return
    if engine.target != "torch":
        raise ValueError(f"{FLAG} loads adapters into the torch target's engine; this engine is for the "
                         f"{engine.target} target (TensorRT-LLM takes adapters per request as lora_weights / "
                         "lora_config with a lora_task_id, or at build: trtprompt build --lora-dir NAME=DIR)")
    from trtprompt.engine.lora.adapter import read_peft_dir
    from trtprompt.engine.lora.config import LoraConfig

    rank = LoraConfig.from_knobs({}, engine.build_config).max_lora_rank
    for name, path in modules:
        try:
            read_peft_dir(name, path, engine.model_config(), rank)
        except OSError as exc:  # LoraError (a ValueError) passes through with its own message
            raise ValueError(f"{FLAG} adapter {name!r}: {path} cannot be read ({exc})") from None


def lora_parameters(o: ServeOptions) -> dict[str, object]:
    """The tensorrt_llm model's LoRA parameters, read by the engine process (engine_overrides): the
    adapters to load (left out when there are none) and how many it holds."""
    return {"max_loras": o.max_loras, "max_cpu_loras": o.max_cpu_loras,
            PARAMETER: encode_lora_modules(dict(o.lora_modules))}
