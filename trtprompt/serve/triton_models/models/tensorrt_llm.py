"""Triton Python-backend model `tensorrt_llm` (torch target): see trtprompt.serve.triton_models.token_model."""

from trtprompt.serve.triton_models.token_model import TokenModel as TritonPythonModel  # noqa: F401
