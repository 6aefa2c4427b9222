"""What every serving process (Triton stub, engine process, OpenAI front end) shares about how it runs."""

from __future__ import annotations

import sys

# The environment variable that hands a child the engine process's socket path.
SOCKET_ENV = "TRTPROMPT_ENGINE_SOCKET"
# Python's default GIL switch interval is 5 ms; at that each streamed response waited up to 5 ms for
# the thread that sends it (measured in the stub: first response 6.6 ms after its token, 1.8 ms at
# 0.5 ms; docs/design.md, "What a streamed token costs").
SWITCH_INTERVAL_S = 0.0005


def prefer_quick_thread_switches() -> None:
    """Let a woken thread (a reader, a writer, the event loop) take the GIL within 0.5 ms."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)
