"""Reading a request of the GRPO pipeline contract (`http_contract`): the JSON body, the fields a completion
request may carry, each field's check and the prompt's token ids. Every failure is a BadRequest (400) naming the
field.

The standard library, aiohttp's request and `grpo.protocol` only: it imports in the vLLM environment.
"""

import asyncio
import json
import math
from dataclasses import dataclass

from aiohttp import web

from lm_human_preference_details.grpo.protocol import MAX_CHOICES, MIN_TEMPERATURE

SAMPLING_FIELDS = {
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "n",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logprobs",
    "stream",
    "stream_options",
    "user",
}
"""the fields a completion request may carry (with `prompt`, or `messages` and `top_logprobs` for chat)"""

NEUTRAL_FIELDS = {"top_p": 1, "frequency_penalty": 0, "presence_penalty": 0, "echo": False, "best_of": 1}
"""OpenAI fields the servers do not implement, taken only at the value that changes nothing"""

MAX_STOP_STRINGS = 4
"""OpenAI's limit on `stop`"""

MAX_TOP_LOGPROBS = {"completions": 5, "chat": 20}
"""OpenAI's limits on `logprobs` (completions) and `top_logprobs` (chat)"""


class BadRequest(ValueError):
    """A malformed request: answered with 400 and the reason."""


@dataclass(frozen=True)
class Sampling:
    """A completion request's sampling fields, checked."""

    max_tokens: int
    temperature: float
    stop_token_ids: frozenset[int]
    """the request's, plus EOS unless it says `ignore_eos` (the stop token is kept in the output)"""
    n: int
    """samples of each prompt"""
    stop: tuple[str, ...] = ()
    """stop strings: a sequence ends once its text holds one, and the reply's text is cut before it (its tokens
    and logprobs keep every token sampled)"""
    top_logprobs: int = 0
    """the most likely tokens to give at each position, with their logprobs"""


async def prompt_ids(tokenizer, prompt, name: str) -> list[int]:
    """A prompt's token ids: a string tokenized (without special tokens), or a list of token ids as given."""
    if isinstance(prompt, str) and prompt:
        # off the event loop: a long prompt takes seconds, and /health and the other requests would wait
        return (await asyncio.to_thread(tokenizer, prompt, add_special_tokens=False))["input_ids"]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise BadRequest(
        f"field {name!r}: expected a non-empty string or a non-empty list of token ids"
        + (" (or a non-empty list of those)" if name == "prompt" else "")
    )


