"""Label files in OAI's JSON format, the query sampler over the offline chatterbot corpus, OAI's book passages and
TL;DR posts."""

import json

import pytest
import torch

from lm_human_preference_details.cli import UserError
from lm_human_preference_details.data import (
    LabelFileError,
    Labels,
    QuerySampler,
    format_queries,
    load_labels,
    parse_labels,
    write_labels,
)
from lm_human_preference_details.tasks import TaskHParams
from lm_human_preference_details.text import left_pad, load_tokenizer, query_tokens, strip_pad

V, PAD, Q, R, K = 34, 36, 6, 4, 4  # the tiny vocab, its OAI pad id, lengths, best_of_4
SPEC = dict(num_responses=K, query_length=Q, response_length=R, vocab_size=V, pad_id=PAD)


# ----------------------------------------------------------------------------- label files
def make_labels(n=5, seed=0) -> Labels:
    g = torch.Generator().manual_seed(seed)
    queries = [
        torch.randint(0, V, (int(length),), generator=g).tolist()
        for length in torch.randint(1, Q + 1, (n,), generator=g)
    ]
    samples = torch.randint(0, V, (n, K, R), generator=g)
    samples[0, 1, 2:] = PAD  # truncated responses carry pad ids
    return Labels(left_pad(queries, Q, PAD), samples, torch.randint(0, K, (n,), generator=g))


@pytest.fixture
def label_file(tmp_path):
    path = str(tmp_path / "labels.json")
    labels = make_labels()
    write_labels(path, labels, PAD)
    return path, labels


def test_round_trip(label_file):
    path, labels = label_file
    loaded = load_labels(path, **SPEC)
    assert len(loaded) == len(labels) == 5
    assert torch.equal(loaded.queries, labels.queries)
    assert torch.equal(loaded.samples, labels.samples)
    assert torch.equal(loaded.best, labels.best)
    assert loaded.queries.dtype == loaded.samples.dtype == torch.long


def test_written_file_is_oai_format(label_file):
    """Queries right-padded to query_length in the file, sample0..sampleK-1, best.

    # OAI: lm_human_preferences/label_types.py#L31-L53
    """
    path, labels = label_file
    with open(path) as f:
        records = json.load(f)
    assert set(records[0]) == {"query", "sample0", "sample1", "sample2", "sample3", "best"}
    for record, query in zip(records, labels.queries):
        real = strip_pad(query, PAD)
        assert record["query"] == real + [PAD] * (Q - len(real))
    assert any(record["query"][-1] == PAD for record in records)  # some query was short


def test_oai_right_padded_queries_become_left_padded():
    record = {"query": [5, 6, PAD, PAD, PAD, PAD], **{f"sample{k}": [1, 2, 3, 4] for k in range(K)}, "best": 3}
    labels = parse_labels(json.dumps([record]), "x.json", **SPEC)
    assert labels.queries.tolist() == [[PAD, PAD, PAD, PAD, 5, 6]]
    assert labels.best.tolist() == [3] and labels.samples.shape == (1, K, R)


def corrupted(label_file, mutate):
    path, _ = label_file
    with open(path) as f:
        records = json.load(f)
    mutate(records[2])
    return json.dumps(records)


def _set(field, value):
    return lambda record: record.__setitem__(field, value)


