"""The router's added time to first token: short prompts straight to a replica vs through the router.

Requests alternate (direct, routed, direct, ...), one at a time, so both see the same machine load;
the direct ones rotate over the replicas, as the routed ones land on any of them. Each endpoint
keeps one keep-alive connection (bench/openai_client.py, the bench's own streamed completions), so
neither side pays a connection setup the other does not. TTFT: the first chunk carrying text.
"""

from __future__ import annotations

from typing import Any

from trtprompt.bench.openai_client import OpenAIClient, served_model
from trtprompt.bench.replica_group import ReplicaGroup
from trtprompt.bench.report import percentiles
from trtprompt.bench.workloads import BenchRequest


def first_token_s(client: OpenAIClient, req: BenchRequest) -> float:
    result = client.infer(req, ignore_eos=True)
    if result.error is not None or not result.times:
        raise RuntimeError(f"router overhead: request {req.index} failed: {result.error or 'no text streamed'}")
    return result.times[0]


def router_overhead(group: ReplicaGroup, requests: int, model: str | None = None,
                    timeout_s: float = 60.0) -> dict[str, Any]:
    """direct and routed TTFT p50 / p90 (ms) over `requests` pairs, and their differences (routed - direct)."""
    if requests < 1:
        raise ValueError(f"requests must be >= 1, got {requests}")
    model = model or served_model(group.router)
    routed = OpenAIClient(group.router, model, timeout_s)
    direct = [OpenAIClient(r.url, model, timeout_s) for r in group.replicas]
    times: dict[str, list[float]] = {"direct": [], "routed": []}
    try:
        for i in range(requests):
            req = BenchRequest(i, f"Hi {i}", 2, 1)  # a short prompt and one token: TTFT is all there is
            times["direct"].append(first_token_s(direct[i % len(direct)], req))
            times["routed"].append(first_token_s(routed, req))
    finally:
        for c in (routed, *direct):
            c.close()
    out: dict[str, Any] = {"requests": requests}
    for side, values in times.items():
        for q, v in percentiles(values, (50, 90)).items():
            out[f"{side}_{q}_ms"] = 1000 * v if v is not None else None
    for q in ("p50", "p90"):
        out[f"added_{q}_ms"] = out[f"routed_{q}_ms"] - out[f"direct_{q}_ms"]
    return out


def overhead_table(o: dict[str, Any]) -> str:
    lines = [f"Router added TTFT ({o['requests']} short prompts each way, interleaved):\n",
             "| TTFT (ms) | direct to a replica | through the router | added |", "| --- | ---: | ---: | ---: |"]
    for q in ("p50", "p90"):
        lines.append(f"| {q} | {o[f'direct_{q}_ms']:.2f} | {o[f'routed_{q}_ms']:.2f} | {o[f'added_{q}_ms']:+.2f} |")
    return "\n".join(lines)
