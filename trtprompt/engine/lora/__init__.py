"""LoRA adapters served from one engine (docs/lora.md).

adapter.py reads and checks a PEFT adapter; stacks.py lays the resident adapters out so that one step's
low-rank products for every adapter run as three torch calls per linear; manager.py keeps the known and
resident adapters (LRU) and pins those of running requests.
"""
