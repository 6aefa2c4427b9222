"""Moved: `python -m trtprompt.bench.scenarios.engine`, the same flags."""
from trtprompt.bench.scenarios.engine import main

main()