@pytest.mark.parametrize(
    "mutate, field, words",
    [
        (_set("query", [1] * (Q + 1)), "'query'", "query_length"),
        (_set("query", [1] * (Q - 1)), "'query'", "expected 6"),
        (_set("sample1", [1] * (R - 1)), "'sample1'", "response_length"),
        (_set("sample3", [1] * (R + 2)), "'sample3'", "expected 4"),
        (_set("best", K), "'best'", "[0, 4)"),
        (_set("best", -1), "'best'", "[0, 4)"),
        (_set("best", True), "'best'", "integer"),
        (_set("best", "1"), "'best'", "integer"),
        (_set("sample0", [1, 2, V, 3]), "'sample0'", f"token id {V}"),
        (_set("query", [1, 2, 3, 50256, 4, 5]), "'query'", "token id 50256"),
        (_set("sample2", [1, 2, -1, 3]), "'sample2'", "token id -1"),
        (_set("sample2", [1, 2, 1.5, 3]), "'sample2'", "list of token ids"),
        (lambda r: r.pop("sample3"), "'sample3'", "list of token ids"),
        (lambda r: r.pop("query"), "'query'", "list of token ids"),
        (lambda r: r.pop("best"), "'best'", "None"),
    ],
)
def test_bad_record_names_record_and_field(label_file, mutate, field, words):
    with pytest.raises(LabelFileError) as info:
        parse_labels(corrupted(label_file, mutate), "bad.json", **SPEC)
    message = str(info.value)
    assert message.startswith("bad.json: record 2: ")
    assert f"field {field}" in message
    assert words in message


def test_record_not_an_object(label_file):
    def replace(records):
        records[2] = [1, 2, 3]

    path, _ = label_file
    with open(path) as f:
        records = json.load(f)
    replace(records)
    with pytest.raises(LabelFileError, match=r"bad\.json: record 2: expected an object"):
        parse_labels(json.dumps(records), "bad.json", **SPEC)


@pytest.mark.parametrize(
    "text, words",
    [
        ("{not json", "not JSON"),
        ("[]", "non-empty"),
        ("{}", "non-empty"),
        ('{"query": [1]}', "JSON list"),
        ("", "not JSON"),
    ],
)
def test_bad_file(text, words):
    with pytest.raises(LabelFileError, match=words) as info:
        parse_labels(text, "bad.json", **SPEC)
    assert str(info.value).startswith("bad.json: ")
    assert isinstance(info.value, UserError)


def test_load_labels_over_http_from_another_process_downloaded_once(label_file, tmp_path, monkeypatch):
    """A label file served by a real HTTP server in another process, as OAI's URLs are; kept in the cache, so a
    second run (or process) reads it without the server."""
    import os

    monkeypatch.setenv("LMHPD_CACHE", str(tmp_path / "cache"))
    path, labels = label_file
    server, port = serve_folder(os.path.dirname(path))
    try:
        url = f"http://127.0.0.1:{port}/{os.path.basename(path)}"
        loaded = load_labels(url, **SPEC)
        assert torch.equal(loaded.samples, labels.samples) and torch.equal(loaded.best, labels.best)
        with pytest.raises(LabelFileError, match="cannot download .*; pass a local file with --labels.source"):
            load_labels(f"http://127.0.0.1:{port}/missing.json", **SPEC)
    finally:
        server.terminate()
        server.wait(timeout=10)
    assert torch.equal(load_labels(url, **SPEC).best, labels.best)  # from the cache: the server is gone


def test_load_labels_missing_file(tmp_path):
    path = str(tmp_path / "nope.json")
    with pytest.raises(LabelFileError, match="no such file") as info:
        load_labels(path, **SPEC)
    assert path in str(info.value)


def test_load_labels_reports_file_path(tmp_path):
    path = str(tmp_path / "bad.json")
    with open(path, "w") as f:
        f.write("[]")
    with pytest.raises(LabelFileError, match="non-empty") as info:
        load_labels(path, **SPEC)
    assert str(info.value).startswith(path)


# ----------------------------------------------------------------------------- query sampler
QL, B = 16, 8
TASK = TaskHParams(base_model="tiny", query_dataset="chatterbot", query_length=QL, start_text=None, end_text="?")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny")


@pytest.fixture(scope="module")
def first_batches(tokenizer):
    """Four batches of a single-rank sampler, seed 0."""
    sampler = QuerySampler(TASK, tokenizer, batch_size=B, seed=0)
    batches = [next(sampler) for _ in range(4)]
    assert sampler.batches_drawn == 4
    return batches


