"""The replies of the GRPO pipeline contract's completions (`http_contract`): each choice's text, token ids, logprobs
and weight versions, in OpenAI's completion and chat forms, the usage, and the server-sent events of a streamed
reply (a chunk per choice and engine step); stop strings, and the text a stream holds back for them.

The standard library, aiohttp and `grpo.protocol` only: it imports in the vLLM environment.
"""

import collections
import contextlib
import http
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from aiohttp import web

from lm_human_preference_details.grpo.serving.request_checks import Sampling


@dataclass
class Sample:
    """One sampled sequence, as `ContractServer.generate` gives it back (`engine.Generation` has these fields)."""

    token_ids: list[int]
    logprobs: list[float]
    """of each sampled token, at the sampling temperature"""
    versions: list[int]
    """the weight version that sampled each token; in a stream's delta, those the engine labelled since the choice's
    previous delta (vLLM labels all of a choice's tokens at its last)"""
    finish_reason: str
    """`stop` or `length`; in a stream's delta (`ContractServer.stream`), "" until the choice's last"""
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    """per token, the `Sampling.top_logprobs` most likely (token id, logprob), when asked for"""


class StopStrings:
    """Whether a sequence's text, decoded from its token ids, holds a stop string yet: called after every token, it
    decodes only the tail that can hold a stop string completed by the last token (a token is at least a byte)."""

    def __init__(self, tokenizer, stops: tuple[str, ...]):
        self.tokenizer, self.stops = tokenizer, stops
        self.window = max(len(s.encode()) for s in stops) + 1  # +1: the token that starts mid-character

    def __call__(self, token_ids: list[int]) -> bool:
        tail = self.tokenizer.decode(token_ids[-self.window :], skip_special_tokens=True)
        return any(s in tail for s in self.stops)


def cut_at_stop(text: str, stops: tuple[str, ...]) -> str:
    """`text` up to the first stop string in it (OpenAI's: the stop string itself is not returned)."""
    ends = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(ends)] if ends else text


def settled_text(text: str, stops: tuple[str, ...], last: bool) -> tuple[str, bool]:
    """The part of a sequence's text so far that no later token can change, and whether a stop string ended it: cut
    before the first stop string; else, unless the text is the `last`, without a character still incomplete at its
    end (decoded as U+FFFD) and without its longest end that begins a stop string (a later token may complete it
    into one). A stream sends only settled text: what it sent is never taken back."""
    cut = cut_at_stop(text, stops)
    if len(cut) < len(text) or last:
        return cut, len(cut) < len(text)
    text = text.rstrip("\ufffd")
    held = max((n for s in stops for n in range(1, min(len(s), len(text) + 1)) if text.endswith(s[:n])), default=0)
    return text[: len(text) - held], False


def completion_choices(tokenizer, samples: list[Sample], sampling: Sampling) -> list[dict]:
    """/v1/completions' choices: text, token ids, logprobs with each token's vocabulary entry, versions."""
    choices = []
    for i, s in enumerate(samples):
        text, finish_reason = _text(tokenizer, s, sampling)
        tokens = _completion_tokens(tokenizer, s, sampling)
        choices.append(
            {"index": i, "text": text, **tokens, "model_versions": s.versions, "finish_reason": finish_reason}
        )
    return choices


def chat_choices(tokenizer, samples: list[Sample], sampling: Sampling) -> list[dict]:
    """/v1/chat/completions' choices: the assistant's message, token ids, logprobs as chat content, versions."""
    choices = []
    for i, s in enumerate(samples):
        text, finish_reason = _text(tokenizer, s, sampling)
        message = {"role": "assistant", "content": text}
        tokens = _chat_tokens(tokenizer, s, sampling)
        choices.append(
            {"index": i, "message": message, **tokens, "model_versions": s.versions, "finish_reason": finish_reason}
        )
    return choices


