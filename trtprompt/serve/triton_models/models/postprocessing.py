"""Triton Python-backend model `postprocessing` (upstream layout, ONE instance): see
trtprompt.serve.triton_models.pre_post."""

from trtprompt.serve.triton_models.pre_post import PostprocessingModel as TritonPythonModel  # noqa: F401
