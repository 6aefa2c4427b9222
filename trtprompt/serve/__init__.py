"""Serving, laid out by the process each part runs in (docs/design.md, "Processes").

- `launch/`: the `trtprompt serve` process: writes the Triton repository, starts and watches
  tritonserver, the engine process and the OpenAI front end, stops them all.
- `triton_models/`: code that runs inside tritonserver's Python stubs (the only place that
  imports `triton_python_backend_utils`).
- `engine_process/`: the torch target's engine process (one LLMEngine behind a unix socket).
- `openai/`: the OpenAI-compatible HTTP front end (its own process).
- `wire/`: what passes between them: the socket protocol, its client, the request types.

Loose modules are shared by several processes and import nothing of the subpackages:
`ports` (free ports, readiness probes), `metrics_catalog` (every /metrics series, declared
once) and `bad_inputs` (the catalogue of bad inputs for docs, tests and scripts/chaos.py).
The import rules are checked by tests/test_serve_layout.py.
"""
