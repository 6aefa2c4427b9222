"""Triton Python-backend model `postprocessing` (upstream layout, ONE instance): see trtprompt.serve.pre_post."""

from trtprompt.serve.pre_post import PostprocessingModel as TritonPythonModel  # noqa: F401
