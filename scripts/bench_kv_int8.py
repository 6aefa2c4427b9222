"""Moved: `python -m trtprompt.bench.scenarios.kv_int8`, the same flags."""
from trtprompt.bench.scenarios.kv_int8 import main

main()
