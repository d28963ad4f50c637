"""Fixed-length sampling as OAI does it: plain categorical sampling from softmax(logits / T).

No top-k, no nucleus (top_k=0, top_p=1), and no stop at EOS: every response has exactly
`response_length` tokens (# OAI: lm_human_preferences/language/sample.py#L43,
# OAI: lm_human_preferences/policy.py#L103).
A decode loop of our own with the model's KV cache, rather than `generate`, so that these
semantics (and the position ids of left-padded queries) are explicit and cannot drift.
"""

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from .data import QuerySampler
from .models import masked_inputs, temperature_log_softmax


@torch.no_grad()
def sample_responses(
    lm: torch.nn.Module,
    queries: torch.Tensor,
    pad_id: int,
    response_length: int,
    temperature: float,
    generator: torch.Generator | None = None,
    vocab_size: int | None = None,
    on_token: Callable[[int], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample `response_length` tokens after left-padded `queries` (B, Q).

    `vocab_size`: only the tokenizer's ids are sampled, never the extra rows of a padded embedding
    table (# OAI: lm_human_preferences/policy.py#L59, logits sliced to n_vocab).
    `on_token`: called with the number of tokens sampled so far after each one (a progress bar's hook).
    Returns responses (B, R) and their logprobs under softmax(logits / temperature) (B, R).
    """
    inputs = masked_inputs(queries, pad_id)
    mask = inputs["attention_mask"]
    next_position = mask.sum(dim=1, keepdim=True)  # (B, 1): real tokens so far
    out = lm(**inputs, use_cache=True, logits_to_keep=1)  # the queries' other positions predict nothing we sample
    tokens, logprobs = [], []
    for step in range(response_length):
        # OAI: lm_human_preferences/policy.py#L121
        log_probs = temperature_log_softmax(out.logits[:, -1, :vocab_size], temperature)  # (B, V)
        token = torch.multinomial(log_probs.exp(), 1, generator=generator)  # (B, 1)
        tokens.append(token)
        logprobs.append(torch.gather(log_probs, 1, token))
        if on_token is not None:
            on_token(step + 1)
        if step + 1 == response_length:
            break
        mask = torch.cat([mask, torch.ones_like(token)], dim=1)
        out = lm(input_ids=token, attention_mask=mask, position_ids=next_position, cache=out.cache, use_cache=True)
        next_position = next_position + 1
    return torch.cat(tokens, dim=1), torch.cat(logprobs, dim=1)


@dataclass(frozen=True)
class StageHooks:
    """Where a stage script's queries, responses and shuffles come from, and a look at the model after each
    update. The defaults are the stage's own (OAI's behaviour); a replay of OAI's own run
    (tests/replays/oai_replay) passes the queries, responses and permutations that OAI drew."""

    query_sampler: Callable[..., Iterator[torch.Tensor]] = QuerySampler
    """called as `QuerySampler(task, tokenizer, batch_size=, seed=, rank=, world_size=)`; the stages use its `next`,
    `batch_size`, `batches_drawn` and (on resume) `skip`"""
    sample: Callable[..., tuple[torch.Tensor, torch.Tensor]] = sample_responses
    """called as `sample_responses`"""
    permutation: Callable[..., torch.Tensor] = torch.randperm
    """called as `torch.randperm(n, generator=)` or `torch.randperm(n, device=)`"""
    after_update: Callable[[int, torch.nn.Module], None] = lambda update, model: None
    """called with the update's number (from 1) and the model after it: stage 1's optimizer step on a batch of
    labels, stage 2's epochs on a batch of rollouts"""
