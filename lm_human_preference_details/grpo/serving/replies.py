"""The replies of the GRPO pipeline contract's completions (`http_contract`): each choice's text, token ids, logprobs
and weight versions, in OpenAI's completion and chat forms, the usage, and the server-sent events of a streamed
reply; stop strings.

The standard library, aiohttp and `grpo.protocol` only: it imports in the vLLM environment.
"""

import json
import time
import uuid
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
    """the weight version that sampled each token"""
    finish_reason: str
    """`stop` or `length`"""
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


def completion_choices(tokenizer, samples: list[Sample], sampling: Sampling) -> list[dict]:
    """/v1/completions' choices: text, token ids, logprobs with each token's vocabulary entry, versions."""
    choices = []
    for i, s in enumerate(samples):
        text, finish_reason = _text(tokenizer, s, sampling)
        logprobs = {"tokens": _pieces(tokenizer, s.token_ids), "token_logprobs": s.logprobs}
        if sampling.top_logprobs:
            logprobs["top_logprobs"] = [
                dict(zip(_pieces(tokenizer, [t for t, _ in k]), [lp for _, lp in k])) for k in s.top_logprobs
            ]
        choices.append(
            {
                "index": i,
                "text": text,
                "token_ids": s.token_ids,
                "logprobs": logprobs,
                "model_versions": s.versions,
                "finish_reason": finish_reason,
            }
        )
    return choices


def chat_choices(tokenizer, samples: list[Sample], sampling: Sampling) -> list[dict]:
    """/v1/chat/completions' choices: the assistant's message, token ids, logprobs as chat content, versions."""
    choices = []
    for i, s in enumerate(samples):
        text, finish_reason = _text(tokenizer, s, sampling)
        content = [{"token": t, "logprob": lp} for t, lp in zip(_pieces(tokenizer, s.token_ids), s.logprobs)]
        for entry, k in zip(content, s.top_logprobs if sampling.top_logprobs else []):
            entry["top_logprobs"] = [
                {"token": t, "logprob": lp} for t, (_, lp) in zip(_pieces(tokenizer, [t for t, _ in k]), k)
            ]
        choices.append(
            {
                "index": i,
                "message": {"role": "assistant", "content": text},
                "token_ids": s.token_ids,
                "logprobs": {"content": content},
                "model_versions": s.versions,
                "finish_reason": finish_reason,
            }
        )
    return choices


def reply_body(kind: str, model_name: str, prompts_ids: list[list[int]], batched: bool, choices: list[dict]) -> dict:
    """A completion reply of OpenAI's `kind` (`text_completion`, `chat.completion`), with the prompts' token ids
    (one list per prompt when `batched`) and the usage."""
    completion_tokens = sum(len(c["token_ids"]) for c in choices)
    prompt_tokens = sum(len(p) for p in prompts_ids)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model_name,
        "prompt_token_ids": prompts_ids if batched else prompts_ids[0],
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def _text(tokenizer, sample: Sample, sampling: Sampling) -> tuple[str, str]:
    """The sample's text, cut before a stop string, and its finish reason."""
    text = tokenizer.decode(sample.token_ids, skip_special_tokens=True)
    cut = cut_at_stop(text, sampling.stop)
    return cut, "stop" if len(cut) < len(text) else sample.finish_reason


def _pieces(tokenizer, token_ids: list[int]) -> list[str]:
    """Each token as its vocabulary entry (one call, not a decode per token)."""
    return tokenizer.convert_ids_to_tokens(token_ids)


async def send_events(request: web.Request, reply: dict, choices: list[dict], body: dict) -> web.StreamResponse:
    """`reply` as server-sent events, the form the OpenAI SDK reads with `stream=True`: one chunk per choice (the
    engines hand back whole sequences: the chunks come once they are done), then the usage when
    `stream_options.include_usage` asks for it, then `[DONE]`."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    head = {k: v for k, v in reply.items() if k not in ("choices", "usage")}
    for choice in choices:
        await response.write(_event({**head, "choices": [choice]}))
    if body.get("stream_options", {}).get("include_usage"):
        await response.write(_event({**head, "choices": [], "usage": reply["usage"]}))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def _event(data: dict) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"
