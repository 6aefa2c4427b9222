"""The adapters an engine knows, holds in memory and lays out for its steps.

Three levels, as TensorRT-LLM's LoRA cache and vLLM's LoRA manager have them:
- known: by name, a directory (read again whenever it is needed) or an adapter sent as weights;
- in host memory: up to max_cpu_loras read adapters, least recently used evicted first. An adapter
  that came as weights has nothing to be read again from: evicted, its name is forgotten, and a
  request must send its weights again (TensorRT-LLM's task-id cache rule);
- laid out: up to max_loras adapters in the step stacks (stacks.py). A running request pins its
  adapter there; a request whose adapter finds every layout slot pinned waits (scheduler.py).

Registration may come from any thread (the serving front end); everything below `acquire` runs on the
engine's step loop only.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from trtprompt.engine.config import ModelConfig
from trtprompt.engine.errors import EngineRequestError
from trtprompt.engine.lora.adapter import LoraAdapter, LoraError, read_peft_dir
from trtprompt.engine.lora.config import LoraConfig
from trtprompt.engine.lora.stacks import LoraStacks, LoraStep


class UnknownLoraError(EngineRequestError):
    """A request named an adapter the engine does not know (or forgot: see the module's note)."""


@dataclass(frozen=True)
class KnownAdapter:
    """What /v1/models and `inspect` list: the name, where it came from, its rank and modules."""

    name: str
    source: str | None  # its directory; None: sent as weights
    rank: int
    target_modules: tuple[str, ...]
    in_memory: bool


class LoraManager:
    def __init__(self, cfg: ModelConfig, config: LoraConfig, device: torch.device,
                 kernel_lanes: int | None = None) -> None:
        """kernel_lanes: the compiled kernels' vector width where the engine runs them (LoraStep), else None."""
        self.cfg, self.config, self.device, self.kernel_lanes = cfg, config, device, kernel_lanes
        self._lock = threading.Lock()
        self._dirs: dict[str, str] = {}  # name -> directory
        self._host: OrderedDict[str, LoraAdapter] = OrderedDict()  # most recently used last
        # (rank, modules) of every known adapter, kept when a directory's adapter leaves host memory (listings)
        self._described: dict[str, tuple[int, tuple[str, ...]]] = {}
        self._slots: list[LoraAdapter | None] = [None] * config.max_loras
        self._slot_of: dict[str, int] = {}  # cache_key -> slot
        self._slot_lru: OrderedDict[int, None] = OrderedDict()
        self._pins: dict[int, int] = {}  # slot -> running requests
        self._running = 0  # running requests with an adapter: none, and a step skips LoRA without a look
        # The products are computed in float32 whatever the model's dtype, as PEFT computes them: on a bf16
        # model torch's bf16 GEMMs go through oneDNN, whose per-shape primitives (every run length, every
        # adapter's width) would crowd the base linears' out of its small cache (linear.py: 64 shapes) and be
        # made again and again; a bf16 GEMM of a few rows also costs ~3x its float32 one here.
        self._stacks: LoraStacks | None = None
        self._dirty = False

    # -- what is known (any thread) ---------------------------------------------------

    def load_dir(self, name: str, path: str | Path) -> LoraAdapter:
        """Read and check the PEFT adapter in path as `name` (replacing an adapter of that name)."""
        adapter = read_peft_dir(name, path, self.cfg, self.config.max_lora_rank)
        with self._lock:
            self._dirs[name] = str(path)
            self._keep(adapter)
        return adapter

    def add(self, adapter: LoraAdapter) -> None:
        """Know an adapter sent as weights (it is forgotten when evicted from host memory)."""
        if adapter.rank > self.config.max_lora_rank:
            raise LoraError(f"adapter {adapter.name!r} has rank {adapter.rank}, above max_lora_rank "
                            f"{self.config.max_lora_rank}")
        with self._lock:
            self._dirs.pop(adapter.name, None)
            self._keep(adapter)

    def remove(self, name: str) -> bool:
        """Forget `name` (requests already running with it finish with it). False: it was not known."""
        with self._lock:
            known = self._dirs.pop(name, None) is not None
            self._described.pop(name, None)
            return self._host.pop(name, None) is not None or known

    def get(self, name: str) -> LoraAdapter:
        """The adapter named `name`, read again from its directory if it left host memory."""
        with self._lock:
            adapter = self._host.get(name)
            if adapter is not None:
                self._host.move_to_end(name)
                return adapter
            path = self._dirs.get(name)
        if path is None:
            raise UnknownLoraError(f"LoRA adapter {name!r} is not loaded (known: {', '.join(self.names()) or 'none'})")
        return self.load_dir(name, path)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(set(self._dirs) | set(self._host))

    def known(self) -> list[KnownAdapter]:
        with self._lock:
            names = sorted(set(self._dirs) | set(self._host))
            out = []
            for n in names:
                rank, modules = self._described[n]
                out.append(KnownAdapter(n, self._dirs.get(n), rank, modules, n in self._host))
            return out

    def _keep(self, adapter: LoraAdapter) -> None:
        self._host[adapter.name] = adapter
        self._host.move_to_end(adapter.name)
        self._described[adapter.name] = (adapter.rank, adapter.target_modules)
        while len(self._host) > self.config.max_cpu_loras:
            evicted, _ = self._host.popitem(last=False)  # a directory's adapter is read again when asked for
            if evicted not in self._dirs:  # one sent as weights is forgotten (TensorRT-LLM's task-id cache rule)
                del self._described[evicted]

    # -- laid out for steps (the step loop) --------------------------------------------

    def acquire(self, adapter: LoraAdapter) -> bool:
        """Pin adapter's layout slot for a request that starts running; False when every slot is pinned."""
        slot = self._slot_of.get(adapter.cache_key)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return False
            old = self._slots[slot]
            if old is not None:
                del self._slot_of[old.cache_key]
            self._slots[slot], self._slot_of[adapter.cache_key] = adapter, slot
            self._dirty = True
        self._pins[slot] = self._pins.get(slot, 0) + 1
        self._running += 1
        self._slot_lru[slot] = None
        self._slot_lru.move_to_end(slot)
        return True

    def _free_slot(self) -> int | None:
        for slot, adapter in enumerate(self._slots):
            if adapter is None:
                return slot
        for slot in self._slot_lru:  # least recently used first
            if not self._pins.get(slot):
                return slot
        return None

    def release(self, adapter: LoraAdapter) -> None:
        slot = self._slot_of[adapter.cache_key]
        self._pins[slot] -= 1
        self._running -= 1

    @property
    def active(self) -> bool:
        """Some running request has an adapter."""
        return self._running > 0

    def slot(self, adapter: LoraAdapter) -> int:
        return self._slot_of[adapter.cache_key]

    def pinned(self) -> int:
        """Layout slots running requests hold."""
        return sum(1 for n in self._pins.values() if n)

    def step(self, row_slot: list[int]) -> LoraStep | None:
        """The step's batched products for rows with these slots (-1: none); None when no row has one."""
        if all(s < 0 for s in row_slot):
            return None
        if self._stacks is None or self._dirty:
            self._stacks = LoraStacks(self.cfg, self._slots, torch.float32, self.device)
            self._dirty = False
        return LoraStep(self._stacks, row_slot, self.device, kernel_lanes=self.kernel_lanes)
