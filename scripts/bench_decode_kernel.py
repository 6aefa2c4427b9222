"""Moved: `python -m trtprompt.bench.scenarios.decode_kernel`, the same flags."""
from trtprompt.bench.scenarios.decode_kernel import main

main()
