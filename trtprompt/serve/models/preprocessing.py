"""Triton Python-backend model `preprocessing` (upstream layout): see trtprompt.serve.pre_post."""

from trtprompt.serve.pre_post import PreprocessingModel as TritonPythonModel  # noqa: F401
