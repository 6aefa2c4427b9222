"""vLLM's /tokenize and /detokenize on the OpenAI front end (the engine path, on the session server's
engine process): the ids are what the engine is given for the same completion or chat (its
usage.prompt_tokens, and transformers' own encoding and chat template), /detokenize undoes
/tokenize, and bad bodies, a wrong model and a missing API key are refused as elsewhere."""

from __future__ import annotations

from typing import Any, Iterator

import pytest
from serve_fixtures import Served
from starlette.testclient import TestClient

from trtprompt.engine.engine_dir import read_engine_dir
from trtprompt.serve.openai.app import create_app
from trtprompt.serve.openai.config import FrontendConfig
from trtprompt.serve.openai.http_limits import HttpLimits

pytestmark = pytest.mark.server
KEY = "tokenize-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def front(served: Served) -> Iterator[tuple[TestClient, FrontendConfig]]:
    """The front end in process, with an API key, on the served engine's socket."""
    cfg = FrontendConfig.for_engine(served.engine_dir, "127.0.0.1:1", api_key=KEY, engine_socket=served.socket_path)
    with TestClient(create_app(cfg, HttpLimits(1 << 20))) as client:
        yield client, cfg


@pytest.fixture(scope="module")
def hf(served: Served) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(read_engine_dir(str(served.engine_dir)).tokenizer_dir)


def post(front: tuple[TestClient, FrontendConfig], path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    resp = front[0].post(path, json=body, headers=AUTH)
    return resp.status_code, resp.json()


def test_a_prompts_ids_are_what_the_engine_is_given(front: tuple[TestClient, FrontendConfig], hf: Any) -> None:
    model = front[1].limits.name
    for prompt in ("The quick brown fox", "1 2 3 4"):
        status, out = post(front, "/tokenize", {"model": model, "prompt": prompt})
        assert status == 200, out
        assert out["tokens"] == hf(prompt)["input_ids"]
        assert out["count"] == len(out["tokens"]) and out["max_model_len"] == front[1].limits.max_model_len
        status, done = post(front, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 1})
        assert status == 200 and done["usage"]["prompt_tokens"] == out["count"]


def test_a_chats_ids_are_what_the_engine_is_given(front: tuple[TestClient, FrontendConfig], hf: Any) -> None:
    # vllm-router's body: model, continue_final_message (false), messages; no model is the served one
    for body in ({"model": front[1].limits.name, "continue_final_message": False, "messages": CHAT},
                 {"messages": CHAT, "add_generation_prompt": True, "add_special_tokens": False}):
        status, out = post(front, "/tokenize", body)
        assert status == 200, out
        want = hf(hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
                  add_special_tokens=False)["input_ids"]
        assert out["tokens"] == want and out["count"] == len(want)
    status, done = post(front, "/v1/chat/completions", {"model": front[1].limits.name, "messages": CHAT,
                                                        "max_tokens": 1})
    assert status == 200 and done["usage"]["prompt_tokens"] == out["count"]


def test_detokenize_undoes_tokenize(front: tuple[TestClient, FrontendConfig], hf: Any) -> None:
    prompt = "Once upon a time, in 2024"
    _, ids = post(front, "/tokenize", {"prompt": prompt})
    status, out = post(front, "/detokenize", {"model": front[1].limits.name, "tokens": ids["tokens"]})
    assert status == 200 and out["prompt"] == hf.decode(ids["tokens"])
    assert out["prompt"].endswith(prompt)


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": ["a", "b"]}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, "messages"),
    ("/tokenize", {"messages": "hi"}, "messages"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"messages": CHAT, "add_generation_prompt": False}, "add_generation_prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": False}, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "return_token_strs": True}, "return_token_strs"),
    ("/tokenize", {"prompt": "a", "bogus": 1}, "bogus"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ("/detokenize", {"tokens": [1, -2]}, "tokens"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": [1], "bogus": 1}, "bogus"),
])
def test_bad_bodies_are_400_naming_the_field(front: tuple[TestClient, FrontendConfig], path: str,
                                             body: dict[str, Any], param: str) -> None:
    status, out = post(front, path, body)
    assert status == 400 and out["error"]["param"] == param, out


@pytest.mark.parametrize("path,body", [("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})])
def test_a_wrong_model_is_404_and_the_key_is_required(front: tuple[TestClient, FrontendConfig], path: str,
                                                      body: dict[str, Any]) -> None:
    status, out = post(front, path, {**body, "model": "not-this-one"})
    assert status == 404 and out["error"]["code"] == "model_not_found"
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        resp = front[0].post(path, json=body, headers=headers)
        assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error"
    assert post(front, path, body)[0] == 200


def test_through_triton_tokenize_is_501(served: Served) -> None:
    """Without an engine socket the ensemble tokenizes: no ids are answered that might differ."""
    cfg = FrontendConfig.for_engine(served.engine_dir, served.url)
    with TestClient(create_app(cfg, HttpLimits(1 << 20))) as client:
        for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
            resp = client.post(path, json=body)
            assert resp.status_code == 501 and "engine path" in resp.json()["error"]["message"]
