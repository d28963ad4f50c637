"""The actor: keeps the inference servers busy, `group_size` attempts per problem, scores them,
writes one record per group to the stream (`records.Group`).

How far it may run ahead of the trainer is the only thing the two modes change. In `pipeline` mode
it starts group k only while k < (servers' weight version + `steps_ahead`) * groups per step (the
servers get new weights every step, so generation and training overlap). In `sync` mode it starts
the groups of the round of `sync_steps` steps that the servers' weights begin, and no more (the
weights change once per round, at a multiple of `sync_steps`: the actor generates a round with
frozen weights, then waits while the trainer takes its steps), and sends requests only to servers
that have those weights.

A request that fails (server gone, connection dropped, 5xx, timeout) is sent again to another
server; a server that fails is left alone until its /health answers again.

With `--eval-every N` it also evaluates: once the servers serve the weights of step 0, N, 2N, ... and the last, it
samples the evaluation problems `--eval-samples` times each on them, beside the training requests, and writes an
`records.Evaluation` to the evaluation stream (`GRPOArgs.eval_stream_url`), which the trainer logs. It ends once the
last evaluation is written.

Run alone:
`python -m lm_human_preference_details.grpo.actor --task tiny --servers http://127.0.0.1:8000 --output-dir DIR`
"""

import asyncio
import concurrent.futures
import contextlib
import logging
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from lm_human_preference_details import cli
from lm_human_preference_details.grpo.client import check_serving
from lm_human_preference_details.grpo.config import PRESETS, GRPOArgs, get_preset
from lm_human_preference_details.grpo.lifetime import exit_with_parent
from lm_human_preference_details.grpo.protocol import MAX_CHOICES
from lm_human_preference_details.grpo.records import Attempt, EvaluatedProblem, Evaluation, Group
from lm_human_preference_details.grpo.rewards import (
    Problem,
    eval_problems,
    integer_reward,
    load_task_problems,
    math_rewards,
)
from lm_human_preference_details.grpo.streams import open_writer

log = logging.getLogger(__name__)

HEALTH_WAIT_S = 2.0
RETRY_AFTER_S = 1.0
MAX_ATTEMPTS_PER_REQUEST = 20


class ActorError(RuntimeError):
    """A request the servers refused, or one that failed on every try: the run cannot go on."""


@dataclass
class ServerState:
    url: str
    version: int = 0
    in_flight: int = 0
    down_until: float = 0.0

    def live(self) -> bool:
        return time.monotonic() >= self.down_until


