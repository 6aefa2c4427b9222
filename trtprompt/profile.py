"""Profiles: build bounds, runtime policy and prompt policy, loaded from profiles/*.toml.

A profile file has three sections, [build], [runtime] and [prompt], plus an
optional top-level `description`. Every key is optional; an unset bound is
None and the build plan fills it with TensorRT-LLM's rule. Unknown keys,
wrong types and out-of-range values are errors naming the file, the key and
the allowed range.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from trtprompt.engine.config import CAPACITY_POLICIES
from trtprompt.errors import ProfileError

# trtprompt/profiles is a symlink to the repo's top-level profiles/ (where users look); a wheel
# carries the files themselves as package data (pyproject.toml), so both find them here.
PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS: tuple[str, ...] = ("none", "int8_wo", "fp8", "int4_awq")
SCHEDULER_POLICIES: tuple[str, ...] = CAPACITY_POLICIES
OVERFLOW_POLICIES: tuple[str, ...] = ("reject", "truncate_left", "truncate_middle")
_BIG = 1 << 30


@dataclass(frozen=True)
class _Key:
    section: str
    kind: type
    low: float | None = None
    high: float | None = None
    choices: tuple[str, ...] | None = None
    nullable: bool = False

    def allowed(self) -> str:
        if self.choices:
            text = "one of " + ", ".join(self.choices)
        elif self.kind is bool:
            text = "true or false"
        elif self.kind is str:
            text = "a string"
        else:
            if self.kind is int:
                text = f"an integer in [{int(self.low or 0)}, {int(self.high or 0)}]"
            else:
                text = f"a number in [{self.low:g}, {self.high:g}]"
        return text + (" (or unset)" if self.nullable else "")

    def problem(self, value: Any) -> str | None:
        """None when `value` is acceptable, else what is wrong with it."""
        if value is None:
            return None if self.nullable else "is required"
        if self.kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, self.kind) or (self.kind is int and isinstance(value, bool)):
            return f"must be {self.allowed()}, got {value!r} ({type(value).__name__})"
        if self.choices and value not in self.choices:
            return f"must be {self.allowed()}, got {value!r}"
        if self.low is not None and not self.low <= value <= self.high:  # type: ignore[operator]
            return f"must be {self.allowed()}, got {value!r}"
        return None


KEYS: dict[str, _Key] = {
    # build bounds (TensorRT-LLM BuildConfig names)
    "max_batch_size": _Key("build", int, 1, 65536),
    "max_input_len": _Key("build", int, 1, _BIG, nullable=True),
    "max_seq_len": _Key("build", int, 2, _BIG, nullable=True),
    "max_num_tokens": _Key("build", int, 1, _BIG, nullable=True),
    "opt_num_tokens": _Key("build", int, 1, _BIG, nullable=True),
    "max_beam_width": _Key("build", int, 1, 1024),
    "tokens_per_block": _Key("build", int, 1, 1024),
    "multiple_profiles": _Key("build", bool),
    "dtype": _Key("build", str, choices=DTYPES, nullable=True),
    "quantization": _Key("build", str, choices=QUANTIZATIONS),
    # runtime policy (tensorrt_llm config.pbtxt parameters)
    "enable_chunked_context": _Key("runtime", bool),
    "enable_kv_cache_reuse": _Key("runtime", bool),
    "batch_scheduler_policy": _Key("runtime", str, choices=SCHEDULER_POLICIES),
    "kv_cache_free_gpu_mem_fraction": _Key("runtime", float, 0.01, 1.0),
    "max_tokens_in_paged_kv_cache": _Key("runtime", int, 1, _BIG, nullable=True),
    "max_queue_size": _Key("runtime", int, 1, _BIG, nullable=True),
    "max_queue_delay_microseconds": _Key("runtime", int, 0, 60_000_000),
    # prompt policy (what to do with a prompt that does not fit)
    "overflow": _Key("prompt", str, choices=OVERFLOW_POLICIES),
    "keep_turns": _Key("prompt", int, 1, 1_000_000, nullable=True),
    "truncate_separator": _Key("prompt", str),
    "output_reserve": _Key("prompt", int, 0, _BIG, nullable=True),
    "require_cache_salt": _Key("prompt", bool),
}
SECTIONS: tuple[str, ...] = ("build", "runtime", "prompt")


@dataclass(frozen=True)
class Profile:
    """Defaults are TensorRT-LLM 1.x's build and runtime defaults."""

    max_batch_size: int = 2048
    max_input_len: int | None = None
    max_seq_len: int | None = None
    max_num_tokens: int | None = None
    opt_num_tokens: int | None = None
    max_beam_width: int = 1
    tokens_per_block: int = 32
    multiple_profiles: bool = False
    dtype: str | None = None  # None or "auto": the checkpoint's dtype
    quantization: str = "none"
    enable_chunked_context: bool = False
    enable_kv_cache_reuse: bool = True
    batch_scheduler_policy: str = "guaranteed_no_evict"
    kv_cache_free_gpu_mem_fraction: float = 0.9
    max_tokens_in_paged_kv_cache: int | None = None
    max_queue_size: int | None = None
    max_queue_delay_microseconds: int = 0
    overflow: str = "reject"
    keep_turns: int | None = None
    truncate_separator: str = "\n...\n"
    # Tokens kept free for the answer when a prompt is truncated; None: the request's max_tokens.
    output_reserve: int | None = None
    require_cache_salt: bool = False
    name: str = "default"
    description: str = ""

    def __post_init__(self) -> None:
        for key, spec in KEYS.items():
            problem = spec.problem(getattr(self, key))
            if problem:
                raise ValueError(f"{spec.section}.{key} {problem}")
        if self.kv_cache_free_gpu_mem_fraction is not None:
            object.__setattr__(self, "kv_cache_free_gpu_mem_fraction",
                               float(self.kv_cache_free_gpu_mem_fraction))
        tpb = self.tokens_per_block
        if tpb & (tpb - 1):
            raise ValueError(f"build.tokens_per_block must be a power of two in [1, 1024], got {tpb}")

    def with_overrides(self, **overrides: Any) -> "Profile":
        """CLI options win over the file; None means 'not given'."""
        given = {k: v for k, v in overrides.items() if v is not None}
        unknown = sorted(set(given) - set(KEYS))
        if unknown:
            raise ProfileError(f"unknown profile key(s) {', '.join(unknown)}")
        try:
            return dataclasses.replace(self, **given)
        except ValueError as exc:
            raise ProfileError(f"command-line option: {exc}") from exc

    def section(self, name: str) -> dict[str, Any]:
        return {k: getattr(self, k) for k, spec in KEYS.items() if spec.section == name}

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **{k: getattr(self, k) for k in KEYS}}


