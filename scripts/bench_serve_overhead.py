"""Moved: `python -m trtprompt.bench.scenarios.serve_overhead`, the same flags."""
from trtprompt.bench.scenarios.serve_overhead import main

main()
