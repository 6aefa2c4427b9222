#!/usr/bin/env python3
"""llama.cpp's server built and a checkpoint converted: trtprompt/bench/peers/llamacpp_side.py, also
`python -m trtprompt.bench.peers.llamacpp_side build|convert`."""

from trtprompt.bench.peers.llamacpp_side import main

if __name__ == "__main__":
    main()
