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

from trtprompt import knobs
from trtprompt.errors import ProfileError

# trtprompt/profiles is a symlink to the repo's top-level profiles/ (where users look); a wheel
# carries the files themselves as package data (pyproject.toml), so both find them here.
PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
KEYS: dict[str, knobs.Knob] = {name: knobs.KNOBS[name] for name in knobs.PROFILE_KEYS}
SECTIONS: tuple[str, ...] = knobs.PROFILE_SECTIONS


@knobs.knob_fields(knobs.PROFILE_KEYS)
@dataclass(frozen=True)
class Profile(knobs.RuntimePolicy):
    """One field per profile knob (trtprompt/knobs.py, which knob_fields checks them against):
    defaults are TensorRT-LLM 1.x's."""

    max_batch_size: int = knobs.default("max_batch_size")
    max_input_len: int | None = knobs.default("max_input_len")
    max_seq_len: int | None = knobs.default("max_seq_len")
    max_num_tokens: int | None = knobs.default("max_num_tokens")
    opt_num_tokens: int | None = knobs.default("opt_num_tokens")
    max_beam_width: int = knobs.default("max_beam_width")
    tokens_per_block: int = knobs.default("tokens_per_block")
    multiple_profiles: bool = knobs.default("multiple_profiles")
    dtype: str | None = knobs.default("dtype")
    quantization: str = knobs.default("quantization")
    int4_group_size: int = knobs.default("int4_group_size")
    int8_group_size: int | None = knobs.default("int8_group_size")
    quantize_lm_head: bool = knobs.default("quantize_lm_head")
    smoothquant_alpha: float | None = knobs.default("smoothquant_alpha")
    kv_cache_dtype: str = knobs.default("kv_cache_dtype")
    max_lora_rank: int = knobs.default("max_lora_rank")
    overflow: str = knobs.default("overflow")
    keep_turns: int | None = knobs.default("keep_turns")
    truncate_separator: str = knobs.default("truncate_separator")
    output_reserve: int | None = knobs.default("output_reserve")
    require_cache_salt: bool = knobs.default("require_cache_salt")
    name: str = "default"
    description: str = ""

    def __post_init__(self) -> None:
        knobs.check_all(self, KEYS, qualified=True)

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
