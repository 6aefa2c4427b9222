"""`trtprompt demo-checkpoint`, the same flags: python scripts/make_demo_checkpoint.py OUT [--size S]."""
from trtprompt.cli import demo_checkpoint as main

if __name__ == "__main__":
    main()
