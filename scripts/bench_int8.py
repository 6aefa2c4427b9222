"""Moved: `python -m trtprompt.bench.scenarios.int8`, the same flags."""
from trtprompt.bench.scenarios.int8 import main

main()
