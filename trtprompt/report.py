"""Human-readable tables for `build --dry-run` / `build` and `inspect`."""

from __future__ import annotations

import os
from typing import Any, Iterable, Mapping

from trtprompt import rules
from trtprompt.checkpoint import Checkpoint
from trtprompt.engine.engine_dir import EngineDir
from trtprompt.engine.kv_events import KV_EVENT_KNOBS
from trtprompt.engine.tiers.config import TIER_KNOBS
from trtprompt.knobs import KNOBS
from trtprompt.lora_build import LoraPlan, engine_adapters, inspect_rows
from trtprompt.plan import BuildPlan
from trtprompt.profile import Profile
from trtprompt.serve.launch.cpu_sets import numa_nodes
from trtprompt.targets.kv_offload import inspect_rows as offload_rows

MEMORY_UNITS: tuple[tuple[str, int], ...] = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in MEMORY_UNITS:
        if n >= size:
            return f"{n / size:.2f} {unit} ({n:,} B)"
    return f"{n} B"


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str) and (not value.strip() or "\n" in value):
        return repr(value)
    return str(value)


def _table(title: str, rows: Iterable[tuple[str, Any]]) -> list[str]:
    rows = list(rows)
    if not rows:  # e.g. the prompt policy of an engine trtllm-build wrote
        return [title, "  none recorded: the defaults apply"]
    width = max(len(k) for k, _ in rows)
    return [title] + [f"  {k.ljust(width)}  {_fmt(v)}" for k, v in rows]


def _model_rows(pc: Mapping[str, Any]) -> list[tuple[str, Any]]:
    keys = ("architecture", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_size", "max_position_embeddings", "rotary_scaling",
            "tie_word_embeddings")
    return [(k, pc.get(k)) for k in keys]


def _bounds_rows(bounds: Mapping[str, Any], runtime_max_input_len: Any) -> list[tuple[str, Any]]:
    return [*bounds.items(), ("runtime max input len", runtime_max_input_len)]


def _memory_rows(mem: Mapping[str, Any]) -> list[tuple[str, Any]]:
    return [
        ("weights", human_bytes(mem["weight_bytes"])),
        ("KV bytes per token", mem["kv_bytes_per_token"]),
        ("bytes per block", mem["bytes_per_block"]),
        ("KV budget", f"{human_bytes(mem['kv_budget_bytes'])} from {mem['kv_budget_source']}"),
        ("KV cache tokens", mem["kv_cache_tokens"]),
        ("KV blocks", mem["num_blocks"]),
        ("blocks per max_seq_len sequence", mem["blocks_per_sequence"]),
        ("full-length sequences that fit", mem["full_length_sequences"]),
    ]


def plan_table(ckpt: Checkpoint, profile: Profile, plan: BuildPlan) -> str:
    lines = [f"checkpoint {ckpt.path}  (source dtype {ckpt.source_dtype})",
             f"profile    {profile.name}  target {plan.target}  dtype {plan.dtype}  "
             f"quantization {plan.quantization}  kv cache {plan.kv_cache_dtype}"]
    lines += _table("model", _model_rows(ckpt.pretrained_config))
    lines += _table("build bounds", _bounds_rows(vars(plan.bounds), plan.runtime_max_input_len))
    lines += _table("runtime policy", profile.section("runtime").items())
    lines += _table("prompt policy", profile.section("prompt").items())
    lines += _table("memory plan", _memory_rows(vars(plan.memory)))
    if plan.lora.enabled:
        lines += _lora_plan_lines(plan.lora)
    lines += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(lines)


def _lora_plan_lines(lora: LoraPlan) -> list[str]:
    """build --lora-dir: the LoRA settings and each checked adapter."""
    lines = _table("LoRA", [("max_lora_rank", lora.max_lora_rank),
                            ("lora_target_modules", " ".join(lora.target_modules) or "-")])
    if lora.adapters:
        lines += _table("LoRA adapters (copied into lora/NAME/)",
                        inspect_rows([vars(a) for a in lora.adapters]))
    return lines


def lora_data(engine: EngineDir) -> dict[str, Any]:
    """The engine's LoRA settings (config.json lora_config, as TensorRT-LLM records them) and the adapters it
    loads at start (lora/NAME/; serve --lora-modules and load_lora_adapter add more at run time)."""
    config = engine.build_config.get("lora_config") or {}
    return {"lora_plugin": engine.plugin_config.get("lora_plugin"),
            "max_lora_rank": config.get("max_lora_rank", KNOBS["max_lora_rank"].default),
            "lora_target_modules": list(config.get("lora_target_modules") or []),
            "adapters": engine_adapters(engine.path, engine.meta)}


def engine_warnings(engine: EngineDir) -> list[str]:
    """What the engine silently cannot do: a TensorRT-LLM 1.2 engine without paged context FMHA (or a
    paged KV cache) has KV reuse and chunked context off (the same line `serve` prints)."""
    warning = rules.reuse_loss_warning(engine.build_config) if engine.target == "trtllm" else None
    return [warning] if warning else []


