#!/usr/bin/env python3
"""The peer side-by-side (vLLM, llama.cpp, OpenVINO GenAI): trtprompt/bench/peers/sidebyside.py, also
`python -m trtprompt.bench.peers`."""

from trtprompt.bench.peers.sidebyside import main

if __name__ == "__main__":
    main()
