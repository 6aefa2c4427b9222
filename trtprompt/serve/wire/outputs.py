"""The step frame's per-sequence fields: a request's sequences (n > 1) and log probabilities.

An output entry (docs/design.md, "Request path and engine process protocol") carries these only
where they apply, so a plain request's entries are what they always were:

| key | when | value |
| --- | --- | --- |
| `seq` | a sequence other than the first | its index (absent: 0) |
| `seq_finished` | a sequence ends before its request's last | true (absent: the entry's `finished`) |
| `logprobs` | the request asked for them | one `[logprob, [[id, logprob], ...]]` per new token, top first |
| `cum_logprob` | likewise, and on every beam of a beam search | the sum over the sequence's output so far |
| `end_logprob` | logprobs asked for, the end token ended it | `[id, logprob, top]` of that token (not an output) |
| `context_logits` | asked for; once | `{"rows", "cols", "f32"}`: [prompt tokens, vocab] float32 LE, base64 |
| `generation_logits` | asked for | the same form, one row per new token |
| `prompt_logprobs` | asked for; once | per prompt token: null for the first, then `[id, logprob, top]` |

Stdlib only on the reading side: the Triton stubs decode entries too.
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple

from trtprompt.serve.wire.frames import LogitsBlob, StepEntry

if TYPE_CHECKING:  # the writing side runs in the engine process only
    from trtprompt.engine.request import RequestOutput, TokenLogprob

Top = tuple[tuple[int, float], ...]


class Logprob(NamedTuple):
    """One position's log probability as an edge reads it from an entry."""

    token_id: int
    logprob: float
    top: Top


def add_sequence_fields(fields: StepEntry, out: "RequestOutput") -> None:
    """Put the keys above that apply to out into its entry."""
    if out.sequence_index:
        fields["seq"] = out.sequence_index
    if out.sequence_finished and not out.finished:
        fields["seq_finished"] = True
    if out.logprobs is not None:
        fields["logprobs"] = [[lp.logprob, [list(t) for t in lp.top]] for lp in out.logprobs]
    if out.cum_logprob is not None:  # a beam's comes without per-token values (engine/beams.py)
        fields["cum_logprob"] = out.cum_logprob
    if out.end_logprob is not None:
        fields["end_logprob"] = _prompt_entry(out.end_logprob)
    if out.context_logits is not None:
        fields["context_logits"] = _logits_entry(out.context_logits)
    if out.generation_logits is not None:
        fields["generation_logits"] = _logits_entry(out.generation_logits)
    if out.prompt_logprobs is not None:
        fields["prompt_logprobs"] = [None if lp is None else _prompt_entry(lp) for lp in out.prompt_logprobs]


def _logits_entry(logits: Any) -> LogitsBlob:
    """Raw float32 rows (a torch tensor: wire imports no torch) as bytes: JSON numbers would take five
    times the room and the time."""
    import numpy as np

    rows = logits.detach().to("cpu").float().contiguous().numpy().astype("<f4", copy=False)
    return {"rows": int(rows.shape[0]), "cols": int(rows.shape[1]),
            "f32": base64.b64encode(np.ascontiguousarray(rows).tobytes()).decode("ascii")}


def _prompt_entry(lp: "TokenLogprob") -> list[Any]:
    """[id, logprob, top]: a position whose token is not among an entry's new_token_ids."""
    return [lp.token_id, lp.logprob, [list(t) for t in lp.top]]


def seq_of(entry: Mapping[str, Any]) -> int:
    return int(entry.get("seq", 0))


def seq_finished(entry: Mapping[str, Any]) -> bool:
    """True on the last entry of its sequence (an error entry ends every sequence)."""
    return bool(entry.get("seq_finished") or entry.get("finished"))


def token_logprobs(entry: Mapping[str, Any]) -> list[Logprob] | None:
    """The entry's new tokens with their log probabilities (None when the request asked for none)."""
    raw = entry.get("logprobs")
    if raw is None:
        return None
    return [Logprob(int(t), float(lp), tuple((int(i), float(v)) for i, v in top))
            for t, (lp, top) in zip(entry["new_token_ids"], raw)]


def prompt_logprobs(entry: Mapping[str, Any]) -> list[Logprob | None] | None:
    """The prompt's log probabilities (None: not in this entry), None for the first token."""
    raw = entry.get("prompt_logprobs")
    if raw is None:
        return None
    return [None if p is None else Logprob(int(p[0]), float(p[1]), tuple((int(i), float(v)) for i, v in p[2]))
            for p in raw]


def end_logprob(entry: Mapping[str, Any]) -> Logprob | None:
    """The log probability of the end token that finished the entry's sequence, if it carries one."""
    raw = entry.get("end_logprob")
    if raw is None:
        return None
    return Logprob(int(raw[0]), float(raw[1]), tuple((int(i), float(v)) for i, v in raw[2]))


class Logits(NamedTuple):
    """Raw float32 logits an entry carries: rows x cols little-endian floats (numpy.frombuffer reads them)."""

    rows: int
    cols: int
    data: bytes


def logits_of(entry: Mapping[str, Any], name: str) -> Logits | None:
    """The entry's `context_logits` or `generation_logits`, if it carries them."""
    raw = entry.get(name)
    if raw is None:
        return None
    data = base64.b64decode(raw["f32"])
    if len(data) != int(raw["rows"]) * int(raw["cols"]) * 4:
        raise ValueError(f"{name}: {len(data)} bytes for {raw['rows']} x {raw['cols']} float32 values")
    return Logits(int(raw["rows"]), int(raw["cols"]), data)
