"""In-flight batching under a token budget.

One rule per step: move each request's computed-token count toward its
token count, within max_num_tokens tokens and max_batch_size requests.
Generation requests go first, then context chunks (running ones, then
waiting ones in arrival order). These are TensorRT-LLM's batch manager
rules (docs/design.md, "Scheduler"); tests/test_scheduler.py states each
one as a test.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from trtprompt.engine.block_pool import Block
from trtprompt.engine.config import SchedulerConfig
from trtprompt.engine.kv_cache import KVCacheManager
from trtprompt.engine.lora.manager import LoraManager
from trtprompt.engine.request import Request, RequestStatus
from trtprompt.engine.running import RunningRequests


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    context_len: int      # tokens already in the KV cache before this step
    num_new_tokens: int  # the draft tokens among them
    is_context: bool
    # Draft tokens verified after the request's last token (speculative decoding): the last num_draft of
    # the new tokens, request.drafts[:num_draft], not yet part of the request.
    num_draft: int = 0

    @property
    def samples(self) -> bool:
        """True when this step computes the request's last token, so it yields logits."""
        return self.context_len + self.num_new_tokens - self.num_draft == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_context_requests: int = 0
    num_generation_requests: int = 0
    total_context_tokens: int = 0
    # KV blocks to copy (source id, destination id) before the step runs: forked sequences' last
    # prompt block (copy on write of the block their parent goes on writing).
    block_copies: list[tuple[int, int]] = field(default_factory=list)


