"""The actor -> trainer sample stream, on both backends: a JSON-lines file and a real redis-server."""

import json
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from lm_human_preference_details.cli import UserError
from lm_human_preference_details.grpo.records import Attempt, EvaluatedProblem, Evaluation, Group, RecordError
from lm_human_preference_details.grpo.streams import (
    FileStreamUrl,
    RedisStreamUrl,
    StreamConnectionError,
    companion_url,
    open_reader,
    open_writer,
    parse_stream_url,
)
from tests.conftest import free_port, redis_client, with_stream

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def redis_stream(redis_url):
    """A stream of its own for each test, deleted afterwards (CI's server is shared)."""
    name = f"test-{uuid.uuid4().hex}"
    yield with_stream(redis_url, name)
    with redis_client(redis_url) as client:
        client.delete(name)


@pytest.fixture(params=["file", "redis"])
def url(request, tmp_path):
    if request.param == "file":
        return str(tmp_path / "run" / "samples.jsonl")  # the parent folder does not exist yet
    return request.getfixturevalue("redis_stream")


def records(n: int, offset: int = 0) -> list[dict]:
    return [{"i": i, "reward": (i + 1) / 7, "tokens": list(range(i % 5))} for i in range(offset, offset + n)]


class Item(dict):
    """A record of these tests: any JSON object."""

    def to_json(self) -> str:
        return json.dumps(self)

    @classmethod
    def from_json(cls, text: str | bytes) -> "Item":
        return cls(json.loads(text))


def write_all(url: str, items: list) -> None:
    writer = open_writer(url)
    for record in items:
        writer.write(Item(record) if isinstance(record, dict) else record)
    writer.close()


def read_n(reader, n: int, timeout_s: float = 20.0) -> list[dict]:
    got, deadline = [], time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        got += reader.read(n - len(got), timeout_s=0.5)
    return got


# ---------------------------------------------------------------- URLs


def test_url_forms():
    assert parse_stream_url("runs/a/samples.jsonl") == FileStreamUrl("runs/a/samples.jsonl")
    assert parse_stream_url("file:///tmp/my%20run/s.jsonl") == FileStreamUrl("/tmp/my run/s.jsonl")
    assert parse_stream_url("redis://") == RedisStreamUrl("redis://", "localhost", 6379, 0, "samples", None)
    assert parse_stream_url("redis://h:7000/3?stream=s&maxlen=100") == RedisStreamUrl(
        "redis://h:7000/3?stream=s&maxlen=100", "h", 7000, 3, "s", 100
    )


def test_a_companion_stream_is_a_file_beside_a_file_or_a_stream_of_its_own_on_the_same_redis():
    assert companion_url("runs/a/stream.jsonl", "eval", "runs/a/eval.jsonl") == "runs/a/eval.jsonl"
    url = companion_url("redis://h:7000/3?stream=s&maxlen=100", "eval", "unused")
    assert parse_stream_url(url) == RedisStreamUrl(url, "h", 7000, 3, "s-eval", None)


@pytest.mark.parametrize(
    "bad",
    ["http://host/x", "s3://bucket/key", "", "file://otherhost/x", "redis://h/0?maxlen=-1", "redis://h/0?strem=s"],
)
def test_bad_url_is_user_error_naming_the_forms(bad):
    with pytest.raises(UserError, match="file:///abs/path.jsonl, or redis://host:port/db"):
        open_writer(bad)


# ---------------------------------------------------------------- both backends


def test_round_trip_in_order_with_exact_values(url):
    sent = [
        {"tokens": [50256, 0, 7], "logprobs": [-0.1, -1 / 3, -1e-300, -2.5e-8], "reward": 0.1 + 0.2},
        {"text": 'a "quoted"\nline\twith ünïcode', "versions": [3, 3, 4], "big": 2**53 + 1, "none": None},
        {"nested": {"ok": True, "xs": [1.7976931348623157e308, 5e-324]}},
    ]
    write_all(url, sent)
    reader = open_reader(url, Item.from_json)
    assert reader.read(10, timeout_s=5) == sent
    assert reader.position == 3
    reader.close()


def test_read_returns_nothing_after_the_timeout(url):
    writer = open_writer(url)  # the stream exists for a file, not yet for Redis: both must just wait
    reader = open_reader(url, Item.from_json)
    began = time.monotonic()
    assert reader.read(5, timeout_s=0.3) == []
    assert 0.3 <= time.monotonic() - began < 1.5
    assert reader.position == 0
    writer.close()
    reader.close()


