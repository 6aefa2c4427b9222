"""The torch target's engine process: one LLMEngine and EngineLoop behind a unix socket.

Started by the launcher as `python -m trtprompt.serve.engine_process`. May import the
engine, `wire` and `metrics_catalog`; never Triton, the OpenAI front end or `launch`.
"""