def _completion_tokens(tokenizer, sample: Sample, sampling: Sampling) -> dict:
    """A completion choice's (or chunk's) token ids, and their logprobs with each token's vocabulary entry."""
    logprobs = {"tokens": _pieces(tokenizer, sample.token_ids), "token_logprobs": sample.logprobs}
    if sampling.top_logprobs:
        logprobs["top_logprobs"] = [
            dict(zip(_pieces(tokenizer, [t for t, _ in k]), [lp for _, lp in k])) for k in sample.top_logprobs
        ]
    return {"token_ids": sample.token_ids, "logprobs": logprobs}


def _chat_tokens(tokenizer, sample: Sample, sampling: Sampling) -> dict:
    """A chat choice's (or chunk's) token ids, and their logprobs as chat content."""
    content = [{"token": t, "logprob": lp} for t, lp in zip(_pieces(tokenizer, sample.token_ids), sample.logprobs)]
    for entry, k in zip(content, sample.top_logprobs if sampling.top_logprobs else []):
        entry["top_logprobs"] = [
            {"token": t, "logprob": lp} for t, (_, lp) in zip(_pieces(tokenizer, [t for t, _ in k]), k)
        ]
    return {"token_ids": sample.token_ids, "logprobs": {"content": content}}


def reply_body(kind: str, model_name: str, prompts_ids: list[list[int]], batched: bool, choices: list[dict]) -> dict:
    """A completion reply of OpenAI's `kind` (`text_completion`, `chat.completion`), with the prompts' token ids
    (one list per prompt when `batched`) and the usage."""
    completion_tokens = sum(len(c["token_ids"]) for c in choices)
    return {
        **_head(kind, model_name),
        "prompt_token_ids": prompts_ids if batched else prompts_ids[0],
        "choices": choices,
        "usage": _usage(prompts_ids, completion_tokens),
    }


def _head(kind: str, model_name: str) -> dict:
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": model_name}


def _usage(prompts_ids: list[list[int]], completion_tokens: int) -> dict:
    prompt_tokens = sum(len(p) for p in prompts_ids)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _text(tokenizer, sample: Sample, sampling: Sampling) -> tuple[str, str]:
    """The sample's text, cut before a stop string, and its finish reason."""
    text = tokenizer.decode(sample.token_ids, skip_special_tokens=True)
    cut = cut_at_stop(text, sampling.stop)
    return cut, "stop" if len(cut) < len(text) else sample.finish_reason


def _pieces(tokenizer, token_ids: list[int]) -> list[str]:
    """Each token as its vocabulary entry (one call, not a decode per token)."""
    return tokenizer.convert_ids_to_tokens(token_ids)


