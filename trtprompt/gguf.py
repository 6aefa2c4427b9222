"""A GGUF file (llama.cpp's format) as a Hugging Face checkpoint: dequantized to fp32 safetensors.

`trtprompt build MODEL.gguf` (or a directory holding one .gguf) converts the file
into a temporary checkpoint directory and builds from that as usual; `python -m
trtprompt.gguf MODEL.gguf OUT` writes the checkpoint once, to keep (the
Makefile's real model). The weights go through transformers' own GGUF loader
(`from_pretrained(dir, gguf_file=NAME)`); the tokenizer, chat template and
token ids come from the file too. Nothing is downloaded and no code shipped
with a model is run.

The loader needs the `gguf` and `accelerate` packages, which trtprompt does not
depend on (their dependency resolution would replace numpy 1.x, which
nvidia-pytriton pins): every import of them is lazy, and a build without them
fails with the command that installs them. The header (architecture, tensor
types) is read here with the standard library, so a file trtprompt cannot serve
is refused in milliseconds, before the slow load.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import re
import struct
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Mapping, Sequence

from trtprompt.checkpoint import SOURCE_FILE
from trtprompt.engine.config import MODEL_TYPES
from trtprompt.errors import CheckpointError

GGUF_SUFFIX = ".gguf"
GGUF_MAGIC = b"GGUF"
REQUIRED_PACKAGES: tuple[str, ...] = ("gguf", "accelerate")
# The versions the Makefile installs (and tests/test_real_model.py runs with).
INSTALL_HINT = "pip install --no-deps gguf==0.19.0 accelerate==1.16.0"
# ggml tensor types gguf-py 0.19 can dequantize (ggml.h numbering; BF16 is 30). Types with no
# dequantizer (Q8_1, Q8_K, the i8..f64 integer types) are refused by name before the slow load.
DEQUANTIZABLE: Mapping[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 10: "Q2_K", 11: "Q3_K",
    12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S",
    20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0",
    39: "MXFP4", 40: "NVFP4",
}
# GGUF metadata value types -> struct format (8 string, 9 array are variable-sized).
_SCALARS: Mapping[int, str] = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                               10: "<Q", 11: "<q", 12: "<d"}
_QUANT_SUFFIX = re.compile(r"[.-](I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)


@dataclass(frozen=True)
class GGUFHeader:
    """What the file says about itself before any tensor is read."""

    path: Path
    architecture: str  # GGUF's general.architecture, e.g. "llama"
    tensor_types: Mapping[str, int]  # tensor name -> ggml type number

    def __post_init__(self) -> None:
        if not self.architecture:
            raise ValueError("architecture must be a non-empty string (general.architecture)")


def is_gguf(path: Path) -> bool:
    """A .gguf file, or a directory that holds .gguf files and no config.json (not an HF checkpoint)."""
    path = Path(path).expanduser()
    if path.is_file():
        return path.suffix.lower() == GGUF_SUFFIX
    return path.is_dir() and not (path / "config.json").is_file() and any(path.glob(f"*{GGUF_SUFFIX}"))


def gguf_file(path: Path) -> Path:
    """The .gguf file PATH names: itself, or the only one in a directory."""
    path = Path(path).expanduser()
    if path.is_file():
        return path
    found = sorted(path.glob(f"*{GGUF_SUFFIX}"))
    if len(found) != 1:
        names = ", ".join(p.name for p in found) or "none"
        raise CheckpointError(f"{path} must hold exactly one {GGUF_SUFFIX} file (found: {names}); "
                              "pass the file itself")
    return found[0]


def model_name(path: Path) -> str:
    """A display name from the file name: SmolLM2-135M-Instruct.Q4_1.gguf -> SmolLM2-135M-Instruct."""
    return _QUANT_SUFFIX.sub("", Path(path).stem) or Path(path).stem


def check_dependencies() -> None:
    """Raise CheckpointError naming the install command when gguf or accelerate is missing."""
    missing = [name for name in REQUIRED_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise CheckpointError(f"reading a GGUF file needs the package(s) {', '.join(missing)}, not installed: "
                              f"{INSTALL_HINT}  (--no-deps: their dependencies would replace numpy 1.x, "
                              "which nvidia-pytriton pins; `make real-model` does this)")


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise CheckpointError(f"{f.name}: truncated GGUF header")
    return struct.unpack(fmt, data)[0]


def _read_string(f: BinaryIO) -> str:
    n = _read(f, "<Q")
    return f.read(n).decode("utf-8", errors="replace")


def _read_value(f: BinaryIO, vtype: int, keep: bool) -> Any:
    """One metadata value; arrays are skipped (None) unless keep, as the tokenizer's are huge."""
    if vtype in _SCALARS:
        return _read(f, _SCALARS[vtype])
    if vtype == 8:
        return _read_string(f)
    if vtype != 9:
        raise CheckpointError(f"{f.name}: unknown GGUF metadata type {vtype}")
    item_type, count = _read(f, "<I"), _read(f, "<Q")
    if item_type in _SCALARS and not keep:
        f.seek(struct.calcsize(_SCALARS[item_type]) * count, 1)
        return None
    items = [_read_value(f, item_type, keep) for _ in range(count)]
    return items if keep else None


