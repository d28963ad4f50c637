"""The control side of the GRPO pipeline contract (`http_contract`): who may call /init_process_group and
/request_weight_update (the control token), where a server joins a weight group (the rendezvous allow-list), and
those two requests' fields, checked.

The standard library, aiohttp and `grpo.protocol` only: it imports in the vLLM environment.
"""

import hmac
import ipaddress
import os
import socket
from dataclasses import dataclass
from typing import get_args
from urllib.parse import urlparse

from aiohttp import web

from lm_human_preference_details.grpo.protocol import TOKEN_ENV, ParameterSpec, WeightBackend, is_loopback, mismatches
from lm_human_preference_details.grpo.serving.request_checks import BadRequest, read_field

DEFAULT_JOIN_TIMEOUT_S = 300.0
"""/init_process_group's `timeout_s` unless it says: the rendezvous, and then each broadcast of an update"""


class RendezvousTimeout(RuntimeError):
    """/init_process_group's rendezvous did not come within its `timeout_s`: answered with 504."""


@dataclass(frozen=True)
class ControlAccess:
    """Who may call the control endpoints (/init_process_group, /request_weight_update) and where a server will
    connect to join a weight group."""

    token: str = ""
    """the shared secret a control request carries as `Authorization: Bearer TOKEN` ("" takes none: loopback only)"""
    rendezvous_networks: tuple = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))
    """the addresses an `init_method` may name (ipaddress networks); empty: any"""

    @classmethod
    def for_server(cls, host: str, token_file: str, rendezvous_allow: list[str]) -> "ControlAccess":
        """The access of a server that binds `host`: the token from `token_file`, else from $GRPO_SERVER_TOKEN
        (required beyond loopback: SystemExit without one); rendezvous within `rendezvous_allow` (addresses or
        networks), by default loopback on loopback and any address beyond it (where the token guards the group)."""
        token = os.environ.get(TOKEN_ENV, "")
        if token_file:
            try:
                with open(token_file) as f:
                    token = f.read().strip()
            except (OSError, UnicodeDecodeError) as error:
                raise SystemExit(f"error: --token-file {token_file}: cannot read it ({error})") from None
            if not token:
                raise SystemExit(f"error: --token-file {token_file} is empty: write the control token in it")
        loopback = is_loopback(host)
        if not token and not loopback:
            raise SystemExit(
                f"error: --host {host} listens beyond loopback, where anyone who reaches the port could push weights: "
                f"give a control token in ${TOKEN_ENV} or a file named by --token-file (and the same to the trainer)"
            )
        try:
            networks = tuple(ipaddress.ip_network(a, strict=False) for a in rendezvous_allow)
        except ValueError as error:
            raise SystemExit(
                f"error: --rendezvous-allow: {error} (expected addresses or networks, e.g. 10.0.0.0/8)"
            ) from None
        return cls(token, networks if rendezvous_allow else cls.rendezvous_networks if loopback else ())

    def authorize(self, request: web.Request) -> None:
        """A control request must carry the server's token, when it has one (401 otherwise)."""
        if not self.token:
            return
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
            raise web.HTTPUnauthorized(
                reason=f"control endpoints need the server's token: send `Authorization: Bearer TOKEN` "
                f"(grpo.client sends ${TOKEN_ENV})"
            )

    def check_rendezvous(self, init_method: str) -> None:
        """BadRequest unless `init_method` is tcp://HOST:PORT and HOST is within the server's rendezvous networks
        (a name: every address it resolves to)."""
        url = urlparse(init_method)
        try:
            port = url.port
        except ValueError:
            port = None
        if url.scheme != "tcp" or not url.hostname or not port:
            raise BadRequest(f"field 'init_method': {init_method!r}: expected tcp://HOST:PORT")
        if not self.rendezvous_networks:
            return
        try:
            addresses = {ipaddress.ip_address(info[4][0]) for info in socket.getaddrinfo(url.hostname, port)}
        except (OSError, ValueError) as error:
            raise BadRequest(f"field 'init_method': cannot resolve {url.hostname} ({error})") from None
        outside = [a for a in addresses if not any(a in n for n in self.rendezvous_networks)]
        if outside:
            raise BadRequest(
                f"field 'init_method': {url.hostname} ({outside[0]}) is outside the addresses this server joins "
                f"groups at ({', '.join(map(str, self.rendezvous_networks))}): start it with "
                f"--rendezvous-allow to add them"
            )


LOOPBACK_ACCESS = ControlAccess()
"""no token, groups joined on loopback only: a server in a test, or one that only its own machine reaches"""


@dataclass(frozen=True)
class JoinRequest:
    """/init_process_group's body, checked: the trainer's group to join."""

    init_method: str
    rank: int
    world_size: int
    backend: str
    timeout_s: float

    @classmethod
    def from_body(cls, body: dict, ranks: int = 1) -> "JoinRequest":
        """BadRequest unless the fields are sound and the group has room for the server's `ranks` ranks from `rank`
        on (a tensor-parallel vLLM server's workers join one rank each)."""
        init_method = read_field(body, "init_method", str, None, need="a string tcp://HOST:PORT")
        rank = read_field(body, "rank", int, None, lambda v: v >= 1, "an integer >= 1 (rank 0 is the trainer)")
        world_size = read_field(
            body,
            "world_size",
            int,
            None,
            lambda v: v >= rank + ranks,
            f"an integer >= rank + {ranks} (this server joins with {ranks} ranks: /health's weight_ranks)",
        )
        backend = read_field(body, "backend", str, "gloo", lambda v: v in get_args(WeightBackend), "gloo or nccl")
        timeout_s = read_field(
            body,
            "timeout_s",
            float,
            DEFAULT_JOIN_TIMEOUT_S,
            lambda v: 0 < v <= 24 * 3600,
            "a number of seconds in (0, 86400]: how long to wait for the trainer's side, then for each broadcast",
        )
        return cls(init_method, rank, world_size, backend, timeout_s)


@dataclass(frozen=True)
class UpdateRequest:
    """/request_weight_update's body, checked: a version above the latest and parameters the model has."""

    version: int
    specs: list[ParameterSpec]
    bucket_bytes: int

    @classmethod
    def from_body(cls, body: dict, latest: int, expected: list[ParameterSpec]) -> "UpdateRequest":
        """BadRequest unless the version is above `latest` and the parameters are `expected`'s names, shapes and
        dtypes."""
        version = read_field(
            body, "version", int, None, lambda v: v > latest, f"an integer above the latest version {latest}"
        )
        try:
            specs = [ParameterSpec.from_json(p) for p in read_field(body, "parameters", list, None, need="a list")]
        except (KeyError, TypeError, ValueError, OverflowError) as error:
            raise BadRequest(f"field 'parameters': each entry needs name, shape and dtype ({error})") from None
        bucket_bytes = read_field(
            body, "bucket_bytes", int, 0, lambda v: v >= 0, "an integer >= 0 (0: one broadcast per tensor)"
        )
        reasons = mismatches(expected, specs)
        if reasons:
            raise BadRequest(
                f"update refused, the old weights keep serving: {'; '.join(reasons[:10])}"
                + (f" (and {len(reasons) - 10} more)" if len(reasons) > 10 else "")
            )
        return cls(version, specs, bucket_bytes)
