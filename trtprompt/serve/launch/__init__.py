"""The `trtprompt serve` process: repository, children, banner, shutdown.

Runs in the launcher process only. May import `wire`, the loose serve modules, and the
option types of `openai.config`; never `triton_models` (which needs Triton's stub) nor
`engine_process` (which it starts as a child by module name).
"""