class Actor:
    def __init__(
        self, args: GRPOArgs, server_urls: list[str], problems: list[Problem], evaluated: list[Problem] | None = None
    ):
        """`problems`: what the groups cycle through; `evaluated`: the problems of `--eval-every`'s evaluations."""
        if not server_urls:
            raise cli.UserError("--servers: the actor needs at least one server URL")
        self.args = args
        self.servers = [ServerState(url.rstrip("/")) for url in server_urls]
        self.problems = problems
        self.evaluated = evaluated or []
        self.schedule = args.run_schedule()
        self._changed: asyncio.Condition | None = None
        self._failure: BaseException | None = None
        self._verifier: concurrent.futures.Executor | None = None

    def weight_version(self) -> int:
        """The newest weights any server has: what the trainer last pushed, as far as we know."""
        return max(s.version for s in self.servers)

    def usable(self, server: ServerState) -> bool:
        """Answers, and its weights are not left behind (`Schedule.server_lag_allowed`)."""
        return server.live() and server.version >= self.weight_version() - self.schedule.server_lag_allowed()

    def may_start(self, group_index: int) -> bool:
        """Whether group `group_index` may start under the servers' newest weights (`Schedule.may_start`)."""
        return self.schedule.may_start(group_index, self.weight_version())

    async def run(self, first_group: int = 0) -> None:
        """Generate groups first_group .. steps * groups_per_step - 1 and write them to the stream."""
        self._changed = asyncio.Condition()
        # fork, not spawn: a spawned worker imports its modules again (math_verify, aiohttp: CPU taken from
        # the run); forked now, before any request, this process has run no torch op and has no thread but
        # the exit-with-parent watchdog
        self._verifier = concurrent.futures.ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("fork"), initializer=_verifier_process, initargs=(os.getpid(),)
        )
        self._verifier.submit(math_rewards, ["\\boxed{\\frac{1}{2}}"], "1/2")  # start it and warm math_verify up now
        writer = open_writer(self.args.stream_url())
        timeout = aiohttp.ClientTimeout(total=self.args.serving.request_timeout_s)
        connector = aiohttp.TCPConnector(limit=0)  # the per-server bound is ours: max_in_flight
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            watchers = {asyncio.create_task(self._watch_server(session, server)) for server in self.servers}
            pending: set[asyncio.Task] = set()
            if self.args.evaluation.eval_every:
                evaluations = asyncio.create_task(
                    self._evaluations(session, first_group // self.args.groups_per_step())
                )
                evaluations.add_done_callback(self._group_done)
                pending.add(evaluations)
            try:
                per_request = self.args.request_problems()
                for first in range(first_group, self.args.optim.steps * self.args.groups_per_step(), per_request):
                    await self._wait_for_room(first + per_request - 1)
                    problems = [self.problems[k % len(self.problems)] for k in range(first, first + per_request)]
                    task = asyncio.create_task(self._groups(session, writer, problems))
                    task.add_done_callback(self._group_done)
                    pending.add(task)
                    pending = await _reap(pending)
                while pending:
                    pending = await _reap(pending, wait=True)
            finally:
                for task in pending | watchers:
                    task.cancel()
                await asyncio.gather(*pending, *watchers, return_exceptions=True)
                writer.close()
                self._verifier.shutdown(cancel_futures=True)

    async def _wait_for_room(self, group_index: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self._failure is not None or self.may_start(group_index))
        if self._failure is not None:  # a group failed for good: the trainer would wait for it forever
            raise self._failure

    def _group_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None and self._failure is None:
            self._failure = task.exception()

            async def wake():
                async with self._changed:
                    self._changed.notify_all()

            asyncio.ensure_future(wake())

    async def _groups(self, session, writer, problems: list[Problem]) -> None:
        """Generate, score and write one group per problem."""
        n = self.args.sampling.group_size
        for problem, (prompt_ids, choices) in zip(problems, await self._complete(session, problems, n)):
            texts = [_text(choice) for choice in choices]
            rewards = await self._rewards(texts, problem.answer)
            attempts = [
                Attempt(
                    completion_ids=choice["token_ids"],
                    logprobs=choice["logprobs"]["token_logprobs"]
                    if "token_logprobs" in choice["logprobs"]
                    else [c["logprob"] for c in choice["logprobs"]["content"]],
                    versions=choice["model_versions"],
                    finish_reason=choice["finish_reason"],
                    text=text,
                    reward=reward,
                )
                for choice, text, reward in zip(choices, texts, rewards)
            ]
            writer.write(
                Group(
                    problem_id=problem.id,
                    answer=problem.answer,
                    prompt_ids=prompt_ids,
                    temperature=self.args.sampling.temperature,  # of the behaviour logprobs: the trainer's must match
                    attempts=attempts,
                )
            )

    async def _rewards(self, texts: list[str], answer: str) -> list[float]:
        """Each completion's reward (the answer prefix put back in front)."""
        completions = [self.args.task.answer_prefix + t for t in texts]
        rewards = [integer_reward(c, answer, self.args.task.integer_answers) for c in completions]
        if None in rewards:  # math_verify's timeout is a SIGALRM: it needs a main thread, hence a process
            rewards = await asyncio.get_running_loop().run_in_executor(
                self._verifier, math_rewards, completions, answer
            )
        return rewards

    async def _evaluations(self, session, start: int) -> None:
        """Each evaluation the schedule has after step `start` (`Schedule.evaluations`), once the servers serve its
        weights, written to the evaluation stream as it ends."""
        writer = open_writer(self.args.eval_stream_url())
        try:
            for step in self.schedule.evaluations(self.args.evaluation.eval_every, start):
                async with self._changed:
                    await self._changed.wait_for(lambda: self.weight_version() >= step)  # noqa: B023 (awaited here)
                log.info(
                    "evaluating step %d: %d problems x %d samples",
                    step,
                    len(self.evaluated),
                    self.args.evaluation.eval_samples,
                )
                evaluation = await self._evaluate(session, step)
                writer.write(evaluation)
                log.info("evaluated step %d in %.1f s", step, evaluation.seconds)
        finally:
            writer.close()

    async def _evaluate(self, session, step: int) -> Evaluation:
        """`eval_samples` completions of each evaluation problem, scored, in requests of at most a training
        request's samples (one problem per request with `--chat`), all sent at once past `max_in_flight`: rationed
        with the training requests, an evaluation spanned several weight versions."""
        started, samples = time.monotonic(), self.args.evaluation.eval_samples
        per_request = max(1, min(self.args.request_problems() * self.args.sampling.group_size, MAX_CHOICES) // samples)
        requests = [self.evaluated[i : i + per_request] for i in range(0, len(self.evaluated), per_request)]
        answered = await asyncio.gather(
            *(self._complete(session, problems, samples, capped=False) for problems in requests)
        )
        problems, versions = [], []
        for problem, (_, choices) in zip(self.evaluated, (one for request in answered for one in request)):
            texts = [_text(choice) for choice in choices]
            versions += [v for choice in choices for v in choice["model_versions"]]
            problems.append(
                EvaluatedProblem(
                    problem_id=problem.id,
                    prompt=problem.prompt,
                    answer=problem.answer,
                    completions=texts,
                    rewards=await self._rewards(texts, problem.answer),
                    tokens=[len(choice["token_ids"]) for choice in choices],
                )
            )
        return Evaluation(
            step=step,
            version_min=min(versions, default=step),
            version_max=max(versions, default=step),
            samples=samples,
            seconds=time.monotonic() - started,
            problems=problems,
        )

    async def _complete(
        self, session, problems: list[Problem], n: int, capped: bool = True
    ) -> list[tuple[list[int], list[dict]]]:
        """`n` attempts at each problem: (prompt token ids, its choices) per problem. One completion request for all
        of them (a list of prompts), or one chat request per problem; `capped`: within `max_in_flight`."""
        sampling = {
            "max_tokens": self.args.sampling.max_tokens,
            "temperature": self.args.sampling.temperature,
            "n": n,
            "ignore_eos": self.args.sampling.ignore_eos,
        }
        if self.args.task.chat:
            bodies = await asyncio.gather(
                *(
                    self._request(
                        session,
                        "/v1/chat/completions",
                        {"messages": self.args.task.chat_messages(p.prompt), **sampling},
                        capped,
                    )
                    for p in problems
                )
            )
            return [(body["prompt_token_ids"], body["choices"]) for body in bodies]
        payload = {"prompt": [p.prompt for p in problems], **sampling}
        body = await self._request(session, "/v1/completions", payload, capped)
        return [(ids, body["choices"][i * n : (i + 1) * n]) for i, ids in enumerate(body["prompt_token_ids"])]

    async def _request(self, session, endpoint: str, payload: dict, capped: bool = True) -> dict:
        """POST to the least busy usable server (`capped`: one with fewer than `max_in_flight` requests); sent again
        to another server when one fails."""
        for attempt in range(MAX_ATTEMPTS_PER_REQUEST):
            server = await self._acquire_server(capped)
            try:
                async with session.post(server.url + endpoint, json=payload) as response:
                    if response.status < 500:
                        body = await response.json()
                        if response.status != 200:  # our request is wrong: retrying cannot help
                            raise ActorError(f"{server.url}{endpoint} refused the request: {body.get('error', body)}")
                        server.version = max([server.version] + [c["model_versions"][-1] for c in body["choices"]])
                        return body
                    reason = f"HTTP {response.status}"
            except (TimeoutError, aiohttp.ClientError, ConnectionError) as error:
                reason = repr(error)
            finally:
                await self._release_server(server)
            server.down_until = time.monotonic() + RETRY_AFTER_S
            log.warning("request to %s failed (%s): retrying elsewhere (%d)", server.url, reason, attempt + 1)
        raise ActorError(f"a completion failed {MAX_ATTEMPTS_PER_REQUEST} times; last error: {reason}")

    async def _acquire_server(self, capped: bool = True) -> ServerState:
        """The least busy usable server with a free slot (`capped`; else any), once there is one; an ActorError when
        no server has been usable for `request_timeout_s` (all down, or left behind by the newest weights: nothing
        would come)."""
        last_usable, timeout_s = time.monotonic(), self.args.serving.request_timeout_s
        async with self._changed:
            while True:
                usable = [s for s in self.servers if self.usable(s)]
                free = [s for s in usable if s.in_flight < self.args.serving.max_in_flight or not capped]
                if free:
                    server = min(free, key=lambda s: s.in_flight)
                    server.in_flight += 1
                    return server
                if usable:
                    last_usable = time.monotonic()
                elif time.monotonic() - last_usable > timeout_s:
                    raise ActorError(
                        f"no server has been usable for {timeout_s:g} s (--request-timeout-s): "
                        f"{', '.join(f'{s.url} at version {s.version}' for s in self.servers)}, the newest weights "
                        f"are version {self.weight_version()}; see the servers' logs"
                    )
                with contextlib.suppress(asyncio.TimeoutError):  # a slot frees up, or a server comes back
                    await asyncio.wait_for(self._changed.wait(), timeout=RETRY_AFTER_S)

    async def _release_server(self, server: ServerState) -> None:
        async with self._changed:
            server.in_flight -= 1
            self._changed.notify_all()

    async def _watch_server(self, session, server: ServerState) -> None:
        """Follow a server's weight version (long-polling /health) and whether it answers."""
        timeout = aiohttp.ClientTimeout(total=HEALTH_WAIT_S + 5)
        while True:
            asked = server.version
            url = f"{server.url}/health?wait_for_version={asked + 1}&timeout_s={HEALTH_WAIT_S}"
            try:
                async with session.get(url, timeout=timeout) as response:
                    health = await response.json()
                if response.status != 200:  # stale weights (it lost the trainer): no more requests to it
                    raise ValueError(health.get("error", response.status))
                if not server.live():
                    log.info("server %s is back", server.url)
                if (
                    health["model_version"] < asked
                ):  # a server's version only grows: this one restarted, with older weights
                    log.warning("server %s restarted at version %d", server.url, health["model_version"])
                    server.version = health["model_version"]
                else:  # (a completion that saw newer weights may have come back meanwhile: never lower)
                    server.version = max(server.version, health["model_version"])
                server.down_until = 0.0
            except (TimeoutError, aiohttp.ClientError, ConnectionError, ValueError) as error:
                if server.live():
                    log.warning("server %s is not serving (%r): no requests to it until it answers", server.url, error)
                server.down_until = max(server.down_until, time.monotonic() + RETRY_AFTER_S)
                await asyncio.sleep(RETRY_AFTER_S / 4)
            async with self._changed:
                self._changed.notify_all()


def _text(choice: dict) -> str:
    """A choice's text, of a completion or a chat reply."""
    return choice["text"] if "text" in choice else choice["message"]["content"]


def _verifier_process(parent: int) -> None:
    """A forked verifier worker: the actor's signal handlers (its asyncio loop's) are not its own."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the actor shuts us down
    exit_with_parent(parent)


async def _reap(pending: set[asyncio.Task], wait: bool = False) -> set[asyncio.Task]:
    """Drop finished group tasks, raising the first failure."""
    if wait:
        await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
    for task in [t for t in pending if t.done()]:
        task.result()
        pending.discard(task)
    return pending


def run(args: GRPOArgs, wait_for_servers: Callable[[], list[str]], first_group: int = 0) -> None:
    """Run the actor until its last group is written, or until SIGTERM/SIGINT (then stop cleanly).
    `wait_for_servers()` returns the servers' URLs once they serve (the problems load meanwhile)."""
    problems = load_task_problems(args)
    evaluated = eval_problems(args) if args.evaluation.eval_every else []
    server_urls = wait_for_servers()

    async def main():
        task = asyncio.current_task()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, task.cancel)
        actor = Actor(args, server_urls, problems, evaluated)
        try:
            await actor.run(first_group)
        except asyncio.CancelledError:
            log.info("actor stopped")

    asyncio.run(main())


@cli.main_with_user_errors
def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s actor %(message)s")
    # the launcher's flags, this role's purpose
    args = cli.parse(GRPOArgs, get_preset, "tiny", description=__doc__.split("\n\n")[0], presets=PRESETS)
    args.check()
    if args.resume:
        raise cli.UserError(
            "--resume: resume a run through grpo.launch, which restarts the servers with the checkpoint's "
            "weights and version, drops the stream's records after the checkpoint and starts the actor at its step"
        )
    check_serving(args.serving.servers, 0, args.task.model)
    run(args, wait_for_servers=lambda: args.serving.servers)


if __name__ == "__main__":
    main()
