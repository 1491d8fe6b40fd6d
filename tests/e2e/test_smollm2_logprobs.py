"""Log-probs on a real pretrained model (issue 38), SmolLM2-135M-Instruct (tests/conftest.py
`smollm2_dir`): a vLLM engine (RolloutWorker), a DeepSpeed learner rank and transformers agree on
the log-prob of every token of chat transcripts to 1e-4 in float32, before and after an update
that moves them by far more; prompt sharing (the G completions of a prompt sharing its forward
pass, learner/sequences.py) gives the same numbers on this Llama (GQA, RoPE); and the engine's
output layer, tied to its input embedding, is read back as the engine computes logits with it
(through vLLM-CPU's packed GEMM copy, which raygrpo rebuilds after each update) and equals the
learner's embedding after the update.

One engine, one rank and one transformers model, shared by the module's tests (real Ray, vLLM,
DeepSpeed; no CLI: a user never compares these numbers, the training run relies on them).
"""
from __future__ import annotations

import sys

import pytest
import torch
from hf_logprobs import chat, hf_logprobs, max_diff
from learner_ranks import on_all, start_ranks, stop

from actors.config import RolloutConfig
from actors.rollout import RolloutWorker
from learner.batch import TrainBatch
from learner.config import AlgoConfig, LearnerConfig
from learner.grpo import token_logprobs
from learner.sequences import pack_shared, shared_prompt_logits

pytestmark = pytest.mark.timeout(1500)
TOL = 1e-4  # float32 everywhere
EMBED = "model.embed_tokens.weight"
COLUMNS = [0, 1, 97, 300, 575]  # of the 576 hidden dimensions: the output layer's weights read back


def output_layer_columns(rollout_worker, columns: list[int]) -> list[dict]:
    """Runs in the RolloutWorker's process (`__ray_call__`), and from there inside every vLLM
    worker: the columns `columns` of the output layer's weight [vocab, hidden] as the engine
    computes logits with it, i.e. vLLM's own lm_head GEMM (`quant_method.apply`, as its
    LogitsProcessor calls it) applied to one-hot hidden states; and whether the head is tied."""
    def read(worker):
        model = worker.get_model()
        head = model.lm_head
        probe = torch.zeros(len(columns), head.weight.shape[1], dtype=head.weight.dtype)
        probe[torch.arange(len(columns)), torch.tensor(columns)] = 1
        with torch.no_grad():
            logits = head.quant_method.apply(head, probe)
        return {"columns": logits.T.contiguous(), "tied": head.weight is model.model.embed_tokens.weight,
                "packed": hasattr(head, "cpu_linear")}

    return rollout_worker.llm.collective_rpc(read)