class _Step:
    """Budget bookkeeping of one scheduling pass."""

    def __init__(self, budget: int, max_requests: int) -> None:
        self.budget = budget
        self.max_requests = max_requests
        self.out = SchedulerOutput()
        self.ids: set[str] = set()

    def add(self, req: Request, num_new: int, is_context: bool, num_draft: int = 0) -> None:
        self.out.scheduled.append(
            ScheduledRequest(req, req.num_computed_tokens, num_new, is_context, num_draft))
        self.ids.add(req.request_id)
        self.budget -= num_new
        if is_context:
            self.out.num_context_requests += 1
            self.out.total_context_tokens += num_new
        else:
            self.out.num_generation_requests += 1

    def remove(self, req: Request) -> None:
        """Undo the scheduling of a request preempted later in the same pass."""
        for i, s in enumerate(self.out.scheduled):
            if s.request is req:
                del self.out.scheduled[i]
                self.ids.discard(req.request_id)
                self.budget += s.num_new_tokens
                if s.is_context:
                    self.out.num_context_requests -= 1
                    self.out.total_context_tokens -= s.num_new_tokens
                else:
                    self.out.num_generation_requests -= 1
                return

    @property
    def full(self) -> bool:
        return self.budget <= 0 or len(self.out.scheduled) >= self.max_requests


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, kv: KVCacheManager, use_tiers: bool = False,
                 lora: LoraManager | None = None) -> None:
        self.cfg = cfg
        self.kv = kv
        self.lora = lora  # pins a running request's adapter in the step layout (engine/lora/manager.py)
        self.use_tiers = use_tiers  # kv has tiers below its pool (engine/tiers/)
        # Aborted requests stay in `waiting` until a pass reaches them; the counts below
        # leave them out at once. Every count is kept as requests move, never recounted:
        # statistics are read after every step.
        self.waiting: deque[Request] = deque()
        self.running = RunningRequests()  # a finished request leaves it in finish()
        self.num_waiting = 0  # status WAITING or PREEMPTED
        self.num_paused = 0  # status PREEMPTED: preempted and waiting to be admitted again
        self.num_preemptions = 0
        self.guaranteed = cfg.batch_scheduler_policy == "guaranteed_no_evict"
        self._running_reserved_blocks = 0  # sum of reserved_blocks over `running`
        # Requests waiting for their prefix blocks to come from a tier below the pool (engine/tiers/):
        # out of `waiting` meanwhile, so they hold up nobody; still counted in num_waiting.
        self.loading: dict[str, Request] = {}

    def add(self, req: Request) -> None:
        self.waiting.append(req)
        self.num_waiting += 1

    def add_first(self, reqs: list[Request]) -> None:
        """Queue reqs ahead of everything waiting, in their order (forked sequences: they arrived
        with a request already running)."""
        for req in reversed(reqs):
            self.waiting.appendleft(req)
        self.num_waiting += len(reqs)

    def is_generation(self, req: Request) -> bool:
        return req.num_output > 0 and req.num_tokens - req.num_computed_tokens == 1

    def schedule(self) -> SchedulerOutput:
        if self.loading:
            self._resume_loaded()
        step = _Step(self.cfg.max_num_tokens, self.cfg.max_batch_size)
        # Generation first: a generating request costs one token and holds a
        # client waiting for its next token, so it never waits behind a
        # prompt chunk (TensorRT-LLM schedules generation before context too).
        self._schedule_running(step, generation=True)
        self._schedule_running(step, generation=False)
        self._admit_waiting(step)
        self._grant_drafts(step)
        return step.out

    def _schedule_running(self, step: _Step, generation: bool) -> None:
        # Preemption removes requests from the end while this iterates: they are not reached.
        for req in self.running:
            if step.full:
                break
            if self.is_generation(req) != generation or req.request_id in step.ids:
                continue
            remaining = req.num_tokens - req.num_computed_tokens
            num_new = 1 if generation else self._chunk(req, remaining, step.budget)
            if num_new == 0:
                continue
            if self._allocate_or_preempt(req, num_new, step):
                step.add(req, num_new, is_context=not generation)

    def _grant_drafts(self, step: _Step) -> None:
        """Generating requests verify their drafts (speculative decoding) with what every other request left:
        the token budget after all tokens and prompt chunks of the step, and blocks that are free now. Drafts
        never take a token, a block or a preemption from anyone."""
        scheduled = step.out.scheduled
        for i, s in enumerate(scheduled):
            if step.budget <= 0:
                return
            num_draft = 0 if s.is_context else min(len(s.request.drafts), step.budget)
            if num_draft and self.kv.allocate(s.request, 1 + num_draft):
                scheduled[i] = ScheduledRequest(s.request, s.context_len, 1 + num_draft, False, num_draft)
                step.budget -= num_draft

    def _allocate_or_preempt(self, req: Request, num_new: int, step: _Step) -> bool:
        while not self.kv.allocate(req, num_new):
            if self.guaranteed:
                # Admission reserved every block this request can need; running
                # out means the reservation accounting is wrong, not the load.
                raise RuntimeError(
                    f"guaranteed_no_evict reservation broken for request {req.request_id}")
            # The newest admission is the victim: it has the least work to
            # redo and the older requests keep their arrival-order progress.
            victim = self.running.newest()
            self._preempt(victim, step)
            if victim is req:
                return False
        return True

    def _preempt(self, victim: Request, step: _Step) -> None:
        """Recompute-style preemption: drop the KV, requeue at the front.

        At the front, because it arrived before everything still waiting
        (FCFS); recompute rather than swap, as there is no host KV pool."""
        self._leave_running(victim)
        if victim.request_id in step.ids:
            step.remove(victim)
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        victim.stats.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        self.num_waiting += 1
        self.num_paused += 1

    def _chunk(self, req: Request, remaining: int, budget: int) -> int:
        if remaining <= budget:
            return remaining
        # A preempted request recomputes prompt + output, which may exceed
        # max_num_tokens, and tokens a guided request's grammar forced (jump-forward)
        # may too: either is chunked even when chunked context is off.
        if not (self.cfg.enable_chunked_context or req.stats.num_preemptions or req.num_output):
            return 0
        # A chunk that is not the last ends on a block boundary, so every
        # block but the last is complete (and publishable for reuse) after it.
        tpb = self.kv.tokens_per_block
        return (budget // tpb) * tpb

    @property
    def outstanding_reservations(self) -> int:
        """Blocks reserved for running requests but not allocated to them yet (guaranteed_no_evict).

        Only running requests hold blocks, so the pool's count of held blocks is theirs."""
        return self._running_reserved_blocks - self.kv.num_held_blocks

    def _admit_waiting(self, step: _Step) -> None:
        while self.waiting and not step.full and len(self.running) < self.cfg.max_batch_size:
            req = self.waiting[0]
            if req.is_finished:  # aborted while waiting
                self.waiting.popleft()
                continue
            if self._wait_for_tiers(req):
                self.waiting.popleft()
                continue
            if not self._admit(req, step):
                break  # first come, first served: no overtaking
            self.waiting.popleft()
            self.num_waiting -= 1

    def _wait_for_tiers(self, req: Request) -> bool:
        """Once per request: True when its next prefix blocks are being loaded from a tier.

        The request then waits in `loading`, not at the head of the queue, so the requests behind
        it keep being admitted while the loader reads (docs/prefix-pool.md, "Loads")."""
        if not self.use_tiers or req.tier_checked or req.request_id in self.loading:
            return False
        req.tier_checked = True
        hits = self.kv.find_prefix(req)
        if self.kv.next_block_in_flight(req, len(hits)) or not self.kv.start_tier_load(req, len(hits)):
            return False
        self.loading[req.request_id] = req
        return True

    def _resume_loaded(self) -> None:
        """Requests whose loads are done go back to the front of the queue (they arrived first)."""
        done = self.kv.finish_tier_loads(self.loading)
        for req in sorted(done, key=lambda r: r.stats.arrival_time_ns, reverse=True):
            del self.loading[req.request_id]
            if not req.is_finished:  # an abort while loading already counted it out
                self.waiting.appendleft(req)

    def _admit(self, req: Request, step: _Step) -> bool:
        source = self.kv.fork_source(req) if req.fork_of is not None else None
        if source is not None:
            admitted = self._admit_fork(req, source[0], source[1].block_id, step)
            if admitted:
                req.fork_of = None  # once: after a preemption it recomputes as any request does
            return admitted
        req.fork_of = None  # its parent no longer holds the prompt: admitted as any request is
        hits = self.kv.find_prefix(req)
        if self.kv.next_block_in_flight(req, len(hits)):
            # A running request is computing this prefix now: wait a step and reuse it
            # rather than compute it twice (and keep FCFS: nobody overtakes).
            return False
        tpb = self.kv.tokens_per_block
        remaining = req.num_tokens - len(hits) * tpb
        num_new = self._chunk(req, remaining, step.budget)
        if num_new == 0:
            return False
        if not self._pin_adapter(req):
            return False  # every adapter slot is pinned by running requests: wait for one to finish
        if not self._reserve(req, hits) or not self.kv.allocate(req, num_new, hits):
            self._unpin_adapter(req)
            return False
        self.kv.record_lookup(req, len(hits))
        self.kv.mark_in_flight(req, len(hits))
        self._run(req, num_new, step)
        return True

    def _reserve(self, req: Request, held: list[Block]) -> bool:
        """guaranteed_no_evict: admit only if prompt + max output fit in the free blocks not already
        promised to running requests, so nothing admitted is ever preempted (held: blocks req takes
        that others hold or cache)."""
        if not self.guaranteed:
            return True
        # A beam search reserves for all its beams on its first sequence (they join it running, start_running).
        total = self.kv.blocks_for(req.num_prompt_tokens + req.max_output_tokens) * req.params.beam_width
        needed = self.kv.free_blocks_needed(held, total - len(held))
        if needed > self.kv.num_free_blocks - self.outstanding_reservations:
            return False
        req.reserved_blocks = total
        return True

    def _admit_fork(self, req: Request, shared: list[Block], source_block: int, step: _Step) -> bool:
        """A sequence forked from a running request: its prompt's blocks shared, the last one copied,
        one token computed (the last prompt token's, for its logits)."""
        if not self._pin_adapter(req):
            return False
        if not self._reserve(req, shared) or self.kv.free_blocks_needed(shared, 1) > self.kv.num_free_blocks:
            self._unpin_adapter(req)
            return False
        step.out.block_copies.append((source_block, self.kv.fork(req, shared)))
        self._run(req, 1, step)
        return True

    def start_running(self, req: Request) -> None:
        """A beam of a running beam search joins the running requests holding the KV it was given
        (its blocks were reserved by the search's first sequence; the first holds the adapter's slot, so
        this pin cannot fail)."""
        self._pin_adapter(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def _run(self, req: Request, num_new: int, step: _Step) -> None:
        if req.status is RequestStatus.PREEMPTED:
            self.num_paused -= 1
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self._running_reserved_blocks += req.reserved_blocks
        step.add(req, num_new, is_context=True)

    def finish(self, req: Request) -> None:
        """Release a finished request's blocks; a waiting one leaves `waiting` at the next pass."""
        if req.status is RequestStatus.WAITING or req.status is RequestStatus.PREEMPTED:
            self.num_waiting -= 1
        if req.status is RequestStatus.PREEMPTED:
            self.num_paused -= 1
        self._leave_running(req)
        req.status = RequestStatus.FINISHED
        self.kv.free(req)

    def _leave_running(self, req: Request) -> None:
        if self.running.remove(req):
            self._running_reserved_blocks -= req.reserved_blocks
            self._unpin_adapter(req)

    def _pin_adapter(self, req: Request) -> bool:
        return req.lora is None or self.lora is None or self.lora.acquire(req.lora)

    def _unpin_adapter(self, req: Request) -> None:
        if req.lora is not None and self.lora is not None:
            self.lora.release(req.lora)
