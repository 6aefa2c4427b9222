"""The served workload: random 128 -> 64 at concurrency 32 against each side's OpenAI-compatible server, every
server driven by the same client and protocol: vLLM's own `vllm.benchmarks.serve`, "openai" backend, streaming
/v1/completions (vLLM 0.32's client has no Triton backend). OpenVINO has none here (openvino_side.OVMS_NOTE)."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from trtprompt.bench.openai_client import served_model
from trtprompt.bench.peers import llamacpp_side, offline_loop, servers, trtprompt_side, vllm_side

SERVED_SIDES = ("vllm", "trtprompt", "llamacpp")


def server_for(args: argparse.Namespace, side: str, port: int) -> tuple[list[Any], dict[str, str], str]:
    """Command line, environment and readiness URL of a side's server."""
    if side == "vllm":
        return vllm_side.server_cmd(args, port), vllm_side.env(args), f"http://127.0.0.1:{port}/v1/models"
    if side == "llamacpp":
        return list(llamacpp_side.side_server_cmd(args, port)), dict(os.environ), f"http://127.0.0.1:{port}/health"
    return trtprompt_side.server_cmd(args, port), trtprompt_side.env(args), f"http://127.0.0.1:{port}/v1/models"


def summary(res: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The client's figures (tokens from each server's usage chunk) and, as a cross-check,
    completed x output length: EOS is ignored, so every request yields exactly that many."""
    completed = res["completed"]
    return {"wall_s": res["duration"], "completed": completed, "failed": res.get("failed"),
            "output_tok_s": res["output_throughput"], "total_output_tokens": res.get("total_output_tokens"),
            # From each server's usage: equal on every side when all tokenized the prompts alike.
            "total_input_tokens": res.get("total_input_tokens"),
            "nominal_output_tok_s": completed * args.served_output / res["duration"],
            "mean_ttft_s": res["mean_ttft_ms"] / 1e3,
            "median_itl_s": res["median_itl_ms"] / 1e3, "loadavg_1m": os.getloadavg()[0]}


def run_served(args: argparse.Namespace, side: str) -> list[dict[str, Any]]:
    """An untimed warm-up run, then --reps timed runs, one seed each, against one server."""
    port = servers.free_port()
    cmd, env, ready = server_for(args, side, port)
    with servers.server(cmd, env, ready, args.out_dir / f"server-{side}.log", args.server_timeout) as proc:
        model = served_model(f"http://127.0.0.1:{port}")
        result = args.out_dir / f"served-{side}-warmup.json"
        vllm_side.run_client(args, port, model, args.served_warmup, 999, result, quiet=True)
        reps = []
        for r in range(args.reps):
            cpu0, t0 = offline_loop.tree_cpu_seconds(proc.pid), time.perf_counter()
            result = args.out_dir / f"served-{side}-rep{r}.json"
            res = vllm_side.run_client(args, port, model, args.served_requests, 1000 + r, result, quiet=False)
            # The client's own start-up is inside this window: a lower bound of the server's cores.
            cores = (offline_loop.tree_cpu_seconds(proc.pid) - cpu0) / (time.perf_counter() - t0)
            reps.append({**summary(res, args), "cores_busy": cores})
            servers.log(f"served {side} rep {r}: {reps[-1]['output_tok_s']:.1f} out tok/s, "
                        f"mean TTFT {reps[-1]['mean_ttft_s']:.3f} s, {cores:.2f} cores busy")
        return reps
