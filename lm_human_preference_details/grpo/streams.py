"""The sample stream from the GRPO actor (one writer) to the trainer (readers): typed records, in write order.

One interface, two backends, picked by URL (`parse_stream_url`):
- a plain path or `file:///abs/path.jsonl`: a JSON-lines file, one record a line; no server needed (default);
- `redis://host:port/db?stream=NAME&maxlen=N`: a Redis stream, one entry a record, its single field `json`
  holding the record's JSON text; for an actor and a trainer on different hosts.

A record is written as the JSON text of its `to_json()` and read back by the `decode` the reader is opened with
(`records.Group.from_json`); a line that `decode` refuses stops the reader with a UserError naming the line (or
Redis entry). JSON only on the wire, never pickle: reading a record runs no code chosen by whoever can write the
stream, and a stream can be inspected with `jq` or `redis-cli`. Float64 values come back exactly (`json` writes
the shortest repr that reads back to the same float).

A reader's `position` is absolute (records skipped by `start` included), so a trainer that saves it in its
checkpoint resumes with `open_reader(url, decode, start=position)`.
"""

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from lm_human_preference_details.cli import UserError

if TYPE_CHECKING:
    import redis

URL_FORMS = "a path, file:///abs/path.jsonl, or redis://host:port/db?stream=NAME[&maxlen=N]"
POLL_S = 0.002  # how long a file reader sleeps between looks at the file: 2 ms of latency, no busy loop
REDIS_SKIP_BATCH = 1000  # entries fetched per XREAD while skipping `start` entries, so no reply is huge

R = TypeVar("R")
Decode = Callable[[str | bytes], R]
"""a record from its JSON text; a ValueError naming the field for text that is not one"""


class Record(Protocol):
    """What a stream carries: an object that writes itself as one line of JSON."""

    def to_json(self) -> str: ...


class StreamWriter(Protocol):
    """The actor's end: appends records."""

    def write(self, record: Record) -> None:
        """Append one record; readers can see it when this returns."""

    def close(self) -> None: ...


class StreamReader(Protocol[R]):
    """The trainer's end: reads records in write order, from `start` on."""

    def read(self, max_records: int, timeout_s: float) -> list[R]:
        """1..max_records records, waiting up to timeout_s for the first; [] if none came in time."""

    @property
    def position(self) -> int:
        """Records consumed so far, counting those skipped by `start`."""

    def close(self) -> None: ...


class StreamConnectionError(ConnectionError):
    """The stream's server cannot be reached; the message names the URL and how to start the server."""


@dataclass(frozen=True)
class FileStreamUrl:
    """A JSON-lines file."""

    path: str


@dataclass(frozen=True)
class RedisStreamUrl:
    """A Redis stream; credentials in the URL are refused, so that error messages can quote it whole."""

    url: str  # as the user wrote it, for error messages
    host: str
    port: int
    db: int
    stream: str
    maxlen: int | None  # approximate cap on the stream's length (XADD MAXLEN ~); None keeps every entry


def parse_stream_url(url: str) -> FileStreamUrl | RedisStreamUrl:
    """Which backend and where; a malformed URL is a UserError naming the valid forms."""
    if url and "://" not in url:
        return FileStreamUrl(url)
    parts = urlsplit(url)
    try:
        if parts.scheme == "file" and parts.netloc in ("", "localhost") and parts.path:
            return FileStreamUrl(unquote(parts.path))
        if parts.scheme == "redis" and not (parts.username or parts.password):
            options = dict(parse_qsl(parts.query))
            unknown = options.keys() - {"stream", "maxlen"}
            if unknown:
                raise ValueError(f"unknown parameters {sorted(unknown)}")
            maxlen = int(options["maxlen"]) if "maxlen" in options else None
            if maxlen is not None and maxlen < 1:
                raise ValueError("maxlen must be at least 1")
            return RedisStreamUrl(
                url=url,
                host=parts.hostname or "localhost",
                port=parts.port or 6379,  # .port raises ValueError on a port that is not a number
                db=int(parts.path.strip("/") or 0),
                stream=options.get("stream", "samples"),
                maxlen=maxlen,
            )
    except ValueError as e:
        raise UserError(f"bad stream URL {url!r} ({e}); expected {URL_FORMS}") from e
    raise UserError(f"bad stream URL {url!r}; expected {URL_FORMS}")


