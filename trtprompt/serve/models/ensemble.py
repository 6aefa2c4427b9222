"""Triton Python-backend model `ensemble` (torch target): see trtprompt.serve.text_model."""

from trtprompt.serve.text_model import TextModel as TritonPythonModel  # noqa: F401
