"""speculative_decoding draft_target (engine/speculation/draft_model.py, docs/speculative-decoding.md): a smaller
engine drafts greedily, the target verifies. Greedy outputs equal those without speculation and transformers';
the target as its own draft has every draft accepted; draft KV is freed with its request; a draft whose
vocabulary differs is refused naming both; from_engine_dir wires it end to end."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch
import transformers
from engine_helpers import EOS, hf_greedy, make_engine, make_hf_model, model_config, run_to_completion

from trtprompt.build import BuildRequest, run_build
from trtprompt.engine.config import EngineConfig, KvCacheConfig, SchedulerConfig
from trtprompt.engine.engine import LLMEngine
from trtprompt.engine.model import DecoderModel, load_model_from_safetensors
from trtprompt.engine.request import SamplingParams
from trtprompt.engine.speculation.config import SpeculationConfig
from trtprompt.engine.speculation.draft_model import DraftEngine

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)
# Prompts of different lengths, several blocks of the draft's 4 tokens and the target's 8.
PROMPTS = {"long": list(range(5, 42)), "short": [7, 3, 90, 41], "mid": [(i * 37) % 250 + 3 for i in range(19)]}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("draft")


@pytest.fixture(scope="module")
def target(root: Path) -> Path:
    return make_hf_model(root, "llama")


def load(path: Path) -> DecoderModel:
    return load_model_from_safetensors(path / "model.safetensors", model_config(path), torch.float32,
                                       torch.device("cpu"), "reference")


def drafter(path: Path, kv_tokens: int = 1024, max_num_tokens: int = 256) -> DraftEngine:
    return DraftEngine.from_model(load(path), model_config(path), kv_tokens, 4, max_num_tokens)


def spec_engine(path: Path, draft: DraftEngine, max_draft_len: int = 4) -> LLMEngine:
    """make_engine's target with a draft engine (the test builds the draft, so its directory is never read)."""
    spec = SpeculationConfig(mode="draft_target", draft_engine_dir="(built by the test)",
                             max_draft_len=max_draft_len, max_concurrency=None)
    cfg = EngineConfig(model=model_config(path),
                       kv_cache=KvCacheConfig(tokens_per_block=8, max_tokens_in_paged_kv_cache=4096),
                       scheduler=SchedulerConfig(max_batch_size=8, max_num_tokens=256, max_seq_len=256,
                                                 enable_chunked_context=True),
                       linear_backend="reference", speculation=spec)
    return LLMEngine(cfg, load(path), [EOS], draft_model=draft)


def noisy_copy(path: Path, out: Path, scale: float) -> Path:
    """The model at path with every weight perturbed: a draft that agrees with it often, not always."""
    if not (out / "config.json").exists():
        model = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for _, param in sorted(model.named_parameters()):
                param.add_(scale * param.std() * torch.randn(param.shape, generator=gen))
        model.save_pretrained(out)
    return out


