"""What cluster/models/tinymodel.py writes loads and generates in transformers and in stock vLLM.

(DeepSpeed loading is covered by the learner's tests, which initialise it anyway.)
"""
from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch

from actors.runtime.start_ledger import ENGINE, record_start
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


def test_vllm_loads_and_generates(stock_vllm):
    texts = stock_vllm["tiny"]
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts)
    assert any(texts)  # random weights, but 8 sampled characters are not all EOS


CHAT = [{"role": "system", "content": "Solve the problem."},
        {"role": "user", "content": "Tom has 3 apples and gets 4 more. How many apples does Tom have now?"}]


@pytest.fixture(scope="module")
def stock_vllm(ray_cluster, tiny_model_dir, tiny_chat_model_dir):
    """Both models in stock vllm.LLM, one after the other in ONE Ray task (one `import vllm`, the
    larger part of an engine's start here): the tiny model generates from two text prompts; the
    chat model's tokenizer renders and encodes CHAT and the engine generates from those ids. The
    first LLM is deleted, and must be collected, before the second is built."""
    import ray

    def _vllm_both(tiny_dir: str, chat_dir: str, conversation: list) -> dict:
        """Runs inside a Ray task (nested: pickled by value): stock vllm.LLM, in-process engine, no RolloutWorker."""
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        record_start(ENGINE, how="vllm.LLM in a test")  # the suite's cost file (tests/suite_costs.py)
        llm = LLM(model=tiny_dir, dtype="float32", max_model_len=64, kv_cache_memory_bytes=16 << 20,
                  enforce_eager=True, seed=0)
        outs = llm.generate(["12+34=", "7*8="], SamplingParams(max_tokens=8, temperature=1.0, seed=0), use_tqdm=False)
        tiny = [o.outputs[0].text for o in outs]
        first = weakref.ref(llm)
        del llm, outs
        gc.collect()
        if first() is not None:  # the chat check must not run beside the tiny model's engine
            raise RuntimeError("the first vllm.LLM was not collected after `del`")

        record_start(ENGINE, how="vllm.LLM in a test")
        llm = LLM(model=chat_dir, dtype="float32", max_model_len=128, kv_cache_memory_bytes=16 << 20,
                  enforce_eager=True, seed=0)
        tok = llm.get_tokenizer()
        text = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        ids = tok.encode(text, add_special_tokens=False)
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=8, seed=0), use_tqdm=False)
        return {"tiny": tiny, "chat": (ids, tok.eos_token_id, list(out[0].outputs[0].token_ids))}

    # max_calls=1: the worker process exits afterwards instead of serving later tasks with an engine's
    # leftovers (env vars, torch thread settings).
    task = ray.remote(num_cpus=0.5, max_calls=1)(_vllm_both)
    return ray.get(task.remote(str(tiny_model_dir), str(tiny_chat_model_dir), CHAT))


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


def test_chat_model_loads_in_vllm(stock_vllm, tiny_chat_model_dir):
    """vLLM's tokenizer renders and encodes the conversation exactly as transformers does, and
    the engine generates from those token ids."""
    from transformers import AutoTokenizer

    ids, eos, generated = stock_vllm["chat"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model_dir)
    assert ids == tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert eos == tokenizer.eos_token_id
    assert 1 <= len(generated) <= 8
