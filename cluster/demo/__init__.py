"""The CPU demo (demo.py) and the offline models it and the tests train: the tiny Qwen2 builder
(tinymodel.py), the tiny chat model (tinychat.py), the supervised warm start (warmstart.py) and
the word-problem data (wordproblems.py)."""
