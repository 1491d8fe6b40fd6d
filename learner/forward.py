"""One micro-batch through the model being trained: the log-probs of its completion tokens, and
where a rank checks for lent threads (at every transformer block, forward and backward)."""
from __future__ import annotations

from collections.abc import Callable

import torch

from learner import grpo
from learner.batch import MicroBatch
from learner.packing import packed_completion_logits
from learner.sequences import logits_to_keep, shared_prompt_logits


def completion_logits(model, mb: MicroBatch, device, share_prompts: bool,
                      pack: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [n, C, V], token ids [n, C]): row j of a sequence scores its completion token j.

    With `share_prompts`, where it saves work, the rows of one prompt share its forward pass
    (learner/sequences.py; raises PromptSharingUnsupported for a cache that cannot be shared);
    else one pass per sequence: with `pack` (learner.pack_sequences) the sequences concatenated in one row
    without padding (learner/packing.py), else right-padded; the log-softmax then taken over the completion
    positions only."""
    if share_prompts and mb.shared.saves_work():
        return shared_prompt_logits(model, mb.shared, device), mb.shared.completion_ids.to(device)
    if pack:
        logits = packed_completion_logits(model, mb.input_ids, mb.attention_mask, mb.comp_index, device)
        return logits, mb.input_ids[:, 1:].to(device).gather(1, mb.comp_index.to(device))
    width = mb.input_ids.shape[1]
    # Logits from the first completion position on (row t scores token t+1): the prompts' are never read.
    keep = logits_to_keep(model, width - int(mb.comp_index[:, 0].min()))
    logits = model(input_ids=mb.input_ids.to(device), attention_mask=mb.attention_mask.to(device),
                   position_ids=mb.position_ids.to(device), use_cache=False, **keep).logits
    index = mb.comp_index.to(device)
    # padding's index 0 would fall before the kept positions: it points anywhere, its loss is masked out
    at = (index - (width - logits.shape[1])).clamp(min=0)
    picked = logits.gather(1, at.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
    return picked, mb.input_ids[:, 1:].to(device).gather(1, index)


def logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool):
    """log pi(token) [n, C] (differentiable), and the entropy [n, C] of each position if asked (no grad)."""
    logp = grpo.token_logprobs(logits, targets)
    if not with_entropy:
        return logp, None
    with torch.no_grad():
        return logp, grpo.entropy_from_logits(logits.detach())


def model_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated transformer blocks: the classes transformers lists in `_no_split_modules`
    (what must stay on one device: Qwen2DecoderLayer, GPT2Block, GPTNeoXLayer, ...), found on the
    model or any module inside it (a peft wrapper); failing that, classes named *DecoderLayer."""
    names = {n for m in model.modules() for n in (getattr(m, "_no_split_modules", None) or [])}
    return [m for m in model.modules() if type(m).__name__ in names] or \
        [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


def call_at_every_block(model: torch.nn.Module, check: Callable[[], None]) -> None:
    """Call `check` after every block's forward and before its backward: a micro-batch of a mid-size
    model takes a good part of a second on CPU, too long to wait for lent threads."""
    def after_forward(module, args, output):
        check()
        hidden = output[0] if isinstance(output, tuple) else output
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(lambda grad: check())  # CPU backward runs on this thread

    for block in model_blocks(model):
        block.register_forward_hook(after_forward)
