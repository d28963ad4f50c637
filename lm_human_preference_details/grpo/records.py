"""The typed records that travel between the GRPO processes, each with a schema version.

A `Group` is one problem's prompt and its `group_size` attempts, what the actor writes for each finished group and
the trainer reads; an `Evaluation` is what the actor measured on the held-out problems at one step (`--eval-every`),
which the trainer logs. Each is written as one JSON object (`streams` carries it: a JSON line, or a Redis entry).
Its keys are the dataclasses' field names, plus `schema`, the layout's version: a reader of another version refuses
the record (`from_json`), and a reader from before the field existed ignores it. Schema 1 of `Group` is the layout
the actor wrote before `schema` was added, so a record without it is read as 1.
"""

import functools
import json
import types
from dataclasses import MISSING, asdict, dataclass, fields, is_dataclass
from typing import Any, ClassVar, Self, get_args, get_origin, get_type_hints


class RecordError(ValueError):
    """A line that is not a record of this schema; the message names the field."""


@dataclass(kw_only=True)
class Attempt:
    """One sampled completion of a group's prompt, as the servers returned it, and its reward."""

    completion_ids: list[int]
    logprobs: list[float]  # the behaviour policy's, at the group's temperature, one per token
    versions: list[int]  # the weight version that sampled each token
    finish_reason: str | None = None  # `stop` or `length`; None in streams written before it was recorded
    text: str = ""  # the completion's text, for the sample tables
    reward: float


class Record:
    """A typed record of one JSON object, `schema` (the class's `SCHEMA`) first."""

    SCHEMA: ClassVar[int] = 1

    def to_json(self) -> str:
        """One line of compact JSON (token-id lists are most of a group's bytes), `schema` first."""
        return json.dumps({"schema": self.SCHEMA, **asdict(self)}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> Self:
        """The record on one line; a RecordError naming the field when it is not JSON, of another schema, or has a
        field missing or of the wrong type (fields it does not know are ignored)."""
        try:
            data = json.loads(text)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise RecordError(f"not JSON ({error})") from None
        schema = data.get("schema", 1) if isinstance(data, dict) else cls.SCHEMA
        if schema != cls.SCHEMA:
            raise RecordError(
                f"schema is {schema!r}, this reader takes {cls.__name__} schema {cls.SCHEMA}: the actor that wrote it "
                "is another version"
            )
        return _decode(cls, data, "")


@dataclass(kw_only=True)
class Group(Record):
    """A problem's prompt and its attempts: one record of the sample stream."""

    problem_id: str
    answer: str | None = None  # the ground truth the rewards were checked against (the trainer does not read it)
    prompt_ids: list[int]
    temperature: float | None = None  # of the logprobs; None in streams written before it was recorded
    attempts: list[Attempt]


@dataclass(kw_only=True)
class EvaluatedProblem:
    """One held-out problem's samples at an evaluation, and their rewards."""

    problem_id: str
    prompt: str
    answer: str
    completions: list[str]
    rewards: list[float]
    tokens: list[int]  # each completion's length in tokens


@dataclass(kw_only=True)
class Evaluation(Record):
    """The held-out problems sampled `samples` times each, once the servers served weights `step`: one record of the
    evaluation stream (`GRPOArgs.eval_stream_url`). The servers take new weights while it runs, so its tokens come
    from versions `version_min` .. `version_max`."""

    step: int
    version_min: int
    version_max: int
    samples: int  # per problem: the k of pass@k
    seconds: float  # from its first request to its last answer
    problems: list[EvaluatedProblem]


def _decode(cls: type, data: Any, path: str) -> Any:
    """An instance of dataclass `cls` from its JSON object, every field checked against its annotation."""
    if not isinstance(data, dict):
        raise RecordError(f"{path or 'the record'} is {_json_type(data)}, not an object")
    hints = _type_hints(cls)
    values = {}
    for field in fields(cls):
        name = f"{path}.{field.name}" if path else field.name
        if field.name in data:
            values[field.name] = _value(data[field.name], hints[field.name], name)
        elif field.default is MISSING:
            raise RecordError(f"{name} is missing")
    return cls(**values)


def _value(value: Any, kind: Any, name: str) -> Any:
    """`value` as annotation `kind` says (a list, an optional, a dataclass, a scalar); a RecordError if it is not."""
    if get_origin(kind) is list:
        (item,) = get_args(kind)
        if not isinstance(value, list):
            raise RecordError(f"{name} is {_json_type(value)}, not a list")
        if item in _JSON_NAMES and all(type(v) is item for v in value):  # the common case, without a call per item
            return value
        return [_value(v, item, f"{name}[{i}]") for i, v in enumerate(value)]
    if get_origin(kind) is types.UnionType:  # `X | None`
        (inner,) = [arg for arg in get_args(kind) if arg is not type(None)]
        return None if value is None else _value(value, inner, name)
    if is_dataclass(kind):
        return _decode(kind, value, name)
    if kind is float and type(value) is int:  # JSON writers may drop a whole number's `.0`
        return float(value)
    if type(value) is not kind:
        raise RecordError(f"{name} is {_json_type(value)}, not {_JSON_NAMES[kind]}")
    return value


_JSON_NAMES = {int: "an integer", float: "a number", str: "a string"}
_type_hints = functools.cache(get_type_hints)


def _json_type(value: Any) -> str:
    """What JSON value `value` was, for an error message."""
    if value is None:
        return "null"
    for kind, json_name in ((bool, "a boolean"), (dict, "an object"), (list, "a list")):
        if isinstance(value, kind):
            return json_name
    return _JSON_NAMES.get(type(value), type(value).__name__)
