"""The Python-backend models tritonserver loads (`models/*.py` are their entry files).

Runs inside tritonserver's Python stub processes. May import `wire`, `metrics_catalog`
and the engine's plain types; never `launch`, `engine_process` or `openai`.
"""
