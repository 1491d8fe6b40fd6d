"""What cluster/models/tinymodel.py and tinychat.py write loads and generates in transformers and in vLLM.

vLLM's side is a warm RolloutWorker of the session's pool (tests/e2e/engine_pool.py): vllm.LLM with our engine
arguments, not vLLM with its defaults, whose start the pool's engines already pay. (DeepSpeed loading is covered
by the learner's tests, which initialise it anyway.)
"""
from __future__ import annotations

import sys

import torch
from engine_pool import CHAT_CONFIG

from cluster.models.tinychat import ENDOFTEXT, IM_END
from cluster.models.tinymodel import EOS, PAD, num_parameters


def test_transformers_loads_and_generates(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    assert tokenizer.pad_token == PAD and tokenizer.eos_token == EOS
    assert model.config.pad_token_id == tokenizer.pad_token_id and model.config.eos_token_id == tokenizer.eos_token_id
    ids = tokenizer("12+34=", return_tensors="pt").input_ids
    assert ids.shape[1] == 6  # one token per character
    assert tokenizer.decode(ids[0]) == "12+34="
    assert model.config.tie_word_embeddings
    assert sum(p.numel() for p in model.parameters()) == num_parameters(tiny_model_dir)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] > ids.shape[1]


def test_vllm_loads_and_generates(engine_pool, tiny_model_dir):
    """A warm engine of the session's pool (tests/e2e/engine_pool.py) on the tiny model: vLLM loaded the directory
    (the pool checked the engine holds its weights) and samples text from text prompts."""
    import ray

    with engine_pool.lease(tiny_model_dir) as (engine,):
        assert ray.get(engine.info.remote())["model_path"] == str(tiny_model_dir)
        rollouts = ray.get(engine.generate.remote(["12+34=", "7*8="], 1, seeds=[0, 1], max_new_tokens=8))
    texts = [r.completions[0].text for r in rollouts]
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts)
    assert any(texts)  # random weights, but 8 sampled characters are not all EOS


CHAT = [{"role": "system", "content": "Solve the problem."},
        {"role": "user", "content": "Tom has 3 apples and gets 4 more. How many apples does Tom have now?"}]


def test_chat_model_loads_in_transformers(tiny_chat_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model_dir, dtype=torch.float32).eval()
    assert tokenizer.eos_token == IM_END and tokenizer.pad_token == ENDOFTEXT
    assert model.config.eos_token_id == tokenizer.eos_token_id
    generation = GenerationConfig.from_pretrained(tiny_chat_model_dir)
    assert generation.eos_token_id == [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(ENDOFTEXT)]
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] > ids["input_ids"].shape[1]


def test_chat_model_loads_in_vllm(engine_pool, tiny_chat_model_dir):
    """vLLM's tokenizer (the engine's own) renders and encodes the conversation exactly as transformers does,
    and the engine generates from those token ids. A warm engine of the session's pool on the chat model (CHAT_CONFIG:
    it also runs test_multiturn's environment, which `generate` never touches)."""
    import ray
    from transformers import AutoTokenizer

    with engine_pool.lease(tiny_chat_model_dir, config=CHAT_CONFIG) as (engine,):
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actor cannot import this test module
        ids, eos = ray.get(engine.__ray_call__.remote(_render_in_the_engine, CHAT))
        (rollout,) = ray.get(engine.generate.remote([ids], 1, seeds=[0], max_new_tokens=8))
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model_dir)
    assert ids == tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert eos == tokenizer.eos_token_id
    assert rollout.prompt_ids == ids and 1 <= len(rollout.completions[0].token_ids) <= 8


def _render_in_the_engine(worker, conversation: list) -> tuple[list[int], int]:
    """Inside the rollout actor (Ray's __ray_call__; pickled by value): vLLM's tokenizer renders and encodes."""
    tok = worker.llm.get_tokenizer()
    text = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False), tok.eos_token_id
