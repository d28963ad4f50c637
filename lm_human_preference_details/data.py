"""Query datasets and label files.

Label files use OAI's format: a JSON list of `{"query": [query_length ints], "sample0".."sampleN-1":
[response_length ints], "best": int}`, queries right-padded with the pad id beyond the vocab
(# OAI: lm_human_preferences/label_types.py#L33-L55, PickBest). In memory queries are left-padded.
"""

import contextlib
import glob
import http.client
import json
import os
import random
import re
import shutil
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .cli import UserError
from .text import left_pad, query_tokens, single_token, strip_pad

LABELS_HUB_DATASET = "vwxyzjn/lm-human-preferences"


class LabelFileError(UserError):
    """A label file that cannot be used; the message names the file, the record and the field."""


@dataclass
class Labels:
    queries: torch.Tensor  # (N, Q) left-padded
    samples: torch.Tensor  # (N, K, R)
    best: torch.Tensor  # (N,)

    def __len__(self) -> int:
        return len(self.best)

    def __getitem__(self, index) -> "Labels":
        return Labels(self.queries[index], self.samples[index], self.best[index])

    def to(self, device) -> "Labels":
        return Labels(self.queries.to(device), self.samples.to(device), self.best.to(device))


def read_label_text(source: str) -> str:
    """The text of a label file: local path, http(s) URL, or `hub:PATH` in the hub dataset."""
    if source.startswith(("http://", "https://")):  # downloaded once into the cache (OAI's tldr labels: 45k records)
        from .assets import cache_dir

        url = urllib.parse.urlsplit(source)
        path = os.path.join(cache_dir(), "labels", url.netloc, url.path.lstrip("/"))
        try:
            source = download_once(source, path)
        except OSError as e:
            raise LabelFileError(
                f"labels.source={source}: cannot download ({e}); pass a local file with --labels.source "
                f"(or put this one at {path})"
            ) from e
    if source.startswith("hub:"):
        from huggingface_hub import hf_hub_download

        try:
            path = hf_hub_download(LABELS_HUB_DATASET, source[len("hub:") :], repo_type="dataset")
        except Exception as e:  # the hub raises many kinds; all mean the same to the user
            raise LabelFileError(
                f"labels.source={source}: cannot fetch from the hub dataset {LABELS_HUB_DATASET} ({e})"
            ) from e
        source = path
    if not os.path.isfile(source):
        raise LabelFileError(f"labels.source={source}: no such file")
    try:
        with open(source, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise LabelFileError(
            f"labels.source={source}: not UTF-8 text ({e}): a label file is JSON, as make_labels writes it"
        ) from None


def parse_labels(
    text: str, source: str, *, num_responses: int, query_length: int, response_length: int, vocab_size: int, pad_id: int
) -> Labels:
    """Validate every record of a label file and return it as tensors."""
    try:
        records = json.loads(text)
    except json.JSONDecodeError as e:
        raise LabelFileError(f"{source}: not JSON ({e})") from e
    if not isinstance(records, list) or not records:
        raise LabelFileError(f"{source}: expected a non-empty JSON list of label records")
    lengths = {"query": query_length, **{f"sample{k}": response_length for k in range(num_responses)}}
    queries, samples, best = [], [], []
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise LabelFileError(f"{source}: record {i}: expected an object with fields {', '.join(lengths)}, best")
        for name, length in lengths.items():
            tokens = record.get(name)
            if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
                raise LabelFileError(f"{source}: record {i}: field {name!r} must be a list of token ids")
            if len(tokens) != length:
                what = "query_length" if name == "query" else "response_length"
                raise LabelFileError(
                    f"{source}: record {i}: field {name!r} has {len(tokens)} tokens, expected {length} ({what})"
                )
            bad = [t for t in tokens if not (0 <= t < vocab_size or t == pad_id)]
            if bad:
                raise LabelFileError(
                    f"{source}: record {i}: field {name!r} has token id {bad[0]} outside the vocab [0, {vocab_size}) "
                    f"and is not the pad id {pad_id}: labels from another tokenizer?"
                )
        b = record.get("best")
        if not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < num_responses:
            raise LabelFileError(
                f"{source}: record {i}: field 'best' is {b!r}, expected an integer in [0, {num_responses})"
            )
        queries.append(strip_pad(record["query"], pad_id))
        samples.append([record[f"sample{k}"] for k in range(num_responses)])
        best.append(b)
    return Labels(left_pad(queries, query_length, pad_id), torch.tensor(samples, dtype=torch.long), torch.tensor(best))


def load_labels(source: str, **kwargs) -> Labels:
    return parse_labels(read_label_text(source), source, **kwargs)


def write_labels(path: str, labels: Labels, pad_id: int) -> None:
    """OAI's JSON format: queries right-padded."""
    query_length = labels.queries.shape[1]
    records = []
    for query, samples, best in zip(labels.queries, labels.samples, labels.best):
        q = strip_pad(query, pad_id)
        record = {"query": q + [pad_id] * (query_length - len(q))}
        record.update({f"sample{k}": s.tolist() for k, s in enumerate(samples)})
        record["best"] = int(best)
        records.append(record)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(records, f)
    os.replace(path + ".tmp", path)


# ---------------------------------------------------------------- query datasets


def chatterbot_texts() -> list[str]:
    """The distinct English sentences of the `chatterbot-corpus` package, offline."""
    import importlib.util

    import yaml

    spec = importlib.util.find_spec("chatterbot_corpus")
    if spec is None:
        raise RuntimeError("query_dataset=chatterbot needs the package: pip install chatterbot-corpus")
    texts = []
    for path in sorted(glob.glob(os.path.join(spec.submodule_search_locations[0], "data", "english", "*.yml"))):
        with open(path, encoding="utf-8") as f:
            for conversation in yaml.safe_load(f).get("conversations", []):
                texts.extend(s.strip() for s in conversation if isinstance(s, str) and s.strip())
    return list(dict.fromkeys(texts))  # the corpus repeats some lines across files


BOOK_PASSAGES_URL = (
    "https://openaipublic.blob.core.windows.net/lm-human-preferences/datasets/book_passages/{mode}.jsonl"
)
"""OAI's `books` query dataset: passages of books, one JSON string per line
(# OAI: lm_human_preferences/datasets/books.py#L10)"""

TLDR_URL = "https://openaipublic.blob.core.windows.net/lm-human-preferences/tldr/{mode}-subset.json"
"""OAI's `tldr` query dataset: Reddit posts, a JSON list of objects with their text as `content`
(# OAI: lm_human_preferences/datasets/tldr.py#L17)"""


def book_passages(mode: str) -> list[str]:
    """OAI's book passages of `mode` (`train`: what OAI's query samplers read), downloaded once into the cache."""
    path = _query_dataset_file(
        BOOK_PASSAGES_URL.format(mode=mode), os.path.join("book_passages", f"{mode}.jsonl"), "books"
    )
    passages = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(_lines(f, path), 1):
            try:
                passage = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(
                    f"{path}: line {number}: not JSON ({e}); delete the file to download it again"
                ) from None
            if not isinstance(passage, str):
                raise UserError(
                    f"{path}: line {number}: expected a JSON string (a passage), got {type(passage).__name__}"
                )
            passages.append(passage)
    return passages


def tldr_posts(mode: str) -> list[str]:
    """OAI's TL;DR posts of `mode` (`train` or `valid`) as downloaded (once, into the cache): each post's `content`,
    not yet cleaned (`clean_tldr_post`, applied as a post is read, as OAI's generator does)."""
    path = _query_dataset_file(TLDR_URL.format(mode=mode), os.path.join("tldr", f"{mode}-subset.json"), "tldr")
    with open(path, encoding="utf-8") as f:
        try:
            records = json.loads("".join(_lines(f, path)))
        except json.JSONDecodeError as e:
            raise UserError(f"{path}: not JSON ({e}); delete the file to download it again") from None
    if not isinstance(records, list):
        raise UserError(f"{path}: expected a JSON list of posts, got {type(records).__name__}")
    posts = []
    for number, record in enumerate(records):
        if not (isinstance(record, dict) and isinstance(record.get("content"), str)):
            raise UserError(
                f"{path}: post {number}: expected an object with a string `content`, got {str(record)[:80]}"
            )
        posts.append(record["content"])
    return posts


def clean_tldr_post(text: str) -> str:
    """As OAI cleans a post: mojibake fixed by ftfy, runs of 3+ newlines made 2, stripped
    (# OAI: lm_human_preferences/datasets/tldr.py#L24-L29; OAI pinned ftfy 5.4.1, this runs ftfy 6)."""
    import ftfy

    return re.sub(r"\n{3,}", "\n\n", ftfy.fix_text(text)).strip()


def download_once(url: str, path: str) -> str:
    """`path`, downloaded from `url` if it is not there yet: whole or not at all (a connection closed early is an
    error, not a short file), so a run never reads a file cut short. OSError saying why it could not."""
    if os.path.exists(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = f"{path}.{os.getpid()}.tmp"  # each process of a multi-process run downloads its own, then renames
    try:
        with urllib.request.urlopen(url, timeout=60) as response, open(partial, "wb") as f:
            shutil.copyfileobj(response, f)
            # a connection closed early reads as the end of the file: the length says whether it was
            expected = response.headers.get("Content-Length")
            if expected is not None and f.tell() != int(expected):
                raise OSError(f"the connection closed after {f.tell()} of {expected} bytes")
    except (OSError, http.client.HTTPException) as e:
        with contextlib.suppress(FileNotFoundError):
            os.remove(partial)
        raise OSError(str(e)) from e
    os.replace(partial, path)
    return path


def _query_dataset_file(url: str, relative_path: str, dataset: str) -> str:
    """A query dataset's file in the cache (`download_once`); a UserError names the URL, where to put the file
    by hand, and the offline corpus."""
    from .assets import cache_dir

    path = os.path.join(cache_dir(), relative_path)
    try:
        return download_once(url, path)
    except OSError as e:
        raise UserError(
            f"task.query_dataset={dataset}: cannot download {url} ({e}); put that file at {path}, "
            "or use an offline corpus: --task.query-dataset chatterbot"
        ) from e


def _lines(f, path: str) -> Iterator[str]:
    try:
        yield from f
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text ({e}); delete the file to download it again") from None


def document_stream(name: str, seed: int) -> Iterator[str]:
    """Documents of a query dataset, shuffled by `seed`, forever (epoch after epoch)."""
    if name == "chatterbot":
        texts = chatterbot_texts()
        rng = random.Random(seed)
        while True:
            order = list(range(len(texts)))
            rng.shuffle(order)
            yield from (texts[i] for i in order)
    elif name in ("books", "tldr"):
        documents, clean = (book_passages("train"), None) if name == "books" else (tldr_posts("train"), clean_tldr_post)
        while True:  # OAI's generator runs again each epoch: `random.seed(seed)`, so the same order every time
            # OAI: lm_human_preferences/datasets/books.py#L7-L16
            # OAI: lm_human_preferences/datasets/tldr.py#L10-L29
            # OAI: lm_human_preferences/language/datasets.py#L33-L47 (seed 0, shuffle)
            # OAI: lm_human_preferences/language/datasets.py#L78 (rerun by repeat())
            order = list(documents)
            random.Random(seed).shuffle(order)  # the same permutation as random.seed(seed); random.shuffle(order)
            yield from order if clean is None else map(clean, order)
    else:
        raise UserError(f"task.query_dataset={name!r} is unknown; choose books, tldr or chatterbot")


MAX_SKIPPED_DOCUMENTS = 10_000
"""documents in a row that make no query before the query settings are taken to make none (OAI's books: nearly
every passage makes one)"""


class QuerySampler:
    """Batches of left-padded queries (B, query_length), this rank's share of a shuffled stream.

    Each rank reads every `world_size`-th usable document (OAI's `shard`). `batches_drawn` is the position to
    resume from.
    # OAI: lm_human_preferences/language/datasets.py#L80-L85
    """

    def __init__(self, task, tokenizer, batch_size: int, seed: int, rank: int = 0, world_size: int = 1):
        """`seed` orders the documents; OAI always uses 0 (`task.query_seed`), whatever the run's seed."""
        self.task, self.tokenizer, self.batch_size = task, tokenizer, batch_size
        self.pad_id = tokenizer.oai_pad_token_id
        self.start_token = single_token(tokenizer, task.start_text, "task.start_text")
        self.end_token = single_token(tokenizer, task.end_text, "task.end_text")
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.batches_drawn = 0
        self._queries = self._query_stream()

    def _query_stream(self) -> Iterator[list[int]]:
        index = skipped_in_a_row = 0
        for text in document_stream(self.task.query_dataset, self.seed):
            tokens = query_tokens(
                self.tokenizer.encode(text, add_special_tokens=False),
                self.task.query_length,
                self.start_token,
                self.end_token,
            )
            # OAI would pad it into an all-pad query, which its model asserts against:
            # OAI: lm_human_preferences/language/model.py#L338
            if not tokens:
                skipped_in_a_row += 1
                if skipped_in_a_row == MAX_SKIPPED_DOCUMENTS:  # it would search forever
                    raise UserError(
                        f"task.query_dataset={self.task.query_dataset}: {MAX_SKIPPED_DOCUMENTS} documents in a row "
                        f"make no query with task.query_length={self.task.query_length}, "
                        f"start_text={self.task.start_text!r}, end_text={self.task.end_text!r} "
                        "(a query starts after start_text and ends at the last end_text within query_length tokens)"
                    )
                continue
            skipped_in_a_row = 0
            if index % self.world_size == self.rank:
                yield tokens
            index += 1

    def __next__(self) -> torch.Tensor:
        batch = [next(self._queries) for _ in range(self.batch_size)]
        self.batches_drawn += 1
        return left_pad(batch, self.task.query_length, self.pad_id)

    def __iter__(self):
        return self

    def skip(self, num_batches: int) -> None:
        """Fast-forward to where a run that drew `num_batches` batches stopped."""
        for _ in range(num_batches):
            next(self)


def format_queries(queries: torch.Tensor, tokenizer, task) -> torch.Tensor:
    """`task.query_prefix` + query + `task.query_suffix`, left-padded: what the policy reads
    (the reward model reads the bare query, as in OAI).

    # OAI: lm_human_preferences/lm_tasks.py#L68-L79 (query_formatter)
    """
    prefix = tokenizer.encode(task.query_prefix, add_special_tokens=False)
    suffix = tokenizer.encode(task.query_suffix, add_special_tokens=False)
    if not prefix and not suffix:
        return queries
    pad_id = tokenizer.oai_pad_token_id
    rows = [prefix + strip_pad(q, pad_id) + suffix for q in queries.tolist()]
    return left_pad(rows, queries.shape[1] + len(prefix) + len(suffix), pad_id).to(queries.device)