class ChoiceStream:
    """One choice of a streamed reply: the chunk of each of its deltas, in the completion or the `chat` form. A chunk
    has its delta's tokens and their logprobs, and the text they settle (`settled_text`); its last chunk has the
    finish reason and the weight version of every token of the choice (vLLM labels them only then). The text is
    decoded a few tokens at a time (`_decoded`), and once whole as the unstreamed reply's, whose rest the last chunk
    sends: the chunks' texts add up to the unstreamed text."""

    def __init__(self, tokenizer, sampling: Sampling, chat: bool):
        self.tokenizer, self.sampling, self.chat = tokenizer, sampling, chat
        self.token_ids: list[int] = []
        self.versions: list[int] = []
        self.text = ""  # of the tokens before `read`
        self.prefix = self.read = 0
        self.sent = ""
        self.stopped = False

    def chunk(self, index: int, delta: Sample) -> dict:
        first = not self.token_ids
        text, finish_reason = self._add(delta)
        if self.chat:  # OpenAI's first chunk of a choice names the role
            content = {"role": "assistant", "content": text} if first else {"content": text}
            chunk = {"index": index, "delta": content, **_chat_tokens(self.tokenizer, delta, self.sampling)}
        else:
            chunk = {"index": index, "text": text, **_completion_tokens(self.tokenizer, delta, self.sampling)}
        chunk["finish_reason"] = finish_reason
        if finish_reason:
            chunk["model_versions"] = self.versions
        return chunk

    def _add(self, delta: Sample) -> tuple[str, str | None]:
        """The text that `delta`'s tokens settle, and the choice's finish reason if `delta` is its last."""
        self.token_ids += delta.token_ids
        self.versions += delta.versions
        new = ""
        if not self.stopped:  # after a stop string, the tokens sampled with it add no text
            if delta.finish_reason:  # the unstreamed reply's text, decoded whole
                text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
            else:
                text = self._decoded()
            settled, self.stopped = settled_text(text, self.sampling.stop, last=bool(delta.finish_reason))
            if settled.startswith(self.sent):  # else the tokenizer decodes the start anew: sent is sent
                new, self.sent = settled[len(self.sent) :], settled
        if not delta.finish_reason:
            return new, None
        if len(self.versions) != len(self.token_ids):
            raise RuntimeError(f"{len(self.versions)} weight versions for {len(self.token_ids)} tokens")
        return new, "stop" if self.stopped else delta.finish_reason

    def _decoded(self) -> str:
        """The choice's text so far, decoded incrementally as vLLM's `detokenize_incrementally` and TGI stream text:
        the tokens past `read` with those from `prefix` before them (a token's text may depend on the one before
        it), taken once they end in a whole character; each step decodes a few tokens, not the whole choice."""
        before = self.tokenizer.decode(self.token_ids[self.prefix : self.read], skip_special_tokens=True)
        after = self.tokenizer.decode(self.token_ids[self.prefix :], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            self.prefix, self.read = self.read, len(self.token_ids)
        return self.text


async def send_stream(
    request: web.Request,
    kind: str,
    model_name: str,
    prompts_ids: list[list[int]],
    batched: bool,
    deltas: AsyncIterator[list[tuple[int, Sample]]],
    new_choice: Callable[[], ChoiceStream],
    include_usage: bool,
) -> web.StreamResponse:
    """`deltas` (`ContractServer.stream`) as server-sent events of OpenAI's `kind` (`text_completion`,
    `chat.completion.chunk`), the form the OpenAI SDK reads with `stream=True`: per engine step a chunk for each
    choice with new tokens (the choices interleave, each chunk names its index; the first chunk has the reply's
    `prompt_token_ids`), then with `include_usage` a chunk of the usage and no choice (the others' `usage` is null,
    as OpenAI's), then `[DONE]`. The status is sent before the first token: a failure after it is an error event,
    which the SDK raises. Closes `deltas` when done or when the client goes away (the engine drops its sequences)."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    head = {**_head(kind, model_name), **({"usage": None} if include_usage else {})}
    first = {"prompt_token_ids": prompts_ids if batched else prompts_ids[0]}
    choices: dict[int, ChoiceStream] = collections.defaultdict(new_choice)
    try:
        async with contextlib.aclosing(deltas):
            async for step in deltas:
                events = []
                for index, delta in step:
                    events.append(_event({**head, **first, "choices": [choices[index].chunk(index, delta)]}))
                    first = {}
                await response.write(b"".join(events))  # one write per step, not per choice
    except ConnectionError:  # the client went away: nobody to tell
        raise
    except Exception as error:
        status = error.status if isinstance(error, web.HTTPException) else 500
        message = error.reason if isinstance(error, web.HTTPException) else f"{type(error).__name__}: {error}"
        await response.write(_event(error_body(message, status)))
    else:
        if include_usage:
            completion_tokens = sum(len(c.token_ids) for c in choices.values())
            await response.write(_event({**head, "choices": [], "usage": _usage(prompts_ids, completion_tokens)}))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def error_body(message: str, status: int) -> dict:
    """OpenAI's error body, whose `message` the SDK puts in the exception it raises."""
    kind = http.HTTPStatus(status).phrase.lower().replace(" ", "_")
    return {"error": {"message": message, "type": kind, "code": status}}


def _event(data: dict) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"
