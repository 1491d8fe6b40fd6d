"""Pure parts of the learner (no Ray, no DeepSpeed; fast): batch sharding and padding, the LR schedule.
They live beside the learner e2e tests they support; nothing here starts a process."""
from __future__ import annotations

import pytest
import torch

from learner.batch import TrainBatch
from learner.config import AlgoConfig
from learner.grpo import LossInputs, policy_loss
from learner.rank_setup import lr_factor
from learner.sequences import micro_batch_order, slots


def _batch():
    return TrainBatch(prompt_ids=[[5, 6], [7], [8, 9, 10], [11]], completion_ids=[[1, 2, 3], [4], [], [12, 13]],
                      advantages=[0.5, -1.0, 0.0, 2.0], behavior_logp=[[-1.0, -2.0, -3.0], [-4.0], [], [-5.0, -6.0]],
                      pad_id=0)


def test_micro_batch_layout_right_pads_and_indexes_completion_tokens():
    mb = _batch().micro_batches(2)[0]
    assert mb.input_ids.tolist() == [[5, 6, 1, 2, 3], [7, 4, 0, 0, 0]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4]] * 2
    # log-prob row t scores token t+1: completion token j of a prompt of length P is at P-1+j
    assert mb.comp_index.tolist() == [[1, 2, 3], [0, 0, 0]]
    assert mb.mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert mb.behavior_logp.tolist() == [[-1, -2, -3], [-4, 0, 0]]
    empty = _batch().micro_batches(2)[1]  # an empty completion is all padding, never a token
    assert empty.mask.tolist() == [[0, 0], [1, 1]]


def test_micro_batches_by_length_group_similar_lengths_and_keep_every_sequence():
    b = _batch()  # lengths 5, 2, 3, 3
    mbs = b.micro_batches(2, by_length=True)
    assert [mb.input_ids.shape[1] for mb in mbs] == [3, 5]  # 2 and 3 together, then 3 and 5
    assert mbs[0].input_ids.tolist() == [[7, 4, 0], [8, 9, 10]]
    assert mbs[1].input_ids.tolist() == [[11, 12, 13, 0, 0], [5, 6, 1, 2, 3]]
    # every sequence once, with its own advantage and log-probs
    assert sorted(a for mb in mbs for a in mb.advantages.tolist()) == sorted(b.advantages)
    assert mbs[1].behavior_logp.tolist() == [[-5, -6, 0], [-1, -2, -3]]


def test_micro_batches_keep_a_prompts_rows_together_and_lay_them_out_for_sharing():
    """Two groups of G=3, completions of mixed lengths. Token slots per order (micro-batches of 3): by
    total length 9 + 15, completions by length 9 + 15, each group together 8 + 12: that order wins, and
    a micro-batch's shared layout holds its prompt once, the completions after it, positions continuing."""
    b = TrainBatch(prompt_ids=[[1, 2, 3]] * 3 + [[4, 5]] * 3, completion_ids=[[6], [7, 8, 9], [10, 11], [12, 13], [14], [15]],
                   advantages=[0.0] * 6, behavior_logp=[[-1.0] * n for n in (1, 3, 2, 2, 1, 1)], pad_id=0)
    first, second = b.micro_batches(3, by_length=True, share_prompts=True)
    assert first.input_ids[:, :2].tolist() == [[4, 5]] * 3 and second.input_ids[:, :3].tolist() == [[1, 2, 3]] * 3
    sp = second.shared
    assert sp.prompt_ids.tolist() == [[1, 2, 3]] and sp.prompt_last.tolist() == [2] and sp.saves_work()
    assert sp.row_prompt.tolist() == [0, 0, 0]
    assert sp.completion_ids.tolist() == [[6, 0, 0], [10, 11, 0], [7, 8, 9]]  # completions by length
    assert sp.completion_mask.tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert sp.completion_pos.tolist() == [[3, 4, 5]] * 3
    # the shared layout's completions line up with the one-pass-per-sequence fields
    assert second.mask.tolist() == sp.completion_mask.float().tolist()
    assert not b.micro_batches(1)[0].shared.saves_work()  # one row: nothing to share
    # without sharing, the order is by total length (4, 6, 5 | 4, 3, 3)
    assert [len(r) for r in b.micro_batches(3, by_length=True)[0].input_ids.tolist()] == [4, 4, 4]


