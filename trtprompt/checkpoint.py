"""Read a Hugging Face decoder checkpoint: config, tokenizer files, safetensors weights.

Safe by default: safetensors only (pickle weights are refused), and a config
that asks for remote code is refused; nothing from the checkpoint is executed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

from trtprompt.engine.config import MODEL_TYPES, SUPPORTED_ARCHITECTURES
from trtprompt.engine.engine_dir import read_json_object
from trtprompt.engine.safetensors_header import safetensors_header
from trtprompt.errors import CheckpointError

TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
    "generation_config.json",
)
# Written by trtprompt/gguf.py beside a checkpoint it converted (kept here: gguf.py imports this module).
SOURCE_FILE = "trtprompt_source.json"
PICKLE_SUFFIXES: tuple[str, ...] = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
SAFETENSORS_DTYPES: dict[str, str] = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    hf_config: Mapping[str, Any]
    pretrained_config: Mapping[str, Any]  # engine-format keys, without dtype/mapping/quantization
    weight_files: tuple[Path, ...]
    tokenizer_files: tuple[Path, ...]
    source_dtype: str
    # SOURCE_FILE of a checkpoint converted from GGUF (trtprompt/gguf.py): model name, file, sha256.
    origin: Mapping[str, Any] | None = None

    @property
    def architecture(self) -> str:
        return str(self.pretrained_config["architecture"])

    @property
    def model_name(self) -> str:
        """What the model is called: the GGUF file's model name, else the checkpoint directory's name."""
        return str(self.origin["model"]) if self.origin and self.origin.get("model") else self.path.name

    def source_record(self) -> dict[str, Any]:
        """trtprompt.json's `source`: what the engine was built from. A temporary conversion
        (`trtprompt build MODEL.gguf`) names the GGUF file, as its directory is gone after the build."""
        if self.origin and self.origin.get("temporary"):
            return {"path": str(self.origin["gguf"]), "sha256": str(self.origin["sha256"]),
                    "model": self.model_name, "format": "gguf"}
        record: dict[str, Any] = {"path": str(self.path.resolve()), "sha256": checkpoint_sha256(self.path),
                                  "model": self.model_name}
        if self.origin:
            record["converted_from"] = dict(self.origin)
        return record


def _read_json(path: Path) -> dict[str, Any]:
    return read_json_object(path, CheckpointError)


def _check_dir(path: Path) -> None:
    if not path.exists():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} is not a directory")
    if not any(path.iterdir()):
        raise CheckpointError(f"checkpoint directory {path} is empty")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} has no config.json: not a Hugging Face checkpoint")


def _check_no_remote_code(cfg: Mapping[str, Any], path: Path) -> None:
    if "auto_map" in cfg or cfg.get("trust_remote_code"):
        raise CheckpointError(
            f"{path}/config.json asks for remote code (auto_map); trtprompt never runs code "
            "shipped with a checkpoint. Supported architectures: " + ", ".join(SUPPORTED_ARCHITECTURES))


def architecture_of(cfg: Mapping[str, Any], path: Path) -> str:
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else MODEL_TYPES.get(str(cfg.get("model_type")), "")
    if arch not in SUPPORTED_ARCHITECTURES:
        shown = arch or f"model_type {cfg.get('model_type')!r}"
        raise CheckpointError(f"{path}: architecture {shown} is not supported; "
                              f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


def safetensors_files(path: Path) -> tuple[Path, ...]:
    """The weight files, via model.safetensors.index.json when sharded."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(_read_json(index).get("weight_map", {}).values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if not shards or missing:
            raise CheckpointError(f"{index} names missing shard(s): {', '.join(missing) or '(none listed)'}")
        return tuple(path / s for s in shards)
    files = tuple(sorted(path.glob("*.safetensors")))
    if files:
        return files
    if any(p.suffix in PICKLE_SUFFIXES for p in path.iterdir()):
        raise CheckpointError(f"{path} has weights only as pickle files (.bin/.pt): refused, safetensors only. "
                              "Convert them to model.safetensors with transformers' save_pretrained.")
    raise CheckpointError(f"{path} has no weights (no *.safetensors file)")


def _rope(cfg: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope theta, scaling dict or None) from transformers 5 `rope_parameters` or older `rope_scaling`."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.pop("type", None)
    if params.get("rope_type", "default") == "default":
        return theta, None
    return theta, params


def _token_ids(cfg: Mapping[str, Any], generation: Mapping[str, Any]) -> dict[str, Any]:
    eos = generation.get("eos_token_id", cfg.get("eos_token_id"))
    eos_list = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    return {
        "bos_token_id": generation.get("bos_token_id", cfg.get("bos_token_id")),
        "eos_token_id": eos_list,
        "pad_token_id": generation.get("pad_token_id", cfg.get("pad_token_id")),
    }


def _sliding_window(cfg: Mapping[str, Any], arch: str) -> int | None:
    if arch.startswith("Qwen") and not cfg.get("use_sliding_window", False):
        return None
    window = cfg.get("sliding_window")
    return int(window) if window else None


