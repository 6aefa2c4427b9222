"""`trtprompt build` and `inspect`: engine-dir layout, weight round trip, atomicity and bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from trtprompt.build import BuildRequest, run_build
from trtprompt.checkpoint import is_layer_linear
from trtprompt.cli import main
from trtprompt.engine.engine_dir import PARTIAL_MARKER, read_engine_dir
from trtprompt.errors import EngineDirError


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, [*args], catch_exceptions=False)
    return result.exit_code, result.output


def _build(ckpt: Path, out: Path, *args: str) -> Path:
    code, output = _cli("build", str(ckpt), "-o", str(out), "--no-progress", *args)
    assert code == 0, output
    return out


def _source_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt / "model.safetensors"))


def _assert_nothing_written(parent: Path, name: str) -> None:
    assert not (parent / name).exists()
    assert not list(parent.glob(f".{name}.*"))


def test_engine_dir_layout(tiny_engine_dir: Path, tiny_checkpoint_factory) -> None:
    cfg = json.loads((tiny_engine_dir / "config.json").read_text())
    assert set(cfg) == {"version", "pretrained_config", "build_config"}
    pc, bc = cfg["pretrained_config"], cfg["build_config"]
    assert pc["architecture"] == "LlamaForCausalLM" and pc["dtype"] == "float32"
    assert pc["mapping"] == {"world_size": 1, "tp_size": 1, "pp_size": 1}
    assert pc["quantization"] == {"quant_algo": None, "kv_cache_quant_algo": None}
    assert pc["eos_token_id"] == [1, 3] and pc["head_size"] == 16
    assert {k: bc[k] for k in ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens",
                               "opt_num_tokens", "max_beam_width", "kv_cache_type", "multiple_profiles",
                               "gather_context_logits")} == {
        "max_batch_size": 16, "max_input_len": 1024, "max_seq_len": 2048, "max_num_tokens": 512,
        "opt_num_tokens": 16, "max_beam_width": 1, "kv_cache_type": "PAGED", "multiple_profiles": False,
        "gather_context_logits": False}
    assert bc["plugin_config"] == {"tokens_per_block": 32, "use_paged_context_fmha": True, "paged_kv_cache": True,
                                   "remove_input_padding": True, "context_fmha": True, "gemm_plugin": None}
    meta = json.loads((tiny_engine_dir / "trtprompt.json").read_text())
    assert meta["format"] == 1 and meta["target"] == "torch" and meta["profile"]["name"] == "cpu-dev"
    assert meta["runtime"]["max_tokens_in_paged_kv_cache"] == 32768 and meta["prompt"]["overflow"] == "reject"
    assert meta["memory_plan"]["num_blocks"] == 1024
    assert len(meta["source"]["sha256"]) == 64 and "torch" in meta["versions"] and meta["built_at"].endswith("+00:00")
    tok = tiny_engine_dir / "tokenizer"
    assert (tok / "tokenizer.json").read_bytes() == (tiny_checkpoint_factory("llama") / "tokenizer.json").read_bytes()
    assert not (tiny_engine_dir / PARTIAL_MARKER).exists()
    engine = read_engine_dir(tiny_engine_dir)
    assert engine.model_config().num_key_value_heads == 2 and engine.tokens_per_block == 32


def test_fp32_weights_round_trip_exactly(tiny_engine_dir: Path, tiny_checkpoint_factory) -> None:
    src = _source_tensors(tiny_checkpoint_factory("llama"))
    out = load_file(str(tiny_engine_dir / "rank0.safetensors"))
    assert set(out) == set(src)
    for name, t in src.items():
        assert out[name].dtype == torch.float32 and torch.equal(out[name], t), name


def test_bf16_and_tied(tiny_checkpoint_factory, tmp_path: Path) -> None:
    ckpt = tiny_checkpoint_factory("qwen2")
    out = load_file(str(_build(ckpt, tmp_path / "bf16", "--dtype", "bfloat16") / "rank0.safetensors"))
    src = _source_tensors(ckpt)
    assert "lm_head.weight" not in out and "model.layers.0.self_attn.q_proj.bias" in out
    for name, t in src.items():
        assert out[name].dtype == torch.bfloat16
        torch.testing.assert_close(out[name].float(), t, rtol=2 ** -8, atol=1e-6)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["pretrained_config"]["dtype"] == "bfloat16"


def test_int8_weight_only(tiny_checkpoint_factory, tmp_path: Path) -> None:
    ckpt = tiny_checkpoint_factory("qwen3")
    engine = _build(ckpt, tmp_path / "w8", "--quantization", "int8_wo")
    out, src = load_file(str(engine / "rank0.safetensors")), _source_tensors(ckpt)
    quantized = [n for n in src if is_layer_linear(n)]
    assert len(quantized) == 3 * 7
    for name in quantized:
        q, scale = out[name], out[f"{name}_scale"]
        assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (q.shape[0],)
        err = (src[name] - q.float() * scale[:, None]).abs()
        assert bool((err <= scale[:, None] / 2 + 1e-6).all()), name
        assert q.abs().max().item() == 127
    for name in set(src) - set(quantized):
        assert torch.equal(out[name], src[name]), name
    meta = json.loads((engine / "trtprompt.json").read_text())
    nbytes = sum(t.numel() * t.element_size() for t in out.values())
    assert nbytes == meta["memory_plan"]["weight_bytes"]
    cfg = json.loads((engine / "config.json").read_text())
    assert cfg["pretrained_config"]["quantization"]["quant_algo"] == "W8A16"


def test_inspect_shows_the_plan(tiny_engine_dir: Path) -> None:
    code, text = _cli("inspect", str(tiny_engine_dir))
    assert code == 0
    for needle in ("max_seq_len            2048", "max_tokens_in_paged_kv_cache    32768",
                   "KV blocks                        1024", "full-length sequences that fit   16",
                   "source sha256", "profile               cpu-dev"):
        assert needle in text, needle
    code, raw = _cli("inspect", str(tiny_engine_dir), "--json")
    data = json.loads(raw)
    assert data["bounds"]["max_num_tokens"] == 512 and data["memory_plan"]["kv_bytes_per_token"] == 768
    assert data["runtime"]["enable_chunked_context"] is True and data["provenance"]["profile"] == "cpu-dev"


def test_dry_run_writes_nothing(tiny_checkpoint_factory, tmp_path: Path) -> None:
    code, text = _cli("build", str(tiny_checkpoint_factory("llama")), "-o", str(tmp_path / "e"), "--dry-run",
                      "--max-seq-len", "1024", "--kv-budget-gib", "1")
    assert code == 0 and "max_seq_len            1024" in text and "from --kv-budget-gib 1" in text
    assert list(tmp_path.iterdir()) == []


def test_existing_output_and_force(tiny_checkpoint_factory, tmp_path: Path) -> None:
    ckpt = tiny_checkpoint_factory("llama")
    out = _build(ckpt, tmp_path / "e")
    before = (out / "trtprompt.json").read_text()
    code, text = _cli("build", str(ckpt), "-o", str(out), "--max-seq-len", "1024")
    assert code != 0 and text.strip() == f"Error: output directory {out} already exists; pass --force to replace it"
    assert (out / "trtprompt.json").read_text() == before
    _build(ckpt, out, "--force", "--max-seq-len", "1024")
    assert read_engine_dir(out).build_config["max_seq_len"] == 1024
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e"]
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    code, text = _cli("build", str(ckpt), "-o", str(precious), "--force")
    assert code != 0 and "does not look like an engine directory" in text
    assert (precious / "notes.txt").read_text() == "keep me"


def test_failed_build_keeps_old_engine(tiny_checkpoint_factory, tmp_path: Path, monkeypatch) -> None:
    import trtprompt.targets.torch_build as tb

    ckpt = tiny_checkpoint_factory("llama")
    out = _build(ckpt, tmp_path / "e")
    before = (out / "trtprompt.json").read_text()

    def explode(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(tb, "save_file", explode)
    with pytest.raises(OSError, match="disk full"):
        run_build(BuildRequest(ckpt, out, force=True, progress=False))
    assert (out / "trtprompt.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e"]


def _bad_inputs(ckpt: Path, tmp: Path) -> list[tuple[list[str], str]]:
    import shutil

    empty = tmp / "empty"
    empty.mkdir()
    no_cfg = Path(shutil.copytree(ckpt, tmp / "nocfg"))
    (no_cfg / "config.json").unlink()
    gpt2 = Path(shutil.copytree(ckpt, tmp / "gpt2"))
    (gpt2 / "config.json").write_text(json.dumps({**json.loads((ckpt / "config.json").read_text()),
                                                  "architectures": ["GPT2LMHeadModel"]}))
    remote = Path(shutil.copytree(ckpt, tmp / "remote"))
    (remote / "config.json").write_text(json.dumps({**json.loads((ckpt / "config.json").read_text()),
                                                    "auto_map": {"AutoModelForCausalLM": "m.X"}}))
    pickle_only = Path(shutil.copytree(ckpt, tmp / "bin"))
    (pickle_only / "model.safetensors").rename(pickle_only / "pytorch_model.bin")
    bad_profile = tmp / "bad.toml"
    bad_profile.write_text("[build]\nmax_batch_size = 4\nmax_seq_length = 100\n")
    return [
        ([str(tmp / "missing")], "does not exist"),
        ([str(empty)], "is empty"),
        ([str(no_cfg)], "has no config.json"),
        ([str(gpt2)], "architecture GPT2LMHeadModel is not supported; supported: LlamaForCausalLM"),
        ([str(remote)], "asks for remote code"),
        ([str(pickle_only)], "refused, safetensors only"),
        ([str(ckpt), "--max-seq-len", "1024", "--max-input-len", "2048"],
         "max_input_len 2048 is larger than max_seq_len 1024"),
        ([str(ckpt), "--max-seq-len", "8192"], "max_seq_len 8192 exceeds what the model's positions allow: 4096"),
        ([str(ckpt), "--max-tokens-in-paged-kv-cache", "1000"], "one max_seq_len 2048 sequence needs 64 blocks"),
        ([str(ckpt), "--profile", str(bad_profile)], f"{bad_profile}: unknown key build.max_seq_length"),
        ([str(ckpt), "--tokens-per-block", "48"], "tokens_per_block must be a power of two"),
        ([str(ckpt), "--target", "trtllm"], "TensorRT-LLM is not installed"),
    ]


def test_bad_input_one_message_nothing_written(tiny_checkpoint_factory, tmp_path: Path) -> None:
    out_parent = tmp_path / "engines"
    out_parent.mkdir()
    for args, expected in _bad_inputs(tiny_checkpoint_factory("llama"), tmp_path):
        code, text = _cli("build", *args, "-o", str(out_parent / "e"), "--no-progress")
        assert code != 0, args
        lines = text.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error: ") and expected in lines[0], (args, text)
        _assert_nothing_written(out_parent, "e")


def test_read_engine_dir_refuses_broken(tiny_engine_dir: Path, tmp_path: Path) -> None:
    import shutil

    def broken(name: str) -> Path:
        return Path(shutil.copytree(tiny_engine_dir, tmp_path / name))

    with pytest.raises(EngineDirError, match="does not exist"):
        read_engine_dir(tmp_path / "nothing")
    a = broken("a")
    (a / "config.json").unlink()
    with pytest.raises(EngineDirError, match="config.json is missing"):
        read_engine_dir(a)
    b = broken("b")
    (b / "trtprompt.json").write_text("{")
    with pytest.raises(EngineDirError, match="corrupt"):
        read_engine_dir(b)
    c = broken("c")
    (c / "rank0.safetensors").write_bytes(b"\x00" * 4)
    with pytest.raises(EngineDirError, match="rank0.safetensors is corrupt"):
        read_engine_dir(c)
    d = broken("d")
    (d / PARTIAL_MARKER).write_text("1")
    with pytest.raises(EngineDirError, match="unfinished build"):
        read_engine_dir(d)
    code, text = _cli("inspect", str(d))
    assert code != 0 and "unfinished build" in text


KILL_DRIVER = textwrap.dedent("""
    import sys, time
    import trtprompt.targets.torch_build as tb

    real_save = tb.save_file

    def stall_mid_write(tensors, path, metadata=None):
        real_save(tensors, path, metadata=metadata)
        data = open(path, "rb").read()
        open(path, "wb").write(data[: len(data) // 2])
        print("STALLED", flush=True)
        time.sleep(120)

    tb.save_file = stall_mid_write
    from trtprompt.cli import main
    main(["build", sys.argv[1], "-o", sys.argv[2], "--no-progress"])
""")


def test_killed_build_leaves_no_engine(tiny_checkpoint_factory, tmp_path: Path) -> None:
    ckpt = tiny_checkpoint_factory("llama")
    out = tmp_path / "engines" / "tiny"
    proc = subprocess.Popen([sys.executable, "-c", KILL_DRIVER, str(ckpt), str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stalled = any(line.strip() == "STALLED" for line in proc.stdout)  # the plan table comes first
        assert stalled, proc.stderr.read()
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists()
    leftovers = list(out.parent.iterdir())
    assert len(leftovers) == 1 and leftovers[0].name.startswith(".tiny.partial-")
    assert not (leftovers[0] / "config.json").exists()
    with pytest.raises(EngineDirError):
        read_engine_dir(leftovers[0])
    # The next build of the same output needs no --force and clears the dead build's leftovers.
    _build(ckpt, out)
    assert [p.name for p in out.parent.iterdir()] == ["tiny"]
    read_engine_dir(out)