def companion_url(url: str, name: str, path: str) -> str:
    """The URL of a second stream beside the one at `url`: a Redis stream `<stream>-<name>` on the same server (all
    of it kept: maxlen is the samples'), or the file `path` when `url` is a file."""
    match parse_stream_url(url):
        case FileStreamUrl():
            return path
        case RedisStreamUrl(url=given, stream=stream):
            parts = urlsplit(given)
            return urlunsplit(parts._replace(query=urlencode({"stream": f"{stream}-{name}"})))


def open_writer(url: str) -> StreamWriter:
    """The writing end of the stream at `url` (see `parse_stream_url`)."""
    match parse_stream_url(url):
        case FileStreamUrl(path):
            return FileStreamWriter(path)
        case RedisStreamUrl() as where:
            return RedisStreamWriter(where)


def open_reader(url: str, decode: Decode[R], start: int = 0) -> StreamReader[R]:
    """A reading end of the stream at `url` that skips its first `start` records (resume) and reads the others with
    `decode`."""
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    match parse_stream_url(url):
        case FileStreamUrl(path):
            return FileStreamReader(path, decode, start)
        case RedisStreamUrl() as where:
            return RedisStreamReader(where, decode, start)


def read_all(url: str, decode: Decode[R]) -> list[R]:
    """Every record the stream at `url` holds now, read with `decode`."""
    reader = open_reader(url, decode)
    found = []
    while batch := reader.read(64, timeout_s=0):
        found += batch
    reader.close()
    return found


def truncate(url: str, keep: int) -> int:
    """Drop every record after the first `keep` (a resumed run's trainer consumed `keep`; what the
    crashed run wrote after them came from weights that are gone). Returns how many were dropped."""
    match parse_stream_url(url):
        case FileStreamUrl(path):
            return _truncate_file(path, keep)
        case RedisStreamUrl() as where:
            client = _connect(where)
            try:
                with _reaching(where):
                    ids = [entry_id for entry_id, _ in client.xrange(where.stream)][keep:]
                    if ids:
                        client.xdel(where.stream, *ids)
                return len(ids)
            finally:
                client.close()


def _truncate_file(path: str, keep: int) -> int:
    if not os.path.exists(path):
        return 0
    with open(path, "r+b") as f:
        lines = f.read().split(b"\n")[:-1]  # complete lines; a partial last one is never a record
        f.truncate(sum(len(line) + 1 for line in lines[:keep]))
    return max(0, len(lines) - keep)


def _decoded(decode: Decode[R], text: str | bytes, where: str) -> R:
    """`decode(text)`; a line it refuses is a UserError naming `where` it is in the stream."""
    try:
        return decode(text)
    except ValueError as error:
        raise UserError(f"the stream's {where}: {error}") from None


def _check_max_records(max_records: int) -> None:
    if max_records < 1:  # Redis reads COUNT 0 as "no limit", so refuse it for both backends
        raise ValueError(f"max_records must be >= 1, got {max_records}")


# ---------------------------------------------------------------- JSON-lines file


