"""Moved: `python -m trtprompt.bench.scenarios.onednn_cache_cost`, the same flags."""
from trtprompt.bench.scenarios.onednn_cache_cost import main

main()
