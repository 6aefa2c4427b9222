"""Moved: `python -m trtprompt.bench.scenarios.chaos`, the same flags."""
from trtprompt.bench.scenarios.chaos import main

main()