def tier_data(engine: EngineDir) -> dict[str, Any]:
    """The KV tier serve options (their defaults: serve sets them, the engine records none) and the
    size of one stored block, to size --disk-cache-size with (docs/prefix-pool.md)."""
    out: dict[str, Any] = {name: KNOBS[name].default for name in TIER_KNOBS}
    per_token = engine.meta["memory_plan"].get("kv_bytes_per_token")
    if engine.target == "torch" and isinstance(per_token, int):
        out["block_bytes"] = per_token * engine.tokens_per_block
        out["blocks_in_disk_cache_size"] = out["disk_cache_size"] // out["block_bytes"]
    return out


def kv_event_data(engine: EngineDir) -> dict[str, Any]:
    """The KV event serve options (their defaults) and the block size a router must be given
    (docs/kv-events.md); the torch target's engine process publishes them."""
    return {name: KNOBS[name].default for name in KV_EVENT_KNOBS} | {"router_block_size": engine.tokens_per_block}


def replica_data() -> dict[str, Any]:
    """The replicas serve option (its default) and what this machine allows: at most one replica
    per core this process may run on, spread over the NUMA nodes (docs/replicas.md, "Cores")."""
    cores = sorted(os.sched_getaffinity(0))
    return {"replicas": KNOBS["replicas"].default, "cores_available": len(cores),
            "numa_nodes": len(numa_nodes(cores)), "max_replicas": len(cores)}


def inspect_data(engine: EngineDir) -> dict[str, Any]:
    meta = engine.meta
    # Scalars only: trtllm-build also records nested settings (lora_config) that are not bounds.
    bounds = {k: v for k, v in engine.build_config.items() if not isinstance(v, (dict, list))}
    return {
        "path": str(engine.path),
        "target": engine.target,
        "version": engine.version,
        "model": {k: v for k, v in _model_rows(engine.pretrained_config)}
        | {"dtype": engine.pretrained_config.get("dtype"),
           "quant_algo": (engine.pretrained_config.get("quantization") or {}).get("quant_algo"),
           "kv_cache_quant_algo": (engine.pretrained_config.get("quantization") or {}).get("kv_cache_quant_algo")},
        "bounds": bounds,
        "plugin_config": dict(engine.build_config["plugin_config"]),
        "runtime": dict(meta["runtime"]),
        "prompt": dict(meta["prompt"]),
        "memory_plan": dict(meta["memory_plan"]),
        "provenance": {"profile": meta["profile"].get("name"), "source": meta["source"],
                       "built_by": meta["source"].get("built_by", "trtprompt"),
                       "versions": meta.get("versions", {}), "built_at": meta.get("built_at")},
        "warnings": engine_warnings(engine),
        "kv_tiers": tier_data(engine),
        "kv_events": kv_event_data(engine),
        "replicas": replica_data(),
        "kv_host_offload": offload_rows(engine.target),
        "lora": lora_data(engine),
    }


def _lora_lines(lora: Mapping[str, Any]) -> list[str]:
    lines = _table("LoRA", [("lora_plugin", lora["lora_plugin"]), ("max_lora_rank", lora["max_lora_rank"]),
                            ("lora_target_modules", " ".join(lora["lora_target_modules"]) or "-")])
    if lora["adapters"]:
        return lines + _table("LoRA adapters (loaded at start; serve can add more)", inspect_rows(lora["adapters"]))
    return lines + ["LoRA adapters", "  none in the engine directory (build --lora-dir NAME=DIR adds them)"]


def inspect_text(engine: EngineDir) -> str:
    data = inspect_data(engine)
    mem = data["memory_plan"]
    prov = data["provenance"]
    lines = [f"engine {data['path']}  target {data['target']}  ({data['version']})"]
    lines += _table("model", data["model"].items())
    lines += _table("build bounds", _bounds_rows(data["bounds"], mem.get("runtime_max_input_len")))
    lines += _table("plugin config", data["plugin_config"].items())
    lines += _table("runtime policy", data["runtime"].items())
    lines += _table("prompt policy", data["prompt"].items())
    lines += _table("KV tiers (serve options, defaults)", data["kv_tiers"].items())
    lines += _table("KV events (serve options, defaults)", data["kv_events"].items())
    lines += _table("replicas (serve option, default; docs/replicas.md)", data["replicas"].items())
    lines += _table("KV host/disk offload on TensorRT-LLM (serve options, defaults)", data["kv_host_offload"].items())
    lines += _lora_lines(data["lora"])
    if mem:
        lines += _table("memory plan", _memory_rows(mem))
    else:  # trtllm-build records none; TensorRT-LLM sizes the pool at load from free GPU memory
        lines += ["memory plan", "  not recorded (engine built by trtllm-build, not trtprompt)"]
    lines += _table("provenance", [
        ("built by", prov["built_by"]), ("profile", prov["profile"]), ("source", prov["source"].get("path")),
        ("source sha256", prov["source"].get("sha256")), ("built at", prov["built_at"]),
        *[(f"{k} version", v) for k, v in prov["versions"].items()],
    ])
    lines += [f"warning: {w}" for w in data["warnings"]]
    return "\n".join(lines)
