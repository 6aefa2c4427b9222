"""OpenVINO GenAI as a side (docs/peer-openvino.md): its venv, the model's export, the offline worker, and why
it has no served figure.

OpenVINO GenAI runs in its own venv (--ov-venv, default PEERS/ov-venv; `--install-peers` makes it) as
openvino_worker.py, run by path by that venv's python. The model is an `optimum-cli export openvino` of the same
checkpoint the other sides load, made on first use under --ov-model-dir (default PEERS/openvino):
`<checkpoint>-fp32` serves fp32 (f32 hint) and bf16 (bf16 hint: the same IR), `<checkpoint>-int8` the int8
weights. OpenVINO's OpenAI-compatible server is OpenVINO Model Server (OVMS), which ships as a binary release and a
docker image, not on PyPI: OVMS_NOTE.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from trtprompt.bench.peers import servers, workloads
from trtprompt.bench.peers.servers import ROOT

WORKER = Path(__file__).resolve().with_name("openvino_worker.py")
# docs/peer-openvino.md: optimum-intel 2.2 pulls torchvision and, unpinned, a CUDA torch: torch is pinned in
# the same pip command and torchvision removed afterwards.
PACKAGES = ("torch==2.13.0", "openvino==2026.4.1", "openvino-genai==2026.4.1.0", "openvino-tokenizers==2026.4.1.0",
            "optimum-intel[openvino]==2.2.0", "nncf")
UNINSTALL = ("torchvision",)
# The IR's weight format per --dtype: bf16 runs the fp32 IR with the bf16 precision hint.
WEIGHT_FORMAT = {"fp32": "fp32", "bf16": "fp32", "int8": "int8"}
KV_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "u8": 1}
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
OVMS_NOTE = ("OVMS: not installable from the package registries here (PyPI has no `ovms` or "
             "`openvino-model-server`; OpenVINO Model Server ships as a binary release and a docker image): "
             "no served figure for OpenVINO")


@dataclass(frozen=True)
class OvPaths:
    """The venv and the exports' directory."""

    venv: Path
    model_root: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def optimum_cli(self) -> Path:
        return self.venv / "bin" / "optimum-cli"

    def model_dir(self, checkpoint: Path, dtype: str) -> Path:
        return self.model_root / f"{checkpoint.name}-{WEIGHT_FORMAT[dtype]}"


def paths(args: argparse.Namespace) -> OvPaths:
    return OvPaths(args.ov_venv, args.ov_model_dir)


def precision_hint(dtype: str, cpu_flags: Iterable[str]) -> str:
    """INFERENCE_PRECISION_HINT: f32 for fp32; bf16 for bf16, and for int8 weights where the CPU has bf16
    instructions (the rest of the step in bf16, as OpenVINO runs its int8 exports; f32 elsewhere)."""
    if dtype == "fp32":
        return "f32"
    if dtype == "bf16":
        return "bf16"
    return "bf16" if BF16_FLAGS & set(cpu_flags) else "f32"


def hint(args: argparse.Namespace) -> str:
    from trtprompt.bench.machine import kernel_flags

    return precision_hint(args.dtype, kernel_flags())


def kv_precision(args: argparse.Namespace) -> str:
    """KV_CACHE_PRECISION: --ov-kv-precision, else the hint's (OpenVINO's own x86 default, u8, changes tokens)."""
    return str(args.ov_kv_precision or hint(args))


def physical_gib() -> float:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / (1 << 30)