def shipped_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.toml"))


def resolve_profile_path(name_or_path: str | Path) -> Path:
    """A shipped name ("cpu-dev") or a path to a .toml file."""
    text = str(name_or_path)
    candidate = Path(text).expanduser()
    if candidate.is_file():
        return candidate
    if "/" in text or text.endswith(".toml"):
        raise ProfileError(f"profile file {text} does not exist")
    shipped = PROFILES_DIR / f"{text}.toml"
    if shipped.is_file():
        return shipped
    raise ProfileError(f"unknown profile {text!r}; shipped profiles: {', '.join(shipped_profiles())} "
                       "(or give a path to a .toml file)")


def _flatten(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for top, value in data.items():
        if top == "description":
            if not isinstance(value, str):
                raise ProfileError(f"{where}: description must be a string")
            flat["description"] = value
            continue
        if top not in SECTIONS or not isinstance(value, dict):
            raise ProfileError(f"{where}: unknown key {top!r}; allowed: sections "
                               f"[{'], ['.join(SECTIONS)}] and description")
        for key, item in value.items():
            spec = KEYS.get(key)
            if spec is None or spec.section != top:
                known = ", ".join(k for k, s in KEYS.items() if s.section == top)
                raise ProfileError(f"{where}: unknown key {top}.{key}; allowed in [{top}]: {known}")
            problem = spec.problem(item)
            if problem:
                raise ProfileError(f"{where}: {top}.{key} {problem}")
            flat[key] = item
    return flat


def load_profile(name_or_path: str | Path) -> Profile:
    path = resolve_profile_path(name_or_path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ProfileError(f"{path}: not valid TOML: {exc}") from exc
    flat = _flatten(data, str(path))
    try:
        return Profile(name=path.stem, **flat)
    except ValueError as exc:
        raise ProfileError(f"{path}: {exc}") from exc
