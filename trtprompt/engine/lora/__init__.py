"""LoRA adapters served from one engine (docs/lora.md).

adapter.py reads and checks a PEFT adapter; stacks.py lays the resident adapters out so that one step's
low-rank products run as a few torch calls per linear, by runs of rows or masked; manager.py keeps the known and
resident adapters (LRU) and pins those of running requests.
"""
