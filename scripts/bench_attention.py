"""Moved: `python -m trtprompt.bench.scenarios.attention`, the same flags."""
from trtprompt.bench.scenarios.attention import main

main()
