"""Triton Python-backend model `tensorrt_llm` (torch target): see trtprompt.serve.token_model."""

from trtprompt.serve.token_model import TokenModel as TritonPythonModel  # noqa: F401