def test_the_order_with_fewer_slots_wins_when_completions_vary_more_than_prompts():
    """Short prompts, completions of very different lengths within each group (as when some answers
    run to max_new_tokens): completions by length pads least, prompts are still shared where rows of
    one prompt meet."""
    prompts = [[1, 2]] * 4 + [[3, 4]] * 4
    comps = [[5] * n for n in (1, 8, 1, 8, 1, 8, 1, 8)]
    order = micro_batch_order(prompts, comps, 4, share=True)
    assert [len(comps[i]) for i in order] == [1, 1, 1, 1, 8, 8, 8, 8]
    cost = sum(slots(prompts, comps, order[s:s + 4], True) for s in (0, 4))
    assert cost == (2 * 2 + 4 * 1) + (2 * 2 + 4 * 8)  # two prompts once each, per micro-batch
    alternating = TrainBatch(prompt_ids=[[1, 2], [3], [4, 5], [6]], completion_ids=[[7, 8, 9], [1], [2, 3, 4], [5]],
                             advantages=[1.0, 0.0, -1.0, 0.5], behavior_logp=[[-1.0] * 3, [-1.0], [-1.0] * 3, [-1.0]])
    cells = [sum(mb.input_ids.numel() for mb in alternating.micro_batches(2, by_length=flag)) for flag in (False, True)]
    assert cells == [20, 14]  # lengths 5, 2, 5, 2: (5, 2) (5, 2) pads to 2 x 5 twice; (2, 2) (5, 5) does not


def test_shards_are_contiguous_and_must_divide():
    b = _batch()
    assert b.shard(1, 2).prompt_ids == [[8, 9, 10], [11]]
    with pytest.raises(ValueError, match="does not split evenly over 3 learner ranks"):
        b.shard(0, 3)


def test_validate_names_the_mismatch():
    b = _batch()
    b.behavior_logp[3] = [-1.0]
    with pytest.raises(ValueError, match="sequence 3: 2 completion tokens but 1 behavior_logp"):
        b.validate()


@pytest.mark.parametrize("schedule,expected", [
    ("constant", [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]),
    ("linear", [0.5, 1.0, 1.0, 2 / 3, 1 / 3, 0.0]),
    ("cosine", [0.5, 1.0, 1.0, 0.75, 0.25, 0.0]),
])
def test_lr_schedule(schedule, expected):
    """Warm-up never spends an update at LR 0; the decay reaches 0 at `total` (after the last update)."""
    got = [lr_factor(u, warmup=2, total=5, schedule=schedule) for u in range(6)]
    assert got == pytest.approx(expected)


def test_an_all_masked_sequence_is_not_trained_on_and_not_counted():
    """An unscorable sample reaches the learner with a loss mask of 0s: no tokens, not one of the N sequences."""
    b = _batch()
    b.loss_mask = [[1, 1, 1], [0], [], [1, 1]]
    assert b.num_trained_sequences() == 2 and b.num_completion_tokens() == 5
    assert TrainBatch(**{**b.__dict__, "loss_mask": None}).num_trained_sequences() == 4
    # seq-mean-token-mean over the batch with it equals the batch without it
    algo = AlgoConfig(aggregation="seq-mean-token-mean", tis_cap=None)
    logp = torch.tensor([[-1.0, -0.5, -2.0], [-3.0, 0.0, 0.0], [-0.7, -0.1, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [0, 0, 0], [1, 1, 0]])
    adv = torch.tensor([1.0, 5.0, -1.0])
    with_it, _ = policy_loss(LossInputs(logp, logp.detach(), adv, mask, num_seqs=2), algo)
    without, _ = policy_loss(LossInputs(logp[[0, 2]], logp.detach()[[0, 2]], adv[[0, 2]], mask[[0, 2]]), algo)
    assert torch.allclose(with_it, without)
