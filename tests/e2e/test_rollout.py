"""RolloutWorker in Ray with a real vLLM engine on the tiny model.

Two warm engines leased from the session's pool (tests/e2e/engine_pool.py) for the whole module: `skip` handles
over-long prompts by skipping them, `strict` by raising. `strict` also has a stop string that never occurs
(NEVER), which turns vLLM's own detokenizing on without changing a sampled token: the two engines then also
serve the fast-text-path check on the tiny model (test_text_without_stop_strings_is_vllms_own), and the tests
that compare their samples (across engines, a shared batch) still see the same tokens. Those are call-time
settings (engine_pool.CALL_TIME_FIELDS), set on the pooled engines and put back by the pool at the module's end.
"""
from __future__ import annotations

import dataclasses
import sys

import pytest
from engine_pool import CHAT_CONFIG

from actors.completions import split_evenly
from cluster.models.tinymodel import build_tokenizer

EOS = 1  # cluster/models/tinymodel.py
MAX_NEW = 16
PROMPTS = ["1+2=", "3+4=", "10+20=", "7*8=", "99-9="]
NEVER = "\x07never\x07"  # a stop string the samples here never hold (BEL is no character of the tiny vocabulary)


@pytest.fixture(scope="module")
def workers(engine_pool, tiny_model_dir):
    import ray

    with engine_pool.lease(tiny_model_dir, 2) as (skip, strict):
        engine_pool.configure(skip, max_new_tokens=MAX_NEW, long_prompt="skip")
        engine_pool.configure(strict, max_new_tokens=MAX_NEW, long_prompt="error", stop=[NEVER])
        yield ray, skip, strict


def test_split_evenly():
    assert split_evenly(list(range(5)), 2) == [[0, 1, 2], [3, 4]]
    assert split_evenly(list(range(4)), 4) == [[0], [1], [2], [3]]
    assert split_evenly([1], 3) == [[1], [], []]
    chunks = split_evenly(list(range(11)), 3)
    assert [len(c) for c in chunks] == [4, 4, 3] and sum(chunks, []) == list(range(11))
    with pytest.raises(ValueError):
        split_evenly([1], 0)


def test_group_of_completions(workers):
    tokenizer = build_tokenizer()
    ray, skip, _ = workers
    rollouts = ray.get(skip.generate.remote(PROMPTS, 4, seeds=list(range(len(PROMPTS)))))
    assert [r.prompt for r in rollouts] == PROMPTS
    for r in rollouts:
        assert r.skipped is None and r.weight_version == 0
        assert r.prompt_ids == tokenizer.convert_tokens_to_ids(list(r.prompt))  # char-level
        assert len(r.completions) == 4
        for c in r.completions:
            assert 1 <= len(c.token_ids) <= MAX_NEW
            assert len(c.logprobs) == len(c.token_ids)
            assert all(lp <= 0.0 for lp in c.logprobs)
            assert c.finish_reason in ("stop", "length")
            if c.finish_reason == "length":
                assert len(c.token_ids) == MAX_NEW
            else:
                assert c.token_ids[-1] == EOS
            assert isinstance(c.text, str)


def test_behaviour_logprobs_are_the_engines_own(workers):
    """The sampled tokens' log-probs equal the engine's log-probs of the same sequence."""
    ray, skip, _ = workers
    (r,) = ray.get(skip.generate.remote(["12+30="], 3, seeds=[7]))
    seqs = [r.prompt_ids + c.token_ids for c in r.completions]
    scored = ray.get(skip.prompt_logprobs.remote(seqs))
    for c, lps in zip(r.completions, scored):
        tail = lps[len(r.prompt_ids) - 1:]
        assert max(abs(a - b) for a, b in zip(c.logprobs, tail)) <= 1e-4


def test_seeds_reproduce(workers):
    ray, skip, _ = workers
    seeds = [11, 12, 13, 14, 15]
    a = ray.get(skip.generate.remote(PROMPTS, 3, seeds=seeds))
    b = ray.get(skip.generate.remote(PROMPTS, 3, seeds=seeds))
    c = ray.get(skip.generate.remote(PROMPTS, 3, seeds=[s + 100 for s in seeds]))
    ids = lambda rs: [[x.token_ids for x in r.completions] for r in rs]  # noqa: E731
    assert ids(a) == ids(b)
    assert [[x.logprobs for x in r.completions] for r in a] == [[x.logprobs for x in r.completions] for r in b]
    assert ids(a) != ids(c)
    # The G samples of one request differ from each other (not G copies of one seed).
    assert any(len({tuple(x.token_ids) for x in r.completions}) > 1 for r in a)