@pytest.fixture(scope="module")
def parts(ray_cluster, smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ray = ray_cluster
    # output_layer_columns travels to the engine's process by value: this test module is not importable there
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    rollout = ray.remote(num_cpus=0.5)(RolloutWorker).remote(
        str(smollm2_dir), RolloutConfig(max_model_len=256, max_new_tokens=8, cpu_kv_cache_mb=64))
    # A large LR so that one step moves the log-probs far beyond the tolerance.
    ranks = start_ranks(ray, smollm2_dir, LearnerConfig(num_ranks=1, zero_stage=2, lr=2e-4, micro_batch_size=4),
                        AlgoConfig())
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    prompts = [chat(tokenizer, "What is 2 + 3?"), chat(tokenizer, "Name a colour of the sky.")]
    answers = [["2 + 3 = 5\n#### 5", "It is 5."], ["Blue.", "The sky is blue on a clear day."]]
    # every transcript, as the template renders it with the answer, starts with its prompt
    questions = ("What is 2 + 3?", "Name a colour of the sky.")
    transcripts = [(p, chat(tokenizer, q, a)) for p, q, group in zip(prompts, questions, answers) for a in group]
    assert all(t[:len(p)] == p for p, t in transcripts)  # each transcript continues its prompt token for token
    completions = [t[len(p):] for p, t in transcripts]
    prompt_ids = [p for p in prompts for _ in range(2)]
    yield ray, rollout, ranks, model, prompt_ids, completions
    stop(ray, ranks)
    ray.kill(rollout)


def test_engine_learner_and_transformers_agree_before_and_after_an_update(parts):
    ray, rollout, ranks, model, prompt_ids, completions = parts
    seqs = [p + c for p, c in zip(prompt_ids, completions)]
    engine0 = ray.get(rollout.prompt_logprobs.remote(seqs))
    learner0 = on_all(ray, ranks, "sequence_logprobs", seqs)
    hf0 = hf_logprobs(model, seqs)
    assert max_diff(engine0, hf0) < TOL and max_diff(learner0, hf0) < TOL, (max_diff(engine0, hf0), max_diff(learner0, hf0))
    layer0 = ray.get(rollout.__ray_call__.remote(output_layer_columns, COLUMNS))
    assert all(w["tied"] for w in layer0)  # vLLM ties the LM head to the embedding: one tensor in the engine
    assert all(torch.equal(w["columns"], model.model.embed_tokens.weight[:, COLUMNS].detach()) for w in layer0)

    # One GRPO step on the transcripts' answers (their vLLM log-probs as the behaviour policy), then the sync.
    behaviour = [lp[len(p) - 1:] for lp, p in zip(engine0, prompt_ids)]
    batch = TrainBatch(prompt_ids=prompt_ids, completion_ids=completions, advantages=[1.0, -1.0, -1.0, 1.0],
                       behavior_logp=behaviour, pad_id=model.config.pad_token_id or 0)
    assert not on_all(ray, ranks, "train_step", batch)["skipped"]
    ray.get([w.init_weight_sync.remote([rollout], {"backend": "gloo", "master_address": "127.0.0.1", "master_port": 0,
                                                   "world_size": 2, "bucket_bytes": 64 << 20, "timeout_s": 300})
             for w in ranks])
    sent = on_all(ray, ranks, "sync_weights", 1)
    assert sent["verified"] and sent["bytes"] == 4 * sum(p.numel() for p in model.parameters())  # tied: counted once

    state = on_all(ray, ranks, "full_state_dict")
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # tied to the embedding
    engine1 = ray.get(rollout.prompt_logprobs.remote(seqs))
    learner1 = on_all(ray, ranks, "sequence_logprobs", seqs)
    hf1 = hf_logprobs(model, seqs)
    assert max_diff(engine1, hf1) < TOL and max_diff(learner1, hf1) < TOL, (max_diff(engine1, hf1), max_diff(learner1, hf1))
    assert max_diff(engine1, engine0) > 100 * TOL  # the update moved them, and the engine has it

    # The engine's output layer, as it computes logits, is the learner's updated embedding.
    layer1 = ray.get(rollout.__ray_call__.remote(output_layer_columns, COLUMNS))
    want = state[EMBED][:, COLUMNS]
    assert not torch.equal(want, layer0[0]["columns"])
    for w in layer1:
        assert (w["columns"] - want).abs().max() <= 1e-6, (w["packed"], (w["columns"] - want).abs().max())


def test_prompt_sharing_gives_the_same_logprobs_on_this_model(parts):
    """The completions of a prompt sharing its forward pass (a KV cache of the prompt, expanded per
    completion over GQA's 3 KV heads; what the learner and the reference compute under ZeRO-0/1/2)
    give transformers' plain per-sequence log-probs within 1e-4 on this model."""
    _, _, _, model, prompt_ids, completions = parts
    sp = pack_shared(prompt_ids, completions, pad_id=model.config.pad_token_id or 0)
    assert sp.saves_work()  # 2 prompts for 4 rows: the shared path is the one taken, not a fallback
    with torch.no_grad():
        logits = shared_prompt_logits(model, sp, torch.device("cpu"))  # raises PromptSharingUnsupported otherwise
        shared = token_logprobs(logits, sp.completion_ids)
    plain = [lp[len(p) - 1:] for lp, p in zip(hf_logprobs(model, [p + c for p, c in zip(prompt_ids, completions)]),
                                              prompt_ids)]
    assert max_diff([row[:len(c)].tolist() for row, c in zip(shared, completions)], plain) < TOL
