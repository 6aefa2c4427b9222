"""Moved: `python -m trtprompt.bench.scenarios.prefix_pool`, the same flags."""
from trtprompt.bench.scenarios.prefix_pool import main

main()
