"""`python -m trtprompt.bench.peers`: the side-by-side (sidebyside.py)."""

from trtprompt.bench.peers.sidebyside import main

if __name__ == "__main__":
    main()