def test_max_records_is_honoured(url):
    write_all(url, records(10))
    reader = open_reader(url, Item.from_json)
    assert reader.read(3, timeout_s=5) == records(3)
    assert reader.position == 3
    assert reader.read(100, timeout_s=5) == records(7, offset=3)
    assert reader.position == 10
    assert reader.read(1, timeout_s=0.05) == []


def test_start_skips_records_even_ones_not_written_yet(url):
    write_all(url, records(10))
    reader = open_reader(url, Item.from_json, start=4)
    assert reader.position == 4
    assert reader.read(100, timeout_s=5) == records(6, offset=4)
    assert reader.position == 10

    ahead = open_reader(url, Item.from_json, start=12)  # a resumed trainer that is ahead of a restarted actor
    assert ahead.read(100, timeout_s=0.1) == []
    write_all(url, records(5, offset=10))
    assert ahead.read(100, timeout_s=5) == records(3, offset=12)
    assert ahead.position == 15


WRITER = """
import json, sys, time
from lm_human_preference_details.grpo.streams import open_writer
class Item(dict):
    def to_json(self):
        return json.dumps(self)
writer = open_writer(sys.argv[1])
for i in range(int(sys.argv[2])):
    writer.write(Item({"i": i, "reward": (i + 1) / 7, "tokens": list(range(i % 5))}))
    if i % 100 == 0:
        time.sleep(0.02)  # let the reader catch up, so it reads while the writer writes
writer.close()
"""


def test_writer_process_and_reader_run_concurrently(url):
    n = 500
    reader = open_reader(url, Item.from_json)  # opened first: for a file, before the file exists
    writer = subprocess.Popen([sys.executable, "-c", WRITER, url, str(n)], cwd=REPO)
    try:
        got = read_n(reader, n)
        assert writer.wait(timeout=20) == 0
    finally:
        writer.kill()
    assert got == records(n)
    assert reader.position == n
    assert reader.read(1, timeout_s=0.05) == []


# ---------------------------------------------------------------- files


def test_file_partial_last_line_waits_until_complete(tmp_path):
    path = tmp_path / "samples.jsonl"
    line = json.dumps({"tokens": [1, 2, 3], "reward": 0.5}) + "\n"
    reader = open_reader(str(path), Item.from_json)
    with open(path, "w") as f:
        f.write(line[:10])
        f.flush()
        assert reader.read(5, timeout_s=0.1) == []
        assert reader.position == 0
        f.write(line[10:])
        f.flush()
        assert reader.read(5, timeout_s=1) == [{"tokens": [1, 2, 3], "reward": 0.5}]
    assert reader.position == 1


def test_file_reader_waits_for_a_file_that_does_not_exist_yet(tmp_path):
    url = f"file://{tmp_path}/later/samples.jsonl"
    reader = open_reader(url, Item.from_json)
    assert reader.read(5, timeout_s=0.1) == []
    threading.Timer(0.3, write_all, args=(url, records(2))).start()
    began = time.monotonic()
    assert reader.read(5, timeout_s=10) == records(2)
    assert time.monotonic() - began < 5


# ---------------------------------------------------------------- Redis


def test_redis_wire_is_one_json_field(redis_stream):
    write_all(redis_stream, records(2))
    with redis_client(redis_stream, decode_responses=True) as client:
        entries = client.xrange(parse_stream_url(redis_stream).stream)
    assert [fields.keys() for _, fields in entries] == [{"json"}, {"json"}]
    assert [json.loads(fields["json"]) for _, fields in entries] == records(2)


def test_redis_maxlen_trims(redis_stream):
    write_all(redis_stream + "&maxlen=10", records(1000))
    with redis_client(redis_stream) as client:
        assert (
            10 <= client.xlen(parse_stream_url(redis_stream).stream) < 1000
        )  # approximate: Redis trims whole internal nodes


def test_unreachable_redis_names_the_url_and_the_fix():
    pytest.importorskip("redis")
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0?stream=s"
    with pytest.raises(StreamConnectionError) as e:
        open_reader(url, Item.from_json)
    assert url in str(e.value) and f"redis-server --port {port}" in str(e.value)


def test_truncate_keeps_the_first_records_and_a_new_writer_continues(url):
    from lm_human_preference_details.grpo.streams import truncate

    write_all(url, [{"i": i} for i in range(10)])
    assert truncate(url, 4) == 6
    write_all(url, [{"i": "after"}])
    reader = open_reader(url, Item.from_json)
    assert [r["i"] for r in reader.read(100, timeout_s=0.5)] == [0, 1, 2, 3, "after"]
    reader.close()
    assert truncate(url, 0) == 5  # a new run starts from an empty stream


