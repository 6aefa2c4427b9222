"""The command line that starts Triton for a TensorRT-LLM engine.

World size 1: `tritonserver` directly. More ranks (tp x pp): one tritonserver
per rank under MPI, in mpirun's multi-program form (`-n 1 <rank 0 args> :
-n 1 <rank 1 args> : ...`) because the ranks take different arguments: rank 0
loads the whole repository and serves clients; every other rank only hosts a
tensorrtllm worker (`--model-control-mode=explicit --load-model=tensorrt_llm`).
Each rank gets its own python-backend shared-memory prefix so the ranks'
python models (pre/postprocessing) do not collide.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CORE_MODEL = "tensorrt_llm"
MAX_PORT = 65535


@dataclass(frozen=True)
class TrtllmLaunchSpec:
    repo: Path
    world_size: int = 1
    tritonserver: str = "tritonserver"
    mpirun: str = "mpirun"
    host: str = "127.0.0.1"  # safe default: reachable from this machine only
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    log_verbose: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {self.world_size!r}")
        for name in ("http_port", "grpc_port", "metrics_port"):
            port = getattr(self, name)
            if not 1 <= port <= MAX_PORT:
                raise ValueError(f"{name} must be in [1, {MAX_PORT}], got {port}")
        if len({self.http_port, self.grpc_port, self.metrics_port}) != 3:
            raise ValueError("http_port, grpc_port and metrics_port must differ")
        if self.log_verbose < 0:
            raise ValueError(f"log_verbose must be >= 0, got {self.log_verbose}")


def rank_args(spec: TrtllmLaunchSpec, rank: int) -> list[str]:
    """tritonserver and its arguments for one rank."""
    if not 0 <= rank < spec.world_size:
        raise ValueError(f"rank must be in [0, {spec.world_size - 1}], got {rank}")
    args = [spec.tritonserver, f"--model-repository={spec.repo}"]
    if rank > 0:
        # Workers host only the engine shard; rank 0 owns the endpoints and the other models.
        args += ["--model-control-mode=explicit", f"--load-model={CORE_MODEL}"]
    args += [
        f"--http-address={spec.host}", f"--http-port={spec.http_port}",
        f"--grpc-address={spec.host}", f"--grpc-port={spec.grpc_port}",
        f"--metrics-address={spec.host}", f"--metrics-port={spec.metrics_port}",
        "--allow-metrics=true",
        "--disable-auto-complete-config",
        f"--backend-config=python,shm-region-prefix-name=prefix{rank}_",
    ]
    if spec.log_verbose:
        args.append(f"--log-verbose={spec.log_verbose}")
    return args


def launch_command(spec: TrtllmLaunchSpec) -> list[str]:
    if spec.world_size == 1:
        return rank_args(spec, 0)
    cmd = [spec.mpirun, "--allow-run-as-root"]
    for rank in range(spec.world_size):
        if rank:
            cmd.append(":")
        cmd += ["-n", "1", *rank_args(spec, rank)]
    return cmd