def test_the_target_as_its_own_draft_has_every_draft_accepted(target: Path) -> None:
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)  # the end token ends a run of drafts
    base = make_engine(target)
    expected = run_to_completion(base, PROMPTS, params)
    # max_num_tokens 16: the 37-token prompt's catch-up takes three draft forwards.
    draft = drafter(target, max_num_tokens=16)
    engine = spec_engine(target, draft)
    assert run_to_completion(engine, PROMPTS, params) == expected
    stats = engine.stats()
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0
    # Every step after the prefill yields its 4 drafts and one token more (the batch's requests in step).
    assert (base.iteration_counter, engine.iteration_counter) == (20, 1 + -(-19 // 5))
    assert draft.kv.num_used_blocks() == 0 and draft.num_mirrors == 0


def test_a_smaller_draft_changes_no_greedy_token_and_frees_its_kv(root: Path, target: Path) -> None:
    other = make_hf_model(root, "llama", seed=1, num_hidden_layers=1)
    reference = {rid: hf_greedy(target, tuple(p), GREEDY.max_tokens) for rid, p in PROMPTS.items()}
    stop = tuple(reference["mid"][6:8])
    assert stop not in {tuple(reference["mid"][i:i + 2]) for i in range(6)}
    requests = {**PROMPTS, "early": PROMPTS["long"][:9]}
    for path in (other, noisy_copy(target, root / "noisy", 0.2)):
        draft = drafter(path)
        engine = spec_engine(target, draft)
        seen: list[int] = []
        for rid, prompt in requests.items():
            params = {"early": SamplingParams(max_tokens=3, temperature=0.0),
                      "mid": SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(stop,))}.get(rid, GREEDY)
            engine.add_request(rid, prompt, params)
        outputs: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            seen.append(draft.num_mirrors)
        assert outputs["long"] == reference["long"] and outputs["short"] == reference["short"]
        assert outputs["mid"] == reference["mid"][:6]
        assert outputs["early"] == hf_greedy(target, tuple(requests["early"]), 3)
        stats = engine.stats()
        assert stats.spec_num_draft_tokens > 0
        if path != other:  # the noisy copy: some drafts accepted, some rejected (rolled back)
            assert stats.spec_num_draft_tokens > stats.spec_num_accepted_tokens > 0
        assert max(seen) == 4 and seen[-1] == 0  # a mirror per drafting request, each freed as it finished
        assert draft.kv.num_used_blocks() == 0 and engine.kv.num_held_blocks == 0


def test_a_request_without_draft_kv_goes_on_without_drafts(target: Path) -> None:
    expected = run_to_completion(make_engine(target), PROMPTS, GREEDY)
    draft = drafter(target, kv_tokens=16)  # 4 blocks: only the short prompt's catch-up fits
    engine = spec_engine(target, draft)
    assert run_to_completion(engine, PROMPTS, GREEDY) == expected
    assert engine.stats().spec_num_draft_tokens > 0  # the short one drafted
    assert draft.kv.num_used_blocks() == 0


def test_a_failing_draft_forward_is_logged_once_and_the_target_goes_on(root: Path, target: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    # Built past the check open_draft_model makes: a 128-token draft vocabulary, fed the target's token 200.
    small = make_hf_model(root, "llama", seed=2, vocab_size=128)
    prompts = {"a": [5, 200, 7, 9], "b": [11, 12, 13]}
    expected = run_to_completion(make_engine(target), prompts, GREEDY)
    draft = drafter(small)
    engine = spec_engine(target, draft)
    with caplog.at_level(logging.WARNING, logger="trtprompt.engine.speculation.draft_model"):
        assert run_to_completion(engine, prompts, GREEDY) == expected
    assert engine.stats().spec_num_draft_tokens == 0 and draft.forward_failures > 2
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "draft model forward failed" in errors[0].getMessage()


# Engine directories: `trtprompt build` of the demo checkpoints (tests/conftest.py).
@pytest.fixture(scope="module")
def engines(tiny_checkpoint_factory: Callable[..., Path], tiny_engine_dir: Path,
            tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("draft-engines")

    def build(name: str, **spec: object) -> Path:
        path = run_build(BuildRequest(tiny_checkpoint_factory("llama", **spec), out / name, "cpu-dev",
                                      progress=False))
        assert path is not None
        return path

    swapped = out / "swapped"  # the target's engine, two tokens' ids exchanged in its tokenizer
    shutil.copytree(tiny_engine_dir, swapped)
    tok_path = swapped / "tokenizer" / "tokenizer.json"
    tok = json.loads(tok_path.read_text(encoding="utf-8"))
    vocab = tok["model"]["vocab"]
    a, b = (t for t, i in vocab.items() if i in (300, 301))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    tok_path.write_text(json.dumps(tok), encoding="utf-8")
    return {"target": tiny_engine_dir, "draft": build("seed1", seed=1), "small_vocab": build("v300", vocab_size=300),
            "swapped": swapped}


def vocab_size(engine_dir: Path) -> int:
    return int(json.loads((engine_dir / "config.json").read_text())["pretrained_config"]["vocab_size"])


def test_from_engine_dir_drafts_with_the_draft_engine(engines: dict[str, Path]) -> None:
    prompts = {"a": list(range(40, 71)), "b": [300, 12, 9, 400, 77], "c": list(range(600, 610))}
    params = SamplingParams(max_tokens=12, temperature=0.0)
    expected = run_to_completion(LLMEngine.from_engine_dir(engines["target"], speculative_decoding="none"),
                                 prompts, params)
    engine = LLMEngine.from_engine_dir(engines["target"], speculative_decoding="draft_target",
                                       speculative_model=str(engines["draft"]))
    assert engine.drafter is not None and isinstance(engine.drafter.draft_model, DraftEngine)
    assert run_to_completion(engine, prompts, params) == expected
    assert engine.stats().spec_num_draft_tokens > 0
    assert engine.drafter.draft_model.kv.num_used_blocks() == 0


@pytest.mark.parametrize("draft", ["small_vocab", "swapped"])
def test_a_draft_with_another_vocabulary_is_refused_naming_both(engines: dict[str, Path], draft: str) -> None:
    target = engines["target"]
    with pytest.raises(ValueError) as err:
        LLMEngine.from_engine_dir(target, speculative_decoding="draft_target", speculative_model=str(engines[draft]))
    message = str(err.value)
    assert f"target {target} (vocab_size {vocab_size(target)}" in message
    assert f"draft {engines[draft]} (vocab_size {vocab_size(engines[draft])}" in message
    if draft == "swapped":  # the same vocab_size: the tokenizers tell them apart
        assert vocab_size(engines[draft]) == vocab_size(target)
        assert "2 tokens have other ids" in message and "is 300 in the target, 301 in the draft" in message
    else:
        assert vocab_size(engines[draft]) != vocab_size(target) and "vocab_size differs" in message