class FileStreamWriter:
    """Appends one JSON line per record; reopening an existing file appends after its records (resume)."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        _drop_partial_line(path)  # a writer killed mid-line: the next record must not be glued to it
        self._file = open(path, "a", encoding="utf-8")

    def write(self, record: Record) -> None:
        """Append one line and flush it to the OS."""
        self._file.write(record.to_json() + "\n")  # JSON escapes newlines in strings: one record, one line
        # flush, no fsync: flush hands the bytes to the kernel, whose page cache every process on this host
        # reads at once; fsync would only add surviving a host crash, which ends the run's processes too,
        # at a disk round trip per record. (Across hosts, use a redis:// stream, not a shared file system.)
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _drop_partial_line(path: str) -> None:
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return
    with open(path, "r+b") as f:
        data = f.read()
        if not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


class FileStreamReader(Generic[R]):
    """Tails a JSON-lines file, polling every POLL_S; waits for a file that does not exist yet."""

    def __init__(self, path: str, decode: Decode[R], start: int = 0):
        self._path = path
        self._decode = decode
        self._file = None  # opened at the first read that finds the file
        self._partial = b""  # the start of a line whose '\n' the writer has not written yet
        self._to_skip = start
        self._position = start

    @property
    def position(self) -> int:
        return self._position

    def read(self, max_records: int, timeout_s: float) -> list[R]:
        """Complete lines only: a last line without its '\n' waits for the writer to finish it."""
        _check_max_records(max_records)
        deadline = time.monotonic() + timeout_s
        while True:
            records = self._read_available(max_records)
            if records or time.monotonic() >= deadline:
                self._position += len(records)
                return records
            time.sleep(POLL_S)

    def _read_available(self, max_records: int) -> list[R]:
        if self._file is None:
            try:
                self._file = open(self._path, "rb")
            except FileNotFoundError:
                return []
        records = []
        while len(records) < max_records:
            line = self._file.readline()  # at EOF, b"" or the unfinished end; a later call reads what followed
            if not line.endswith(b"\n"):
                self._partial += line
                return records
            line, self._partial = self._partial + line, b""
            if self._to_skip:
                self._to_skip -= 1
            else:
                line_number = self._position + len(records) + 1  # lines and records are one to one
                records.append(_decoded(self._decode, line[:-1], f"{self._path} line {line_number}"))
        return records

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


# ---------------------------------------------------------------- Redis stream


def _connect(where: RedisStreamUrl) -> "redis.Redis":
    try:
        import redis  # imported here so that file streams work without the package
    except ModuleNotFoundError as e:
        raise UserError(f"{where.url} needs the `redis` package: pip install redis") from e
    client = redis.Redis(
        host=where.host,
        port=where.port,
        db=where.db,
        decode_responses=True,
        protocol=2,  # the reply shapes parsed below are RESP2's
        socket_connect_timeout=5,  # an unreachable host fails in seconds rather than the OS's minutes
    )
    with _reaching(where):
        client.ping()  # fail when the stream is opened, not at the first record
    return client


@contextlib.contextmanager
def _reaching(where: RedisStreamUrl) -> Iterator[None]:
    """Turn redis-py's connection errors into one naming the URL and the fix."""
    import redis

    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError) as e:
        raise StreamConnectionError(
            f"cannot reach Redis at {where.url} ({e}): is redis-server running? "
            f"start it with `redis-server --port {where.port}`"
        ) from e


class RedisStreamWriter:
    """XADDs each record as an entry whose single field `json` holds its JSON text."""

    def __init__(self, where: RedisStreamUrl):
        self._where = where
        self._client = _connect(where)

    def write(self, record: Record) -> None:
        """XADD, acknowledged by the server: readers see the entry when this returns."""
        # MAXLEN ~ lets Redis trim whole internal nodes, far cheaper than an exact cap; a reader further
        # behind than maxlen loses the oldest records (and `start` counts from the oldest kept).
        with _reaching(self._where):
            self._client.xadd(
                self._where.stream, {"json": record.to_json()}, maxlen=self._where.maxlen, approximate=True
            )

    def close(self) -> None:
        self._client.close()


class RedisStreamReader(Generic[R]):
    """XREAD BLOCK from the last entry id it returned ('0-0' at first: the stream's beginning)."""

    def __init__(self, where: RedisStreamUrl, decode: Decode[R], start: int = 0):
        self._where = where
        self._decode = decode
        self._client = _connect(where)
        self._last_id = "0-0"
        self._to_skip = start  # skipped at reads, as the entries arrive: the stream may be shorter yet
        self._position = start

    @property
    def position(self) -> int:
        return self._position

    def read(self, max_records: int, timeout_s: float) -> list[R]:
        """Entries after the last one read, in order."""
        _check_max_records(max_records)
        deadline = time.monotonic() + timeout_s
        while self._to_skip:
            skipped = self._xread(min(self._to_skip, REDIS_SKIP_BATCH), deadline)
            if not skipped:
                return []
            self._to_skip -= len(skipped)
        records = [
            _decoded(self._decode, fields.get("json", ""), f"{self._where.url} entry {entry_id}")
            for entry_id, fields in self._xread(max_records, deadline)
        ]
        self._position += len(records)
        return records

    def _xread(self, count: int, deadline: float) -> list[tuple[str, dict]]:
        block_ms = math.ceil(
            (deadline - time.monotonic()) * 1000
        )  # rounded up: not back before the timeout (to Redis's millisecond)
        with _reaching(self._where):
            # BLOCK 0 would wait forever, so a spent deadline asks once without blocking
            block = block_ms if block_ms > 0 else None
            reply = self._client.xread({self._where.stream: self._last_id}, count=count, block=block)
        entries = reply[0][1] if reply else []  # RESP2: [[stream, [(id, fields), ...]]]
        if entries:
            self._last_id = entries[-1][0]
        return entries

    def close(self) -> None:
        self._client.close()
