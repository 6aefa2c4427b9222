"""Moved: `python -m trtprompt.bench.scenarios.replicas`, the same flags."""
from trtprompt.bench.scenarios.replicas import main

main()
