"""trtprompt side by side with its peers: vLLM's CPU build, llama.cpp's server and OpenVINO GenAI (issue 40).

    .venv/bin/python -m trtprompt.bench.peers [--sides vllm,trtprompt,llamacpp,openvino] ...   # sidebyside.py
    .venv/bin/python -m trtprompt.bench.peers.spec_peers --peer vllm|openvino|llamacpp ...     # speculation
    .venv/bin/python -m trtprompt.bench.peers.llamacpp_side build|convert ...                  # llama.cpp setup

- workloads.py: the workloads and their token ids, one JSON file that every side reads.
- offline_loop.py: warm-up, timed reps and the CPU each side used (standard library only).
- trtprompt_side.py / trtprompt_worker.py, vllm_side.py / vllm_worker.py, llamacpp_side.py,
  openvino_side.py / openvino_worker.py: each side's setup, command lines and runner. A *_worker.py file
  of a peer runs by path in that peer's own venv, which has no trtprompt: it imports only the standard
  library, its runtime and offline_loop.py beside it.
- served.py: the served workload (vLLM's own benchmark client against each side's OpenAI server).
- report.py: the table of medians and ratios, cores busy, greedy agreement.
- spec_peers.py / openvino_spec_worker.py: speculative decoding on the peers (bench/speculative.py's JSON).

Docs: docs/peer-vllm.md, docs/peer-llamacpp.md, docs/peer-openvino.md.
"""
