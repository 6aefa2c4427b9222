"""Measurements beside `trtprompt bench`, each runnable as `python -m trtprompt.bench.scenarios.<name>`.

Each module is one scenario with its own flags (`--help`); modules whose names start with an
underscore hold what several scenarios share (starting a server, greedy runs and quality measures).
Every report states the machine through trtprompt/bench/machine.py.
"""