def read_header(path: Path) -> GGUFHeader:
    """Architecture and tensor types from the header (standard library only, no tensor data read)."""
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise CheckpointError(f"{path} is not a GGUF file (no GGUF magic bytes)")
        version, n_tensors, n_kv = _read(f, "<I"), _read(f, "<Q"), _read(f, "<Q")
        if version < 2:
            raise CheckpointError(f"{path}: GGUF version {version} is too old (2 or later is read)")
        meta = {}
        for _ in range(n_kv):
            key = _read_string(f)
            meta[key] = _read_value(f, _read(f, "<I"), keep=False)
        types = {}
        for _ in range(n_tensors):
            name = _read_string(f)
            f.seek(8 * _read(f, "<I"), 1)  # dims
            types[name] = _read(f, "<I")
            f.seek(8, 1)  # data offset
    return GGUFHeader(Path(path), str(meta.get("general.architecture") or ""), types)


def check_header(header: GGUFHeader) -> None:
    """Refuse an architecture the engine cannot run, or tensor types nothing here can dequantize."""
    if header.architecture not in MODEL_TYPES:
        raise CheckpointError(f"{header.path}: GGUF architecture {header.architecture!r} is not supported; "
                              f"supported: {', '.join(MODEL_TYPES)}")
    bad = sorted({t for t in header.tensor_types.values() if t not in DEQUANTIZABLE})
    if bad:
        names = [n for n, t in header.tensor_types.items() if t in bad][:3]
        raise CheckpointError(f"{header.path}: tensor type(s) {', '.join(f'ggml type {t}' for t in bad)} "
                              f"(e.g. {', '.join(names)}) cannot be dequantized; supported: "
                              f"{', '.join(DEQUANTIZABLE.values())}")