async def chat_prompt_ids(tokenizer, model_name: str, body: dict) -> list[int]:
    """The token ids of a chat request's `messages` in the model's chat template, the assistant's turn opened."""
    messages = body.get("messages")
    if not (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    ):
        raise BadRequest("field 'messages': expected a non-empty list of {role, content} strings")
    if not getattr(tokenizer, "chat_template", None):
        raise BadRequest(f"model {model_name} has no chat template: use /v1/completions")
    return list(
        await asyncio.to_thread(
            tokenizer.apply_chat_template, messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def sampling_of(body: dict, model_name: str, eos_token_id: int | None, prompts: int, top_logprobs: int) -> Sampling:
    """A completion request's sampling fields, checked (BadRequest naming the field)."""
    read_field(body, "model", str, model_name, lambda v: v == model_name, f"{model_name!r} (GET /v1/models)")
    read_field(body, "user", str, "", need="a string")
    stop = set(
        read_field(
            body, "stop_token_ids", list, [], lambda v: all(isinstance(t, int) for t in v), "a list of token ids"
        )
    )
    if not read_field(body, "ignore_eos", bool, False) and eos_token_id is not None:
        stop.add(eos_token_id)
    stop_strings = body.get("stop") or []
    stop_strings = [stop_strings] if isinstance(stop_strings, str) else stop_strings
    if not (
        isinstance(stop_strings, list)
        and len(stop_strings) <= MAX_STOP_STRINGS
        and all(isinstance(s, str) and s for s in stop_strings)
    ):
        raise BadRequest(f"field 'stop': expected a non-empty string or a list of up to {MAX_STOP_STRINGS} of them")
    if "max_tokens" in body and "max_completion_tokens" in body and body["max_tokens"] != body["max_completion_tokens"]:
        raise BadRequest("fields 'max_tokens' and 'max_completion_tokens' disagree: give one of them")
    length_field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = read_field(body, length_field, int, 16, lambda v: v >= 1, "an integer >= 1")
    temperature = read_field(
        body,
        "temperature",
        float,
        1.0,
        lambda v: math.isfinite(v) and v >= MIN_TEMPERATURE,
        f"a finite number >= {MIN_TEMPERATURE} (sampling only)",
    )
    n = read_field(body, "n", int, 1, lambda v: 1 <= v <= MAX_CHOICES, f"an integer in [1, {MAX_CHOICES}]")
    if n * prompts > MAX_CHOICES:
        raise BadRequest(
            f"fields 'prompt' and 'n': {prompts} prompts x n={n} exceeds {MAX_CHOICES} choices per request"
        )
    read_field(body, "stream", bool, False, need="true or false")
    options = read_field(body, "stream_options", dict, {}, lambda v: set(v) <= {"include_usage"}, "{include_usage}")
    read_field(options, "include_usage", bool, False, need="true or false (field 'stream_options')")
    if options and not wants_stream(body):
        raise BadRequest("field 'stream_options': only with stream: true")
    return Sampling(max_tokens, temperature, frozenset(stop), n, tuple(stop_strings), top_logprobs)


def read_field(body: dict, name: str, kind: type, default, check=lambda v: True, need: str = ""):
    """`body[name]` (or `default`), a `kind` that passes `check`; else BadRequest saying what it `need`s."""
    value = body.get(name, default)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool or not check(value):
        raise BadRequest(f"field {name!r}: expected {need or kind.__name__}, got {_short(value)}")
    return value


def _short(value) -> str:
    """`repr(value)`, at most 200 characters: an error message does not echo a megabyte back."""
    text = repr(value)
    return text if len(text) <= 200 else f"{text[:200]}... ({len(text)} characters)"


def check_fields(body: dict, allowed: set[str]) -> None:
    """BadRequest for a field the server would otherwise ignore: one it does not know, or an OpenAI one it does
    not implement at any but its neutral value."""
    for name in body:
        if name in allowed:
            continue
        if name in NEUTRAL_FIELDS:
            neutral = NEUTRAL_FIELDS[name]
            if body[name] == neutral and isinstance(body[name], bool) == isinstance(neutral, bool):
                continue
            raise BadRequest(
                f"field {name!r}: this server implements only {name}={json.dumps(NEUTRAL_FIELDS[name])}: remove it"
            )
        raise BadRequest(
            f"field {_short(name)}: not supported by this server, which would ignore it: remove it "
            f"(it takes {', '.join(sorted(allowed | set(NEUTRAL_FIELDS)))})"
        )


def _check_unicode(body: dict) -> None:
    """BadRequest naming the first string of `body` (a key too) that is not valid Unicode. Iterative: the body is
    as deep as JSON's parser allowed."""
    todo: list[tuple[str, object]] = [("", body)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, f"a key of {path or 'the body'}")
                todo.append((f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):
            todo.extend((f"{path}[{i}]", item) for i, item in enumerate(value))


def _check_text(text: str, name: str) -> None:
    """BadRequest for text that is not valid Unicode (a lone surrogate, as JSON's \\ud800 gives): no tokenizer
    takes it."""
    try:
        text.encode()
    except UnicodeEncodeError as error:
        raise BadRequest(
            f"field {name!r}: not valid Unicode ({text[error.start]!r} at character {error.start}, a lone surrogate "
            f"half): send whole characters"
        ) from None


def wants_stream(body: dict) -> bool:
    return body.get("stream") is True


def wants_usage(body: dict) -> bool:
    """A streamed reply ends with a chunk of the usage (checked by `sampling_of`)."""
    return body.get("stream_options", {}).get("include_usage") is True


async def json_body(request: web.Request) -> dict:
    """The request's body: a JSON object of valid Unicode, else BadRequest."""
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadRequest("the body is not JSON") from None
    except RecursionError:
        raise BadRequest("the body is nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    _check_unicode(body)
    return body
