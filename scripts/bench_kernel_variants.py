"""Moved: `python -m trtprompt.bench.scenarios.kernel_variants`, the same flags."""
from trtprompt.bench.scenarios.kernel_variants import main

main()