def test_file_writer_drops_a_line_its_predecessor_left_half_written(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text('{"i": 0}\n{"i": 1, "cut sho')
    write_all(str(path), [{"i": 2}])
    reader = open_reader(str(path), Item.from_json)
    assert [r["i"] for r in reader.read(10, timeout_s=0.2)] == [0, 2]


# ---------------------------------------------------------------- sample records


def sample_group(problem: int) -> Group:
    attempt = Attempt(
        completion_ids=[5, 2], logprobs=[-0.25, -1 / 3], versions=[0, 1], finish_reason="stop", reward=1.0
    )
    return Group(problem_id=f"p{problem}", answer="3", prompt_ids=[1, 2], temperature=1.0, attempts=[attempt] * 2)


def append_line(url: str, text: str) -> str:
    """Write `text` as the stream's next line or entry, behind the writer's back; where a reader finds it."""
    where = parse_stream_url(url)
    if isinstance(where, FileStreamUrl):
        with open(where.path, "a") as f:
            f.write(text + "\n")
        return f"{where.path} line 3"
    with redis_client(url, decode_responses=True) as client:
        return f"{url} entry {client.xadd(where.stream, {'json': text})}"


def test_a_group_is_written_under_todays_keys_and_read_back(url):
    """A stream of the actor before `schema` existed is read as schema 1; one this actor writes has the same keys
    plus `schema`, which a trainer from before it ignores."""
    group = sample_group(0)
    line = json.loads(group.to_json())
    assert list(line) == ["schema", "problem_id", "answer", "prompt_ids", "temperature", "attempts"]
    assert list(line["attempts"][0]) == ["completion_ids", "logprobs", "versions", "finish_reason", "text", "reward"]
    del line["schema"]
    write_all(url, [sample_group(1), Item(line)])
    reader = open_reader(url, Group.from_json)
    assert reader.read(2, timeout_s=5) == [sample_group(1), group]
    reader.close()


def without_reward(line: dict) -> dict:
    del line["attempts"][1]["reward"]
    return line


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda line: json.dumps(line)[:40], "not JSON (Unterminated string"),
        (lambda line: json.dumps(line | {"schema": 2}), "schema is 2, this reader takes Group schema 1"),
        (lambda line: json.dumps(without_reward(line)), "attempts[1].reward is missing"),
        (lambda line: json.dumps(line | {"prompt_ids": [1, "2"]}), "prompt_ids[1] is a string, not an integer"),
        (lambda line: json.dumps(line | {"attempts": {}}), "attempts is an object, not a list"),
    ],
)
def test_a_line_of_another_schema_or_malformed_stops_the_reader_naming_the_field_and_where(url, damage, message):
    write_all(url, [sample_group(0), sample_group(1)])
    where = append_line(url, damage(json.loads(sample_group(2).to_json())))
    reader = open_reader(url, Group.from_json)
    assert [g.problem_id for g in reader.read(2, timeout_s=5)] == ["p0", "p1"]
    with pytest.raises(UserError) as refused:
        reader.read(1, timeout_s=5)
    assert str(refused.value).startswith(f"the stream's {where}: {message}"), refused.value
    assert "\n" not in str(refused.value)
    reader.close()


def test_an_evaluation_goes_through_the_stream_as_it_was_and_another_schema_is_refused(url):
    problem = EvaluatedProblem(
        problem_id="sum-4-2",
        prompt="4+2=\\boxed{",
        answer="6",
        completions=["6}", "7}"],
        rewards=[1.0, 0.0],
        tokens=[2, 2],
    )
    sent = Evaluation(step=20, version_min=20, version_max=21, samples=2, seconds=0.25, problems=[problem])
    write_all(url, [sent])
    reader = open_reader(url, Evaluation.from_json)
    assert reader.read(2, timeout_s=5) == [sent]
    reader.close()
    with pytest.raises(RecordError, match="schema is 2, this reader takes Evaluation schema 1"):
        Evaluation.from_json(json.dumps(json.loads(sent.to_json()) | {"schema": 2}))
    with pytest.raises(RecordError, match=r"problems\[0\]\.rewards is missing"):
        line = json.loads(sent.to_json())
        del line["problems"][0]["rewards"]
        Evaluation.from_json(json.dumps(line))
