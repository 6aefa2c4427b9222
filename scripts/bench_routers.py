"""Moved: `python -m trtprompt.bench.scenarios.routers`, the same flags."""
from trtprompt.bench.scenarios.routers import main

main()
