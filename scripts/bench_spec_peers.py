#!/usr/bin/env python3
"""Speculative decoding on a peer: trtprompt/bench/peers/spec_peers.py, also
`python -m trtprompt.bench.peers.spec_peers`."""

from trtprompt.bench.peers.spec_peers import main

if __name__ == "__main__":
    main()