def pretrained_config_from_hf(cfg: Mapping[str, Any], generation: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """Map an HF config.json to the engine format's `pretrained_config` keys."""
    heads = int(cfg["num_attention_heads"])
    theta, scaling = _rope(cfg)
    out = {
        "architecture": arch,
        "vocab_size": int(cfg["vocab_size"]),
        "hidden_size": int(cfg["hidden_size"]),
        "intermediate_size": int(cfg["intermediate_size"]),
        "num_hidden_layers": int(cfg["num_hidden_layers"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(cfg.get("num_key_value_heads") or heads),
        "head_size": int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        "max_position_embeddings": int(cfg.get("max_position_embeddings") or 2048),
        "norm_epsilon": float(cfg.get("rms_norm_eps", 1e-6)),
        "rotary_base": theta,
        "rotary_scaling": scaling,
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v bias; the Llama family has it (on o_proj too) when attention_bias.
        "attn_bias": arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
        "qk_layernorm": arch == "Qwen3ForCausalLM",
        "hidden_act": str(cfg.get("hidden_act", "silu")),
        "mlp_bias": bool(cfg.get("mlp_bias", False)),
        "sliding_window": _sliding_window(cfg, arch),
    }
    out.update(_token_ids(cfg, generation))
    return out


def _source_dtype(cfg: Mapping[str, Any], weight_file: Path) -> str:
    named = cfg.get("dtype") or cfg.get("torch_dtype")
    if named:
        return str(named).removeprefix("torch.")
    header = safetensors_header(weight_file)
    first = next((v for k, v in header.items() if k != "__metadata__"), None)
    return SAFETENSORS_DTYPES.get(first["dtype"], first["dtype"].lower()) if first else "float32"


def read_checkpoint(path: str | Path) -> Checkpoint:
    root = Path(path).expanduser()
    _check_dir(root)
    cfg = _read_json(root / "config.json")
    _check_no_remote_code(cfg, root)
    arch = architecture_of(cfg, root)
    weights = safetensors_files(root)
    gen_path = root / "generation_config.json"
    generation = _read_json(gen_path) if gen_path.is_file() else {}
    try:
        pretrained = pretrained_config_from_hf(cfg, generation, arch)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{root}/config.json is missing or has a bad value for {exc}") from exc
    tokenizer = tuple(root / n for n in TOKENIZER_FILES if (root / n).is_file())
    if not any(p.name in ("tokenizer.json", "tokenizer.model", "vocab.json") for p in tokenizer):
        raise CheckpointError(f"{root} has no tokenizer (tokenizer.json, tokenizer.model or vocab.json)")
    origin_file = root / SOURCE_FILE
    origin = _read_json(origin_file) if origin_file.is_file() else None
    return Checkpoint(root, cfg, pretrained, weights, tokenizer, _source_dtype(cfg, weights[0]), origin)


def iter_tensors(ckpt: Checkpoint) -> Iterator[tuple[str, Any]]:
    """(name, torch tensor) for every tensor in every weight file, read lazily."""
    from safetensors import safe_open

    for file in ckpt.weight_files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def tensor_shapes(ckpt: Checkpoint) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for file in ckpt.weight_files:
        for name, info in safetensors_header(file).items():
            if name != "__metadata__":
                shapes[name] = tuple(info["shape"])
    return shapes


def checkpoint_sha256(path: Path) -> str:
    """Hash of every file in the checkpoint (relative name and bytes), in name order."""
    digest = hashlib.sha256()
    # Hidden entries (.cache/, lock files) are tooling state, not the model.
    files = (p for p in path.rglob("*") if p.is_file() and not any(
        part.startswith(".") for part in p.relative_to(path).parts))
    for file in sorted(files):
        digest.update(str(file.relative_to(path)).encode("utf-8") + b"\0")
        with file.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def expected_weight_shapes(pc: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor the engine needs, by Hugging Face name, with its shape."""
    hidden, inter, hd = pc["hidden_size"], pc["intermediate_size"], pc["head_size"]
    q_out, kv_out = pc["num_attention_heads"] * hd, pc["num_key_value_heads"] * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (pc["vocab_size"], hidden)}
    for i in range(pc["num_hidden_layers"]):
        p = f"model.layers.{i}."
        linears = {"self_attn.q_proj": (q_out, hidden), "self_attn.k_proj": (kv_out, hidden),
                   "self_attn.v_proj": (kv_out, hidden), "self_attn.o_proj": (hidden, q_out),
                   "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
                   "mlp.down_proj": (hidden, inter)}
        for name, shape in linears.items():
            shapes[f"{p}{name}.weight"] = shape
            if _has_bias(pc, name):
                shapes[f"{p}{name}.bias"] = shape[:1]
        shapes[f"{p}input_layernorm.weight"] = (hidden,)
        shapes[f"{p}post_attention_layernorm.weight"] = (hidden,)
        if pc["qk_layernorm"]:
            shapes[f"{p}self_attn.q_norm.weight"] = (hd,)
            shapes[f"{p}self_attn.k_norm.weight"] = (hd,)
    shapes["model.norm.weight"] = (hidden,)
    if not pc["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (pc["vocab_size"], hidden)
    return shapes


def _has_bias(pc: Mapping[str, Any], linear: str) -> bool:
    if linear.startswith("mlp."):
        return bool(pc.get("mlp_bias", False))
    if not pc["attn_bias"]:
        return False
    if pc["architecture"] == "Qwen2ForCausalLM":
        return linear != "self_attn.o_proj"
    return True


def is_layer_linear(name: str) -> bool:
    """The weights W8A16 quantizes: linears inside the layers, not embeddings, norms or lm_head."""
    return name.startswith("model.layers.") and name.endswith("_proj.weight")
