"""Which cores each replica of `serve --replicas N` runs on: disjoint sets, NUMA node by node.

The cores are those this process may run on (its affinity mask, which taskset, cgroups and
container limits narrow), so replicas never land on cores the operator kept back. Where Linux
reports more than one NUMA node (/sys/devices/system/node/node*/cpulist), replicas are spread
over the nodes first and each replica's cores come from one node only: its memory, first
touched by its own threads, then stays on that node (docs/replicas.md, "Cores").
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Sequence

NODE_DIR = Path("/sys/devices/system/node")


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' (the kernel's cpulist format) as sorted core ids."""
    cores: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        cores.update(range(int(low), int(high or low) + 1))
    return sorted(cores)


def numa_nodes(allowed: Sequence[int], node_dir: Path = NODE_DIR) -> list[list[int]]:
    """The allowed cores grouped by NUMA node (nodes without allowed cores left out); one group
    when the machine reports no nodes."""
    nodes = []
    for path in sorted(node_dir.glob("node*/cpulist"), key=lambda p: int(re.sub(r"\D", "", p.parent.name) or 0)):
        cores = [c for c in parse_cpulist(path.read_text()) if c in set(allowed)]
        if cores:
            nodes.append(cores)
    return nodes or [sorted(allowed)]


def _split(cores: Sequence[int], parts: int) -> list[list[int]]:
    """cores cut into parts contiguous runs whose sizes differ by at most one."""
    size, extra = divmod(len(cores), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        out.append(list(cores[start:end]))
        start = end
    return out


def replica_cpu_sets(replicas: int, allowed: Sequence[int] | None = None,
                     node_dir: Path = NODE_DIR) -> list[frozenset[int]]:
    """replicas disjoint, non-empty core sets, in replica order.

    Replicas are dealt to NUMA nodes in proportion to each node's core count (every node gets
    one before any gets two); a node's cores are then split evenly among its replicas. Raises
    ValueError when there are fewer cores than replicas."""
    cores = sorted(os.sched_getaffinity(0) if allowed is None else allowed)
    if replicas < 1:
        raise ValueError(f"replicas must be at least 1, got {replicas}")
    if replicas > len(cores):
        raise ValueError(f"replicas {replicas} exceeds the {len(cores)} cores this process may run on "
                         f"({','.join(map(str, cores))}): each replica needs at least one core of its own")
    nodes = [n for n in numa_nodes(cores, node_dir)]
    per_node = [0] * len(nodes)
    for _ in range(replicas):  # to the node with the most cores per replica so far
        best = max(range(len(nodes)), key=lambda i: (len(nodes[i]) / (per_node[i] + 1), -i))
        per_node[best] += 1
    sets: list[frozenset[int]] = []
    for node, count in zip(nodes, per_node):
        if count:
            sets += [frozenset(part) for part in _split(node, count)]
    return sets