def test_batches_are_left_padded_queries(first_batches, tokenizer):
    pad, question = tokenizer.oai_pad_token_id, tokenizer.convert_tokens_to_ids("?")
    padded_rows = 0
    for batch in first_batches:
        assert batch.shape == (B, QL) and batch.dtype == torch.long
        for row in batch:
            real = row != pad
            assert real.any()
            first_real = int(real.long().argmax())
            assert real[first_real:].all()  # pads only on the left
            padded_rows += first_real > 0
            tokens = row[first_real:].tolist()
            assert tokens[-1] == question  # cut after the last end_text
            assert all(0 <= t < len(tokenizer) for t in tokens)
            assert query_tokens(tokens, QL, None, question) == tokens
    assert padded_rows > 0


def test_same_seed_reproduces_and_seeds_differ(first_batches, tokenizer):
    again = QuerySampler(TASK, tokenizer, batch_size=B, seed=0)
    assert torch.equal(next(again), first_batches[0])
    other = QuerySampler(TASK, tokenizer, batch_size=B, seed=1)
    assert not torch.equal(next(other), first_batches[0])


def test_skip_resumes(first_batches, tokenizer):
    sampler = QuerySampler(TASK, tokenizer, batch_size=B, seed=0)
    sampler.skip(3)
    assert sampler.batches_drawn == 3
    assert torch.equal(next(sampler), first_batches[3])
    assert sampler.batches_drawn == 4


