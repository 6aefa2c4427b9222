"""LoRA adapters on the OpenAI API (docs/lora.md): `trtprompt serve --lora-modules` of the real SmolLM2 engine
with two PEFT adapters made by PEFT itself (random low-rank weights), `model` = an adapter name giving
PeftModel's greedy text, adapters and the base model interleaved, /v1/models with parent and root, vLLM's
load/unload endpoints behind the API key, SGLang's lora_path, and the refusals. One server, module-scoped,
on the session's fp32 engine (its small KV pool)."""

from __future__ import annotations

import http.client
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import openai
import pytest
from click.testing import CliRunner
from lora_adapters import ALL_MODULES, make_peft_adapter, peft_greedy
from real_model_fixtures import REAL_CKPT
from serve_fixtures import Served, Stops, start_server

from trtprompt.serve.engine_process.server import engine_overrides
from trtprompt.serve.launch.lora_modules import parse_lora_modules
from trtprompt.serve.wire.lora_modules import lora_modules_of

pytestmark = pytest.mark.skipif(not (REAL_CKPT / "config.json").is_file(),
                                reason=f"the real model is not there ({REAL_CKPT}): run `make real-model`")
KEY = "sk-lora-test"
MAX_TOKENS = 10
PROMPT_TEXT = "The three most useful kitchen tools are"
CHAT = [{"role": "user", "content": "Name a colour."}]
# (name, rank, target modules, seed): a and b served from the start, c loaded at run time.
SPECS = {"a": (8, ALL_MODULES, 1), "b": (4, ("q_proj", "v_proj", "down_proj"), 2), "c": (16, ("o_proj", "up_proj"), 3)}


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-openai")
    return {name: make_peft_adapter(REAL_CKPT, root / name, rank, modules, seed)
            for name, (rank, modules, seed) in SPECS.items()}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(REAL_CKPT)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer: Any) -> list[int]:
    return list(tokenizer(PROMPT_TEXT)["input_ids"])


@pytest.fixture(scope="module")
def expected(adapter_dirs: dict[str, Path], prompt_ids: list[int], tokenizer: Any) -> dict[str | None, str]:
    """PeftModel's greedy text for the prompt: the base model (None) and each adapter."""
    out: dict[str | None, str] = {}
    for name in (None, *SPECS):
        ids = peft_greedy(REAL_CKPT, adapter_dirs[name] if name else None, prompt_ids, MAX_TOKENS)
        out[name] = tokenizer.decode(ids, skip_special_tokens=True)
    assert len(set(out.values())) == len(out), f"the adapters must change the answer to test anything: {out}"
    return out


@pytest.fixture(scope="module")
def lora_server(real_fp32_engine: Path, adapter_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory,
                stops: Stops) -> Iterator[Served]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TRTPROMPT_API_KEY", KEY)
        server = start_server(real_fp32_engine, tmp_path_factory.mktemp("lora-serve") / "run",
                              "--lora-modules", f"a={adapter_dirs['a']}",
                              "--lora-modules", json.dumps({"name": "b", "path": str(adapter_dirs["b"])}))
        yield server
        stops.server(server)


def client(served: Served, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.openai_url, api_key=key, max_retries=0)


def base_id(served: Served) -> str:
    return client(served).models.list().data[0].id


def complete(served: Served, model: str, prompt: Any, **extra: Any) -> Any:
    return client(served).completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                             **extra)


def post(served: Served, path: str, body: dict[str, Any], key: str | None = KEY) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", served.openai, timeout=120)
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    conn.request("POST", path, json.dumps(body), headers)
    resp = conn.getresponse()
    text = resp.read().decode("utf-8")
    conn.close()
    return resp.status, text


# --- the serve option, without a server ---------------------------------------------------------------


def test_lora_modules_values_and_parameter(tmp_path: Path) -> None:
    assert parse_lora_modules(["a=x", '{"name": "b", "path": "y/z"}']) == (
        ("a", str(Path("x").resolve())), ("b", str(Path("y/z").resolve())))
    for bad, message in (("a", "expected NAME=DIR"), ("=x", "expected NAME=DIR"), ("{oops", "not a JSON object")):
        with pytest.raises(ValueError, match=message):
            parse_lora_modules([bad])
    with pytest.raises(ValueError, match="adapter name 'a' is given twice"):
        parse_lora_modules(["a=x", "a=y"])
    params = {"lora_modules": json.dumps({"a": "/x"}), "max_loras": "2"}
    assert engine_overrides(params)["lora_modules"] == {"a": "/x"} and engine_overrides(params)["max_loras"] == 2
    assert "lora_modules" not in engine_overrides({}) and lora_modules_of({"lora_modules": ""}) is None
    with pytest.raises(ValueError, match="parameter lora_modules must be a JSON object"):
        lora_modules_of({"lora_modules": "[1]"})


def test_a_bad_adapter_fails_serve_with_its_message(real_fp32_engine: Path, tmp_path: Path) -> None:
    from trtprompt.cli import main

    (tmp_path / "bad").mkdir()
    result = CliRunner().invoke(main, ["serve", str(real_fp32_engine), "--repo-only", str(tmp_path / "repo"),
                                       "--lora-modules", f"bad={tmp_path / 'bad'}"])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "adapter 'bad'" in result.output and "adapter_config.json" in result.output, result.output