def test_seeds_reproduce_across_engines(workers):
    """Another engine process (as after a restart or a resume) gives the same samples."""
    ray, skip, strict = workers
    seeds = [21, 22, 23, 24, 25]
    a, b = ray.get([w.generate.remote(PROMPTS, 3, seeds=seeds) for w in (skip, strict)])
    assert [[x.token_ids for x in r.completions] for r in a] == [[x.token_ids for x in r.completions] for r in b]


def test_greedy_and_max_new_tokens(workers):
    ray, skip, _ = workers
    (r,) = ray.get(skip.generate.remote(["5+5="], 3, greedy=True, max_new_tokens=4))
    assert len({tuple(c.token_ids) for c in r.completions}) == 1
    assert all(len(c.token_ids) <= 4 for c in r.completions)


def test_long_prompt_skipped_and_reported(workers):
    ray, skip, _ = workers
    long = "1+" * 248 + "1="  # 498 tokens > 512 - 16 (the pool's max_model_len: engine_pool.POOL_CONFIG)
    rollouts = ray.get(skip.generate.remote(["1+1=", long, "2+2="], 2, seeds=[1, 2, 3]))
    assert rollouts[1].skipped == "prompt is 498 tokens, limit 496 (max_model_len 512 - max_new_tokens 16)"
    assert rollouts[1].completions == []
    assert rollouts[0].skipped is None and len(rollouts[0].completions) == 2
    assert len(rollouts[2].completions) == 2
    # With a smaller max_new_tokens the same prompt fits.
    (fits,) = ray.get(skip.generate.remote([long], 1, max_new_tokens=4))
    assert fits.skipped is None


def test_long_prompt_error_mode(workers):
    ray, _, strict = workers
    long = "1+" * 248 + "1="
    with pytest.raises(ValueError, match=r"prompt 1: prompt is 498 tokens, limit 496"):
        ray.get(strict.generate.remote(["1+1=", long], 2))
    # The engine survived and still serves.
    (r,) = ray.get(strict.generate.remote(["1+1="], 2, seeds=[0]))
    assert len(r.completions) == 2


def test_two_workers_share_a_batch(workers):
    ray, skip, strict = workers
    prompts = [f"{i}+{i}=" for i in range(7)]
    seeds = list(range(100, 107))
    parts = split_evenly(list(zip(prompts, seeds)), 2)
    futures = [w.generate.remote([p for p, _ in part], 2, seeds=[s for _, s in part])
               for w, part in zip((skip, strict), parts)]
    merged = [r for chunk in ray.get(futures) for r in chunk]
    assert [r.prompt for r in merged] == prompts
    assert all(len(r.completions) == 2 for r in merged)
    infos = ray.get([skip.info.remote(), strict.info.remote()])
    assert infos[0]["worker_index"] != infos[1]["worker_index"]
    assert infos[0]["pid"] != infos[1]["pid"]
    assert all(i["node_id"] and i["weight_version"] == 0 for i in infos)


def test_seeded_batch_larger_than_one_engine_step(workers):
    """More prompt tokens than vLLM's CPU step budget (4096): with chunked prefill a seeded request
    split across steps crashed vLLM 0.32's CPU runner ("CPU Generator does not use offset")."""
    ray, skip, _ = workers
    prompts = [f"{i:02d}+" + "1+" * 49 + "1=" for i in range(12)]  # 103 tokens each, x G=4: 4944 prefill tokens
    rollouts = ray.get(skip.generate.remote(prompts, 4, seeds=list(range(12)), max_new_tokens=4))
    assert [len(r.prompt_ids) for r in rollouts] == [103] * 12
    assert all(len(r.completions) == 4 and not r.skipped for r in rollouts)


