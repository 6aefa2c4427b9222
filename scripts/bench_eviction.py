"""Moved: `python -m trtprompt.bench.scenarios.eviction`, the same flags."""
from trtprompt.bench.scenarios.eviction import main

main()
