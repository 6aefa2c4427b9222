"""Triton Python-backend model `ensemble` of the llmapi layout (TensorRT-LLM 1.3+).

Decoupled: each request runs this project's prompt edge (trtprompt.serve.triton_models.llmapi_edge)
and then streams TensorRT-LLM's own llmapi `tensorrt_llm` model (its model.py, from the container)
through BLS, relaying every response as `text_output` (and the perf outputs, renamed to the names
the other layouts use). One thread per request, so one long stream does not hold the others.
"""

from __future__ import annotations

import threading
from typing import Any

import triton_python_backend_utils as pb_utils

from trtprompt.engine.engine_dir import read_engine_dir
from trtprompt.prompt.budget import PromptPolicy
from trtprompt.prompt.edge import PromptEdge, engine_dir_limits
from trtprompt.serve.triton_models import stub as io
from trtprompt.serve.triton_models.inputs import Array
from trtprompt.serve.triton_models.llmapi_edge import core_outputs, edge_request, ensemble_outputs, llmapi_inputs
from trtprompt.tokenizer import Tokenizer

CORE = "tensorrt_llm"


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        cfg, params = io.model_parameters(args)
        self.input_names = [t["name"] for t in cfg["input"]]
        self.tokenizer = Tokenizer.from_dir(params["tokenizer_dir"])
        add_special = io.param_bool(params, "add_special_tokens", True)
        engine = read_engine_dir(params["gpt_model_path"], params["tokenizer_dir"], verify_weights=False)
        chunked = io.param_bool(params, "enable_chunked_context", True)
        self.edge = PromptEdge(PromptPolicy.from_mapping(engine.prompt), self.tokenizer, add_special,
                               lambda: engine_dir_limits(engine, chunked))

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            tensors = io.read_inputs(request, self.input_names)
            wanted = frozenset(request.requested_output_names())
            threading.Thread(target=self._handle, args=(tensors, wanted, request.get_response_sender()),
                             daemon=True).start()
        return None

    def _handle(self, tensors: dict[str, Array], wanted: frozenset[str], sender: Any) -> None:
        try:
            result = edge_request(tensors, self.edge.prepare, self.tokenizer.decode)
            core = pb_utils.InferenceRequest(
                model_name=CORE, requested_output_names=core_outputs(wanted),
                inputs=[pb_utils.Tensor(n, v) for n, v in llmapi_inputs(result).items()])
            for response in core.exec(decoupled=True):
                if response.has_error():
                    raise RuntimeError(response.error().message())
                outputs = {t.name(): t.as_numpy() for t in response.output_tensors()}
                if outputs:
                    tensors_out = [pb_utils.Tensor(n, v) for n, v in ensemble_outputs(outputs, wanted).items()]
                    sender.send(pb_utils.InferenceResponse(output_tensors=tensors_out))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as exc:  # noqa: BLE001 - reported to the client with its code
            io.send_error(sender, exc)

    def finalize(self) -> None:
        return None
