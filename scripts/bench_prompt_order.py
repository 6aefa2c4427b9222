"""Moved: `python -m trtprompt.bench.scenarios.prompt_order`, the same flags."""
from trtprompt.bench.scenarios.prompt_order import main

main()