# --- served ----------------------------------------------------------------------------------------------


def test_model_names_an_adapter(lora_server: Served, prompt_ids: list[int], expected: dict[str | None, str]) -> None:
    base = base_id(lora_server)
    for name in (None, "a", "b"):
        answer = complete(lora_server, name or base, prompt_ids)
        assert answer.choices[0].text == expected[name], name
        assert answer.model == (name or base)  # an adapter's answer names it, as vLLM's do
    streamed = complete(lora_server, "b", prompt_ids, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == expected["b"]


def test_chat_with_an_adapter(lora_server: Served, adapter_dirs: dict[str, Path], tokenizer: Any) -> None:
    rendered = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    ids = list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    want = tokenizer.decode(peft_greedy(REAL_CKPT, adapter_dirs["a"], ids, MAX_TOKENS), skip_special_tokens=True)
    c = client(lora_server)
    answer = c.chat.completions.create(model="a", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)  # type: ignore[arg-type]
    assert answer.choices[0].message.content == want and answer.model == "a"
    stream = c.chat.completions.create(model="a", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,  # type: ignore[arg-type]
                                       stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == want


def test_adapters_and_base_concurrently(lora_server: Served, prompt_ids: list[int],
                                        expected: dict[str | None, str]) -> None:
    base = base_id(lora_server)
    names: list[str | None] = [None, "a", "b", "b", None, "a", "a", "b"]
    with ThreadPoolExecutor(len(names)) as pool:
        texts = list(pool.map(lambda n: complete(lora_server, n or base, prompt_ids).choices[0].text, names))
    assert texts == [expected[n] for n in names]


def test_models_lists_adapters_with_parent(lora_server: Served, adapter_dirs: dict[str, Path]) -> None:
    cards = {m.id: m for m in client(lora_server).models.list().data}
    base = base_id(lora_server)
    assert cards[base].model_extra["parent"] is None
    for name in ("a", "b"):
        assert cards[name].model_extra["parent"] == base
        assert cards[name].model_extra["root"] == str(adapter_dirs[name])


def test_lora_path_names_a_loaded_adapter(lora_server: Served, prompt_ids: list[int],
                                          expected: dict[str | None, str]) -> None:
    base = base_id(lora_server)
    answer = complete(lora_server, base, prompt_ids, extra_body={"lora_path": "b"})
    assert answer.choices[0].text == expected["b"]
    with pytest.raises(openai.BadRequestError) as refused:
        complete(lora_server, base, prompt_ids, extra_body={"lora_path": "nope"})
    assert refused.value.body["param"] == "lora_path" and "not a loaded LoRA adapter" in refused.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="differ"):
        complete(lora_server, "a", prompt_ids, extra_body={"lora_path": "b"})


def test_unknown_model_is_404(lora_server: Served, prompt_ids: list[int]) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        complete(lora_server, "no-such-adapter", prompt_ids)
    assert missing.value.body["code"] == "model_not_found"


def test_load_use_unload_at_run_time(lora_server: Served, adapter_dirs: dict[str, Path], prompt_ids: list[int],
                                     expected: dict[str | None, str], tmp_path: Path) -> None:
    load = {"lora_name": "c", "lora_path": str(adapter_dirs["c"])}
    for path, body in (("/v1/load_lora_adapter", load), ("/v1/unload_lora_adapter", {"lora_name": "a"})):
        assert post(lora_server, path, body, key=None)[0] == 401
        assert post(lora_server, path, body, key="sk-wrong")[0] == 401
    (tmp_path / "empty").mkdir()
    status, text = post(lora_server, "/v1/load_lora_adapter", {"lora_name": "d", "lora_path": str(tmp_path / "empty")})
    assert status == 400 and "adapter 'd'" in json.loads(text)["error"]["message"]
    status, text = post(lora_server, "/v1/load_lora_adapter", load)
    assert status == 200 and text.startswith("Success") and "'c'" in text
    assert complete(lora_server, "c", prompt_ids).choices[0].text == expected["c"]
    cards = {m.id: m for m in client(lora_server).models.list().data}
    assert cards["c"].model_extra["root"] == str(adapter_dirs["c"])
    status, text = post(lora_server, "/v1/load_lora_adapter", load)
    assert status == 400 and "already loaded" in json.loads(text)["error"]["message"]
    status, text = post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "c"})
    assert status == 200 and text.startswith("Success")
    with pytest.raises(openai.NotFoundError):
        complete(lora_server, "c", prompt_ids)
    status, text = post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "c"})
    assert status == 404 and json.loads(text)["error"]["param"] == "lora_name"
    assert "c" not in {m.id for m in client(lora_server).models.list().data}


def test_unload_keeps_the_others(lora_server: Served, prompt_ids: list[int], expected: dict[str | None, str]) -> None:
    assert complete(lora_server, "a", prompt_ids).choices[0].text == expected["a"]
