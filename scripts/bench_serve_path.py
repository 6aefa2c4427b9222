"""Moved: `python -m trtprompt.bench.scenarios.serve_path`, the same flags."""
from trtprompt.bench.scenarios.serve_path import main

main()
