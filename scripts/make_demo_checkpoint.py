#!/usr/bin/env python3
"""Write a Hugging Face checkpoint with random weights and an offline-trained tokenizer.

A thin wrapper around `trtprompt demo-checkpoint` (the same command, for a checkout
without an install):

    python scripts/make_demo_checkpoint.py OUT [--arch llama|mistral|qwen2|qwen3]
        [--size tiny|small|peer] [--seed N] [--tie/--no-tie] [--vocab-size N] [--rope default|llama3]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trtprompt.cli import demo_checkpoint as main  # noqa: E402

if __name__ == "__main__":
    main()