def test_two_ranks_split_the_stream(first_batches, tokenizer):
    """Rank r of 2 reads documents r, r+2, ... of the same shuffled stream: disjoint, together the whole."""
    single = torch.cat(first_batches[:2])  # 16 queries
    ranks = [QuerySampler(TASK, tokenizer, batch_size=B // 2, seed=0, rank=r, world_size=2) for r in range(2)]
    drawn = [torch.cat([next(s) for _ in range(2)]) for s in ranks]  # 8 queries each
    assert torch.equal(drawn[0], single[0::2])
    assert torch.equal(drawn[1], single[1::2])


def test_sampler_rejects_multi_token_start_text(tokenizer):
    task = TaskHParams(base_model="tiny", query_dataset="chatterbot", query_length=QL, start_text="ab", end_text=None)
    with pytest.raises(UserError, match=r"task\.start_text"):
        QuerySampler(task, tokenizer, batch_size=B, seed=0)


def test_query_settings_that_make_no_query_are_an_error_not_an_endless_search(tokenizer):
    # a query of one token that is a "!": no sentence of the corpus starts with one
    never = TaskHParams(base_model="tiny", query_dataset="chatterbot", query_length=1, start_text=None, end_text="!")
    with pytest.raises(
        UserError,
        match=r"10000 documents in a row make no query with task.query_length=1, start_text=None, end_text='!'",
    ):
        next(QuerySampler(never, tokenizer, batch_size=B, seed=0))


def test_format_queries(tokenizer):
    a, b, dot = (tokenizer.convert_tokens_to_ids(c) for c in "ab.")
    queries = left_pad([[5, 6, 7], [8]], 3, PAD)
    task = TaskHParams(base_model="tiny", query_prefix="ab", query_suffix=".")
    out = format_queries(queries, tokenizer, task)
    assert out.shape == (2, 6)
    assert out.tolist() == [[a, b, 5, 6, 7, dot], [PAD, PAD, a, b, 8, dot]]
    suffix_only = TaskHParams(base_model="tiny", query_suffix=".")
    assert format_queries(queries, tokenizer, suffix_only).tolist() == [[5, 6, 7, dot], [PAD, PAD, 8, dot]]
    assert format_queries(queries, tokenizer, TaskHParams(base_model="tiny")) is queries


# ----------------------------------------------------------------------------- OAI's book passages and TL;DR posts
def serve_folder(folder):
    """A real HTTP server in another process serving `folder`: (the process, its port)."""
    import subprocess
    import sys

    server = subprocess.Popen(
        [sys.executable, "-u", "-m", "http.server", "0", "--bind", "127.0.0.1", "--directory", str(folder)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return server, int(server.stdout.readline().split("port ")[1].split()[0])


@pytest.fixture
def book_site(tmp_path, monkeypatch):
    """OAI's `book_passages/train.jsonl` format (one JSON string per line), served over HTTP in place of OAI's URL;
    the cache is empty."""
    from lm_human_preference_details import data

    passages = [f"Chapter {i}. The rain fell on {i} roofs. She said nothing, and left." for i in range(40)] + [
        "no full stop"
    ]
    site = tmp_path / "site"
    site.mkdir()
    (site / "train.jsonl").write_text("".join(json.dumps(p) + "\n" for p in passages))
    server, port = serve_folder(site)
    monkeypatch.setattr(data, "BOOK_PASSAGES_URL", f"http://127.0.0.1:{port}/{{mode}}.jsonl")
    monkeypatch.setenv("LMHPD_CACHE", str(tmp_path / "cache"))
    yield passages, server, tmp_path / "cache" / "book_passages" / "train.jsonl"
    server.terminate()
    server.wait(timeout=10)


def test_tldr_posts_are_oais_cleaned_the_way_oai_cleans_them_in_oais_order(tmp_path, monkeypatch):
    """OAI's `tldr/train-subset.json` format (a JSON list of objects, the post as `content`) over HTTP: mojibake
    fixed by ftfy, 3+ newlines made 2, stripped, shuffled as OAI's tldr_generator shuffles (seed 0, every epoch)."""
    import random
    import re

    import ftfy

    from lm_human_preference_details import data

    contents = [
        f"  My landlord won\u00e2\u20ac\u2122t fix the heater #{i}.\n\n\n\nWhat should I do?\n" for i in range(30)
    ]
    site = tmp_path / "site"
    site.mkdir()
    (site / "train-subset.json").write_text(
        json.dumps([{"id": str(i), "subreddit": "advice", "content": c} for i, c in enumerate(contents)])
    )
    server, port = serve_folder(site)
    monkeypatch.setattr(data, "TLDR_URL", f"http://127.0.0.1:{port}/{{mode}}-subset.json")
    monkeypatch.setenv("LMHPD_CACHE", str(tmp_path / "cache"))
    try:
        stream = data.document_stream("tldr", seed=0)
        two_epochs = [next(stream) for _ in range(2 * len(contents))]
    finally:
        server.terminate()
        server.wait(timeout=10)
    assert two_epochs[0].startswith("My landlord won't fix the heater #") and two_epochs[0].endswith(
        ".\n\nWhat should I do?"
    )
    state = random.getstate()
    try:  # OAI's tldr_generator as it is written
        random.seed(0)
        oai_posts = [{"content": c} for c in contents]
        random.seed(0)
        random.shuffle(oai_posts)
        oai_order = [re.sub(r"\n{3,}", "\n\n", ftfy.fix_text(d["content"])).strip() for d in oai_posts]
    finally:
        random.setstate(state)
    assert two_epochs == oai_order + oai_order
    assert data.tldr_posts("train") == contents  # from the cache (the server is gone), cleaned as they are read

    (tmp_path / "cache" / "tldr" / "train-subset.json").write_text(
        json.dumps([{"content": "a post"}, {"title": "no content"}])
    )
    with pytest.raises(UserError, match=r"train-subset.json: post 1: expected an object with a string `content`"):
        data.tldr_posts("train")


def test_the_tldr_preset_is_oais_summarization_task():
    from lm_human_preference_details import train_policy, train_reward

    policy, reward = train_policy.defaults_for_task("tldr"), train_reward.defaults_for_task("tldr")
    task = policy.task
    assert (task.query_dataset, task.query_length, task.query_suffix, task.start_text, task.end_text) == (
        "tldr",
        500,
        "\n\nTL;DR:",
        None,
        None,
    )
    assert (task.response_length, task.truncate_token, task.truncate_after, task.temperature) == (75, 198, 55, 0.7)
    assert load_tokenizer("gpt2").encode("\n") == [198]
    assert (policy.ppo.lr, policy.ppo.batch_size, policy.ppo.whiten_rewards) == (2e-6, 32, False)
    assert (policy.rewards.kl_coef, policy.rewards.adaptive_kl) == (0.03, False)
    assert (reward.batch_size, reward.lr, reward.rollout_batch_size, reward.labels.num_train) == (
        16,
        2.5e-5,
        128,
        46_000,
    )
    assert reward.labels.source.endswith("/labels/tldr/online_45k.json") and reward.task == task


def test_books_are_oais_passages_downloaded_once_in_oais_order_every_epoch(book_site):
    import random

    from lm_human_preference_details.data import book_passages, document_stream

    passages, server, cached = book_site
    stream = document_stream("books", seed=0)
    two_epochs = [next(stream) for _ in range(2 * len(passages))]
    state = random.getstate()
    try:  # OAI's books_generator as it is written: the global generator, seeded each time it runs
        random.seed(0)
        oai_order = list(passages)
        random.shuffle(oai_order)
    finally:
        random.setstate(state)
    assert two_epochs == oai_order + oai_order
    server.terminate()
    server.wait(timeout=10)
    assert cached.exists() and book_passages("train") == passages  # from the cache: the server is gone

    # the sentiment task's queries (GPT-2 BPE, start_text = end_text = "."): after the first full stop, up
    # to the last; a passage with no full stop is skipped
    task = TaskHParams(base_model="gpt2", query_dataset="books", query_length=64, start_text=".", end_text=".")
    gpt2 = load_tokenizer("gpt2")
    sampler = QuerySampler(task, gpt2, batch_size=len(passages) - 1, seed=0)
    queries = [gpt2.decode(strip_pad(row.tolist(), gpt2.oai_pad_token_id)) for row in next(sampler)]
    assert queries == [p.split(".", 1)[1] for p in oai_order if p != "no full stop"]


def test_books_that_cannot_be_downloaded_or_read_name_the_file_and_the_fix(book_site, monkeypatch):
    from lm_human_preference_details import data

    passages, server, cached = book_site
    monkeypatch.setattr(data, "BOOK_PASSAGES_URL", data.BOOK_PASSAGES_URL.replace("{mode}", "missing-{mode}"))
    with pytest.raises(
        UserError,
        match=r"task.query_dataset=books: cannot download http://127.0.0.1:\d+/missing-train.jsonl .*"
        r"put that file at .*book_passages/train.jsonl, or use an offline corpus",
    ):
        data.book_passages("train")
    assert not cached.exists() and list(cached.parent.iterdir()) == []  # no partial file left

    # a server that closes the connection early: urllib reads that as the end of the file
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))

    def answer_cut_short():
        connection, _ = listener.accept()
        with connection:
            connection.recv(65536)
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + b'"a passage"\n' * 10)

    threading.Thread(target=answer_cut_short, daemon=True).start()
    monkeypatch.setattr(data, "BOOK_PASSAGES_URL", f"http://127.0.0.1:{listener.getsockname()[1]}/{{mode}}.jsonl")
    with pytest.raises(UserError, match=r"cannot download .*the connection closed after 120 of 1000 bytes"):
        data.book_passages("train")
    listener.close()
    assert not cached.exists() and list(cached.parent.iterdir()) == []

    cached.write_bytes(b'"a passage"\n"caf\xe9"\n')  # Latin-1
    with pytest.raises(UserError, match=r"train.jsonl: not UTF-8 text"):
        data.book_passages("train")
    cached.write_text('"a passage"\n{"text": "not a string"}\n')
    with pytest.raises(UserError, match=r"train.jsonl: line 2: expected a JSON string \(a passage\), got dict"):
        data.book_passages("train")