def test_min_new_tokens_keeps_sampling_past_eos(workers, engine_pool):
    """rollout.min_new_tokens: no sampled completion ends before it (vLLM min_tokens masks EOS);
    greedy calls are not affected. Same prompts and seeds as a worker without it, which does stop
    early (the random tiny model emits EOS now and then: 19 of 40 samples within 64 tokens). The worker
    with it is the module's second engine, set so for this test only (a call-time setting)."""
    ray, skip, strict = workers

    n = 64
    with engine_pool.configured(strict, max_new_tokens=n, min_new_tokens=n) as w:
        seeds = list(range(len(PROMPTS)))
        free, held = ray.get([x.generate.remote(PROMPTS, 8, seeds=seeds, max_new_tokens=n) for x in (skip, w)])
        assert any(c.finish_reason == "stop" and len(c.token_ids) < n for r in free for c in r.completions)
        for r in held:
            for c in r.completions:
                assert len(c.token_ids) == n and c.finish_reason == "length" and EOS not in c.token_ids
        greedy = ray.get([x.generate.remote(PROMPTS, 1, greedy=True, max_new_tokens=n) for x in (skip, w)])  # unchanged
        assert [r.completions[0].token_ids for r in greedy[0]] == [r.completions[0].token_ids for r in greedy[1]]


def _sample_texts(worker):
    """The samples `_text_paths_agree` compares, as a Ray reference."""
    return worker.generate.remote(["1+2=", "hello", "10+20=", "what is 7*8?"], 6, seeds=[11, 12, 13, 14], max_new_tokens=48)


def _text_paths_agree(a: list, b: list, char_level: bool) -> None:
    """`a` sampled with no stop strings and `b` with a stop string that never occurs, for the same seeds
    (_sample_texts): the same tokens; their texts must agree as test_text_without_stop_strings_is_vllms_own says."""
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra.completions, rb.completions)]
    assert all(x.token_ids == y.token_ids and x.logprobs == y.logprobs for x, y in pairs)
    for x, y in pairs:
        assert x.text == y.text or (x.text.startswith(y.text) and set(x.text[len(y.text):]) == {"\ufffd"}), \
            (x.text, y.text)
    assert sum(x.text == y.text for x, y in pairs) >= len(pairs) // 2
    if char_level:  # no character spans two tokens, so always the same
        assert [x.text for x, _ in pairs] == [y.text for _, y in pairs]
    assert sum(len(x.text) for x, _ in pairs) > 100  # real text was compared, not empty strings


def test_text_without_stop_strings_is_vllms_own(workers):
    """Without stop strings the engine skips its per-step detokenizing and the worker decodes the
    final ids once (actors/rollout.py): the text must be what vLLM's detokenizer gives, except that a
    completion ending inside a UTF-8 character shows it as U+FFFD (as TRL's and verl's batch decode
    do) where vLLM's streaming detokenizer leaves it out. A stop string that never occurs (the module's
    `strict` engine) turns vLLM's detokenizing back on, for the same seeds and so the same tokens.
    The tiny model is char-level: the texts are always the same."""
    ray, skip, strict = workers
    _text_paths_agree(*ray.get([_sample_texts(skip), _sample_texts(strict)]), char_level=True)


def test_text_without_stop_strings_is_vllms_own_chat_model(engine_pool, tiny_chat_model_dir):
    """As above on the chat model, byte-level BPE at random weights: split UTF-8 sequences and special
    tokens. One pooled engine on the chat model samples both ways, one after the other (the same seeds give
    the same tokens on one engine: test_seeds_reproduce). The pool's chat-model engine (CHAT_CONFIG: it also
    runs test_multiturn's environment, which `generate` never touches)."""
    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # _stop_at: the actor cannot import this module
    with engine_pool.lease(tiny_chat_model_dir, config=CHAT_CONFIG) as (engine,):
        fast = ray.get(_sample_texts(engine))
        before = ray.get(engine.__ray_call__.remote(_stop_at, [NEVER]))
        vllm_text = ray.get(_sample_texts(engine))
        assert ray.get(engine.__ray_call__.remote(_stop_at, before)) == [NEVER]
    _text_paths_agree(fast, vllm_text, char_level=False)


def _stop_at(worker, stop: list[str]) -> list[str]:
    """Inside the actor (Ray's __ray_call__): its rollout.stop set to `stop`; the one before. Set directly, not by the
    pool's `configure`: that refuses a stop string on an engine with an environment (a multi-turn turn must end at
    the template's end-of-turn token), but `generate` reads only the stop strings; the pool puts the engine's config
    back when it is given back."""
    before, worker.cfg = list(worker.cfg.stop), dataclasses.replace(worker.cfg, stop=stop)
    return before
