"""A `serve --replicas N` group as tools see it: RUN_DIR/replicas.json, each replica's engine counts.

`trtprompt bench --replicas-file` and scripts/bench_replicas.py read the group from the file the
group writes when it starts (serve/launch/replicas.py: the router's URL, each replica's front end,
ports and engine socket), and take each replica's counts straight from its engine process (the
`stats` op): exact and current, where /metrics lags by a publish period. The hit rate is
hit_tokens / queried_tokens over a span, as docs/replicas.md defines it.
"""

from __future__ import annotations

import json
import sys
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

# `since` past any sequence number: the stats reply then carries no per-request timings (only counts).
_NO_TIMINGS = 1 << 62


@dataclass(frozen=True)
class Replica:
    index: int
    url: str  # its OpenAI front end, as the router knows it
    metrics_port: int
    engine_socket: str

    def __post_init__(self) -> None:
        if self.index < 0:
            raise ValueError(f"index must be >= 0, got {self.index}")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must be http(s)://HOST:PORT, got {self.url!r}")

    @property
    def metrics_target(self) -> str:
        """host:port of its Triton metrics endpoint (what a Prometheus target names)."""
        return f"{urllib.parse.urlsplit(self.url).hostname}:{self.metrics_port}"


@dataclass(frozen=True)
class ReplicaGroup:
    router: str  # the router's base URL, the one OpenAI port
    replicas: tuple[Replica, ...]

    def __post_init__(self) -> None:
        if not self.replicas:
            raise ValueError("replicas must not be empty")


def read_group(path: Path) -> ReplicaGroup:
    """The group a `serve --replicas` wrote to path (RUN_DIR/replicas.json)."""
    try:
        layout = json.loads(Path(path).read_text(encoding="utf-8"))
        return ReplicaGroup(layout["router"], tuple(
            Replica(int(r["index"]), r["url"], int(r["metrics"]), r["engine_socket"]) for r in layout["replicas"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--replicas-file {path}: not a serve --replicas layout (RUN_DIR/replicas.json): "
                         f"{exc}") from None


def engine_counts(replica: Replica) -> dict[str, int]:
    """Requests ended (every reason), prompt tokens looked up and found in the prefix cache, so far."""
    from trtprompt.serve.wire import protocol as P

    stats = P.call(replica.engine_socket, {"op": "stats", "since": _NO_TIMINGS})
    return {"requests": sum(int(n) for n in stats["finished"].values()), "hit_tokens": int(stats["hit_tokens"]),
            "queried_tokens": int(stats["queried_tokens"])}


def group_counts(group: ReplicaGroup) -> list[dict[str, int]]:
    return [engine_counts(r) for r in group.replicas]


def replica_rows(before: Sequence[Mapping[str, int]], after: Sequence[Mapping[str, int]]) -> list[dict[str, Any]]:
    """Per replica over the span: requests, hit and queried tokens, hit rate (None: nothing looked up)."""
    rows = []
    for index, (b, a) in enumerate(zip(before, after)):
        row: dict[str, Any] = {"replica": index, **{k: a[k] - b[k] for k in a}}
        row["hit_rate"] = row["hit_tokens"] / row["queried_tokens"] if row["queried_tokens"] else None
        rows.append(row)
    return rows


def scrape_targets(group: ReplicaGroup) -> list[dict[str, Any]]:
    """Prometheus file_sd targets: each replica's metrics port, labelled replica="i" (docs/monitoring)."""
    return [{"targets": [r.metrics_target], "labels": {"replica": str(r.index)}} for r in group.replicas]


def replica_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| replica | requests | prefix hit tokens | queried tokens | hit rate |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        rate = "–" if r["hit_rate"] is None else f"{r['hit_rate']:.1%}"
        lines.append(f"| {r['replica']} | {r['requests']} | {r['hit_tokens']} | {r['queried_tokens']} | {rate} |")
    total = {k: sum(r[k] for r in rows) for k in ("requests", "hit_tokens", "queried_tokens")}
    rate = f"{total['hit_tokens'] / total['queried_tokens']:.1%}" if total["queried_tokens"] else "–"
    lines.append(f"| all | {total['requests']} | {total['hit_tokens']} | {total['queried_tokens']} | {rate} |")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m trtprompt.bench.replica_group RUN_DIR/replicas.json > targets.json
    print(json.dumps(scrape_targets(read_group(Path(sys.argv[1]))), indent=2))