def _plain_model(quantized: Any) -> Any:
    """The same architecture without quantization_config, holding the dequantized weights:
    transformers refuses save_pretrained on a model it loaded from GGUF (marked quantized)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = quantized.config.to_dict()
    cfg.pop("quantization_config", None)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):  # no random init of weights about to be replaced
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: v.to(torch.float32) for k, v in quantized.state_dict().items()}
    missing, unexpected = plain.load_state_dict(state, strict=False, assign=True)
    plain.tie_weights()
    left = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if left or unexpected:
        raise CheckpointError(f"GGUF weights do not match {type(plain).__name__}: missing {left[:3]}, "
                              f"unexpected {list(unexpected)[:3]}")
    plain.generation_config = quantized.generation_config
    return plain


def _save_tokenizer(file: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name, local_files_only=True)
    if not tok.chat_template:
        raise CheckpointError(f"{file} carries no chat template (tokenizer.chat_template)")
    tok.save_pretrained(str(out_dir))


@contextlib.contextmanager
def _parsed_once() -> Iterator[None]:
    """While converting, each GGUF file is parsed once and each tensor-name map built once.

    transformers reads the file three times (config, weights, tokenizer), and gguf-py's reader parses
    every metadata field, the 49,152-token vocabulary included, each time (~6 s on a 2-core EPYC for
    SmolLM2); its weight loader builds gguf-py's name map anew for every module of the model (~6 s).
    Both are read-only once built, and transformers looks both names up on the gguf module at call time."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}
    maps: dict[tuple[Any, int], Any] = {}

    def read(path: Any, mode: str = "r") -> Any:
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = reader(path, mode)  # type: ignore[arg-type]
        return readers[key]

    def names(arch: Any, n_blocks: int) -> Any:
        if (arch, n_blocks) not in maps:
            maps[arch, n_blocks] = name_map(arch, n_blocks)
        return maps[arch, n_blocks]

    gguf.GGUFReader, gguf.get_tensor_name_map = read, names  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map  # type: ignore[misc]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def convert(path: Path, out_dir: Path, log: Callable[[str], None] = _stderr, temporary: bool = False) -> Path:
    """Write a fp32 safetensors checkpoint (config, generation_config, tokenizer, chat template) of
    the GGUF file PATH names into OUT_DIR (created; must not hold a checkpoint yet).
    temporary: OUT_DIR is removed after the build, so the engine's provenance names the file."""
    file = gguf_file(path)
    check_dependencies()
    check_header(read_header(file))
    from transformers import AutoModelForCausalLM

    started = time.monotonic()
    log(f"converting {file.name} ({file.stat().st_size / 1e6:.0f} MB GGUF) to a fp32 safetensors checkpoint "
        f"in {out_dir} (dequantizing; ~20 s on 2 cores)")
    with _parsed_once():
        quantized = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name,
                                                         local_files_only=True)
        out_dir.mkdir(parents=True, exist_ok=True)
        _plain_model(quantized).save_pretrained(str(out_dir))
        _save_tokenizer(file, out_dir)
    source = {"model": model_name(file), "gguf": str(file.resolve()), "sha256": file_sha256(file),
              "temporary": temporary}
    (out_dir / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n", encoding="utf-8")
    log(f"converted {file.name} in {time.monotonic() - started:.0f} s")
    return out_dir


@contextlib.contextmanager
def checkpoint_dir(path: Path, log: Callable[[str], None] = _stderr) -> Iterator[Path]:
    """PATH itself for a Hugging Face checkpoint; for a GGUF file (or a directory holding one),
    a temporary checkpoint converted from it, removed afterwards."""
    if not is_gguf(path):
        yield Path(path)
        return
    with tempfile.TemporaryDirectory(prefix="trtprompt-gguf-") as tmp:
        yield convert(path, Path(tmp) / "checkpoint", log, temporary=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trtprompt.gguf",
                                     description="Convert a GGUF file into a fp32 safetensors HF checkpoint.")
    parser.add_argument("gguf", type=Path, help="A .gguf file, or a directory holding exactly one.")
    parser.add_argument("out", type=Path, help="Checkpoint directory to write (must not exist yet).")
    args = parser.parse_args(argv)
    if args.out.exists():
        parser.error(f"{args.out} already exists; remove it first")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # Written beside OUT and renamed at the end, so an interrupted run leaves no half checkpoint.
    with tempfile.TemporaryDirectory(prefix=f".{args.out.name}-", dir=args.out.parent) as tmp:
        try:
            convert(args.gguf, Path(tmp) / "checkpoint")
        except CheckpointError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        (Path(tmp) / "checkpoint").rename(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
