"""Triton Python-backend model `preprocessing` (upstream layout): see trtprompt.serve.triton_models.pre_post."""

from trtprompt.serve.triton_models.pre_post import PreprocessingModel as TritonPythonModel  # noqa: F401