def cache_gb(args: argparse.Namespace, machine_gib: float | None = None) -> int:
    """SchedulerConfig.cache_size: --ov-cache-gb, else room for the prefix workload unshared (OpenVINO does not
    share a prefix inside a burst), at most half the machine's memory, at least 1."""
    if args.ov_cache_gb is not None:
        return int(args.ov_cache_gb)
    need = workloads.kv_pool_gib(args, KV_BYTES[kv_precision(args)], at_least=1)
    half = int((physical_gib() if machine_gib is None else machine_gib) // 2)
    return max(1, min(need, half))


def installed(p: OvPaths) -> bool:
    return p.python.exists() and subprocess.run([str(p.python), "-c", "import openvino_genai"],
                                                capture_output=True, check=False).returncode == 0


def install(p: OvPaths) -> None:
    """docs/peer-openvino.md, step by step."""
    if installed(p):
        servers.log(f"OpenVINO GenAI already installed in {p.venv}")
        return
    servers.run_checked([sys.executable, "-m", "venv", p.venv])
    servers.run_checked([p.python, "-m", "pip", "install", *PACKAGES])
    servers.run_checked([p.python, "-m", "pip", "uninstall", "-y", *UNINSTALL])


def export_cmd(p: OvPaths, checkpoint: Path, dtype: str) -> list[str]:
    return [str(p.optimum_cli), "export", "openvino", "--model", str(checkpoint), "--task",
            "text-generation-with-past", "--weight-format", WEIGHT_FORMAT[dtype], str(p.model_dir(checkpoint, dtype))]


def ensure_export(p: OvPaths, checkpoint: Path, dtype: str) -> Path:
    """The export for --dtype; made once, on first use (an existing one is never redone)."""
    out = p.model_dir(checkpoint, dtype)
    if (out / "openvino_model.xml").exists():
        return out
    log_path = p.model_root / f"export-{out.name}.log"
    servers.log(f"no OpenVINO export in {out}: exporting it now (first use; log in {log_path})")
    p.model_root.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w", encoding="utf-8") as log:
        servers.run_checked(export_cmd(p, checkpoint, dtype), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    return out


def prepare(args: argparse.Namespace) -> None:
    p = paths(args)
    if args.install_peers:
        install(p)
    if not installed(p):
        sys.exit(f"OpenVINO GenAI is not installed in {p.venv}: rerun with --install-peers (docs/peer-openvino.md)")
    ensure_export(p, args.checkpoint, args.dtype)


def offline_cmd(args: argparse.Namespace, prompts: Path, out: Path) -> list[Any]:
    p = paths(args)
    return [p.python, WORKER, "--prompts", prompts, "--out", out, "--model", p.model_dir(args.checkpoint, args.dtype),
            "--threads", args.threads, "--precision-hint", hint(args), "--kv-precision", kv_precision(args),
            "--cache-gb", cache_gb(args)]


def env(args: argparse.Namespace) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(args.threads)}


def parse_result(text: str) -> dict[str, Any]:
    """The worker's JSON, checked to be OpenVINO's: its side, versions and a list of reps per workload."""
    result: dict[str, Any] = json.loads(text)
    if result.get("side") != "openvino" or "openvino_genai" not in result.get("versions", {}):
        raise ValueError(f"not an OpenVINO worker result: side {result.get('side')!r}, "
                         f"versions {result.get('versions')!r}")
    for name in workloads.OFFLINE:
        if name in result and not isinstance(result[name], list):
            raise ValueError(f"OpenVINO result: {name} must be a list of reps, got {type(result[name]).__name__}")
    return result


def precision(args: argparse.Namespace) -> str:
    return (f"{WEIGHT_FORMAT[args.dtype]} weights (optimum-cli export), INFERENCE_PRECISION_HINT {hint(args)}, "
            f"KV_CACHE_PRECISION {kv_precision(args)}")


def command(args: argparse.Namespace) -> str:
    """What the report prints for the side: the pipeline and its settings."""
    model = paths(args).model_dir(args.checkpoint, args.dtype)
    sched = (f"SchedulerConfig(max_num_batched_tokens={workloads.MAX_NUM_TOKENS}, max_num_seqs={workloads.MAX_BATCH}, "
             f"enable_prefix_caching=True, dynamic_split_fuse=True, cache_size={cache_gb(args)})")
    return (f"ContinuousBatchingPipeline({model}, {sched}, 'CPU', INFERENCE_NUM_THREADS={args.threads}, "
            f"INFERENCE_PRECISION_HINT={hint(args)}, KV_CACHE_PRECISION={kv_precision(args)}); "
            f"worker: {servers.show(offline_cmd(args, Path('P.json'), Path('R.json')))}")
