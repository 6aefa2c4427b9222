"""Triton Python-backend model `ensemble` (torch target): see trtprompt.serve.triton_models.text_model."""

from trtprompt.serve.triton_models.text_model import TextModel as TritonPythonModel  # noqa: F401
