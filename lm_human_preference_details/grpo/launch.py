"""One command for a GRPO run: inference servers, actor and trainer, each a process; the same command on every node.

    python -m lm_human_preference_details.grpo.launch --task tiny --mode pipeline --output-dir runs/grpo-tiny
    python -m lm_human_preference_details.grpo.launch --task tiny --mode sync --sync-steps 4 \\
        --output-dir runs/grpo-tiny-sync

The run ends when the trainer has taken `--steps` optimizer steps. Where the processes go is the world map's
(`grpo.world`): on one device the servers share it with the trainer; with several (`--inference-gpus`), servers
run on devices of their own and the trainer is one process per remaining device, sharded with FSDP2 (over gloo on
CPUs, NCCL on GPUs; the environment `accelerate launch --config_file configs/accelerate/fsdp2.yaml` would give
them): the first sends the weights, logs and checkpoints, and one that fails ends the run. Over several nodes
(`--nnodes`, or the scheduler's variables) each node's launcher starts its share of the map, and they meet through
a TCPStore on node 0 (`grpo.rendezvous`); a node that fails or is killed ends the run on every node, and a signal to
stop (below) that reaches any node's launcher stops every node at one step.

Every process it started is stopped when the run ends, when it fails, on Ctrl-C, and (through a watchdog in each
child) when the launcher itself is killed. SIGTERM or SIGUSR1 (a cluster's "stop soon": `preemption`) goes on to the
trainer, which stops after the step in flight with a checkpoint; then the rest stops and the launcher exits with
`cli.PREEMPTED` (a second signal ends it at once). A server that dies is tolerated while another serves; the actor
retries its requests elsewhere. `--resume` continues from the last checkpoint (`--resume auto`: if there is one).
The trainer and the actor start with the servers and receive the servers' URLs once they serve.

`--engine` picks the servers: grpo/serving/server.py (`home`) or grpo/serving/vllm_server.py (`vllm`, in the vLLM
environment); `auto` takes vLLM where its environment exists and a GPU is visible.

Files in `--output-dir`: metrics.jsonl (one line per optimizer step, and one per evaluation with `--eval-every`),
samples.jsonl, stream.jsonl (the samples the actor wrote), eval.jsonl (its evaluations, completions too),
world.json (the map, the servers' URLs), servers.json (each server's /metrics and engine at the end), logs/ (vLLM's
caches and sockets too, in logs/vllm-server-N/). The last line printed sums the run up (`run_summary`).
"""

import contextlib
import json
import logging
import multiprocessing
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection

from lm_human_preference_details import cli, preemption, tracking
from lm_human_preference_details.grpo import nodes, rendezvous, streams
from lm_human_preference_details.grpo.client import ServerError, check_serving, request_json
from lm_human_preference_details.grpo.config import PRESETS, GRPOArgs, get_preset
from lm_human_preference_details.grpo.lifetime import exit_now, exit_with_parent
from lm_human_preference_details.grpo.protocol import TOKEN_ENV
from lm_human_preference_details.grpo.server_processes import (
    VLLM_OWN_GPU_MEMORY,
    ServerEngine,
    last_error_line,
    server_flags,
)

log = logging.getLogger(__name__)

SERVER_START_TIMEOUT_S = 600


class RoleExited(RuntimeError):
    """The trainer or the actor ended while the servers were loading (its traceback is in the output above)."""


def _role(
    name: str, args: GRPOArgs, server_urls: Connection, first_group: int, launcher: int, environment: dict[str, str]
) -> None:
    """The trainer (one of its processes: `trainer`, `trainer-1`, ...) or the actor, in this process's environment
    and `environment` (a trainer process's place in its group). It starts while the servers load (its imports and,
    for the trainer, its models take seconds) and receives their URLs from the launcher once they serve."""
    os.environ.update(environment)  # before torch and accelerate are imported, which read it
    exit_with_parent(launcher)
    cli.quiet_transformers()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the launcher decides
    # each role imports only its own side (this module is kept light: the trainer and the actor import it
    # first, and the launcher starts the servers only once it is imported)
    # what the user can fix (a problems file, a stream, a request the servers refuse) ends the role with one line
    user_facing: tuple[type[Exception], ...] = (cli.UserError, streams.StreamConnectionError)
    try:
        if name.startswith("trainer"):
            # SIGTERM is "stop after this step" from the start (`trainer.train`'s handlers), not a kill while loading
            with preemption.listening():
                from lm_human_preference_details.grpo import trainer

                trainer.train_then_exit(args, wait_for_servers=server_urls.recv)
        else:
            from lm_human_preference_details.grpo import actor

            user_facing += (actor.ActorError,)
            actor.run(args, wait_for_servers=server_urls.recv, first_group=first_group)
    except preemption.Preempted:  # checkpointed: the launcher says where the run stopped
        exit_now(cli.PREEMPTED)
    except user_facing as error:
        print(f"error: the {name}: {error}", file=sys.stderr, flush=True)
        exit_now(2)  # the trainer may have joined a gloo group, whose teardown at interpreter exit can abort


def free_port() -> int:
    """A port nothing listens on now (the OS handed it out and it was closed again)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Run:
    """This node's processes of one run; `stop` ends them all (SIGTERM, then SIGKILL after a grace period)."""

    def __init__(
        self,
        args: GRPOArgs,
        plan: nodes.NodePlan,
        engine: "ServerEngine | None" = None,
        meeting=None,
        stop: preemption.StopSignals | None = None,
    ):
        """`meeting`: the other nodes' launchers (`rendezvous.Rendezvous`), None for a run on one node; `stop`: the
        launcher's signals (`preemption.listening`), forwarded to the trainer."""
        self.args, self.plan, self.meeting = args, plan, meeting
        self.stop_signals = stop or preemption.StopSignals()
        self.engine = engine or ServerEngine("home", args.output_dir)
        self.engines: dict[str, str] = {}  # URL: the engine of each server started here
        self.servers: list[subprocess.Popen] = []
        self.server_urls: list[str] = list(args.serving.servers)
        self.local_urls: dict[int, str] = {}  # the map's index: URL, of the servers this node started
        self.roles: dict[str, multiprocessing.Process] = {}
        self._send_server_urls: list[Connection] = []
        self.logs = os.path.join(args.output_dir, "logs")
        os.makedirs(self.logs, exist_ok=True)
        # the control token of the servers, which the trainer sends: in the environment the children inherit, not
        # in their argv (`ps` shows it to every user); one set already, for `--servers` or by node 0, is kept
        os.environ.setdefault(TOKEN_ENV, secrets.token_hex(32))

    def start_servers(self, model: str, version: int) -> None:
        """This node's servers of the map, each on its devices, listening at the node's address."""
        started = {}
        the_map = self.plan.map
        for server in the_map.servers_on(self.plan.rank):
            flags = server_flags(
                self.args,
                model,
                version,
                server.index,
                threads=nodes.server_threads(self.args, the_map),
                tensor_parallel=len(server.devices),
            )
            if self.engine.name == "vllm" and the_map.device == "cuda" and not the_map.colocated:
                flags += ["--gpu-memory-utilization", str(VLLM_OWN_GPU_MEMORY)]  # no trainer shares its GPUs
            env = {**os.environ, **nodes.device_environment(the_map, list(server.devices))}
            with open(self._server_log(server.index), "ab") as log_file:  # the child keeps its own handle
                started[server.index] = self.engine.start(server.index, flags, log_file, env, self.plan.address)
            self.servers.append(started[server.index].process)
        for index, server_process in started.items():  # they load their models side by side
            try:
                url = server_process.wait_until_serving(SERVER_START_TIMEOUT_S, self.check_others)
            except (RoleExited, rendezvous.NodeLost):
                raise
            except RuntimeError as error:
                said = last_error_line(self._server_log(index))
                raise RuntimeError(
                    f"server {index}: {error}{f' ({said})' if said else ''}; see {self._server_log(index)}"
                ) from None
            self.local_urls[index] = url
            self.engines[url] = self.engine.name
        if started:
            log.info("servers up (%s): %s", self.engine.name, " ".join(self.local_urls.values()))

    def _server_log(self, index: int) -> str:
        return os.path.join(self.logs, f"server-{index}.log")

    def gather_server_urls(self) -> None:
        """Every server's URL in the map's order: this node's, and through the rendezvous the other nodes'."""
        if self.meeting is None:
            self.server_urls += [self.local_urls[index] for index in sorted(self.local_urls)]
            return
        self.meeting.publish_servers(self.local_urls)
        every = self.meeting.server_urls(len(self.plan.map.servers), while_waiting=self.check_others)
        self.server_urls = [every[index] for index in sorted(every)]

    def start_roles(self, args: GRPOArgs, first_group: int, trainer_group: tuple[str, int]) -> None:
        """Start this node's trainer processes (`trainer` for rank 0, then `trainer-1`, ...) with `args` (the roles'
        own: `nodes.role_args`) in their group at `trainer_group` (address, port), and the actor on its node; they
        wait for `send_server_urls`."""
        context = multiprocessing.get_context("spawn")
        trainers = nodes.trainer_environments(self.plan, *trainer_group)
        roles = [("trainer" if rank == 0 else f"trainer-{rank}", env) for rank, env in trainers.items()]
        if self.plan.rank == self.plan.map.actor_node:
            roles.append(("actor", nodes.device_environment(self.plan.map, [])))
        for name, environment in roles:
            receive, send = context.Pipe(duplex=False)
            self.roles[name] = context.Process(
                target=_role, name=name, args=(name, args, receive, first_group, os.getpid(), environment)
            )
            self.roles[name].start()
            receive.close()  # the child's copy is the one that reads
            self._send_server_urls.append(send)
        if self.roles:
            log.info("started %s", ", ".join(f"{name} (pid {process.pid})" for name, process in self.roles.items()))

    def send_server_urls(self) -> None:
        for send in self._send_server_urls:
            with contextlib.suppress(BrokenPipeError):  # a role that died already: `wait` says so
                send.send(self.server_urls)
            send.close()

    def check_others(self) -> None:
        """What ends a wait for servers: a signal to stop (no step is trained before they serve: nothing to save), this
        node's trainer or actor ended, or another node failed or went away."""
        if self.stop_requested() and self.plan.rank == 0:  # node 0 says where the run stopped: `meeting.check`
            raise self.stopped()
        self.check_roles_started()
        if self.meeting is not None:
            self.meeting.check()

    def check_roles_started(self) -> None:
        """RoleExited if the trainer or the actor has ended: before the servers serve, any end is a failure."""
        for name, process in self.roles.items():
            if process.exitcode is not None:
                raise RoleExited(f"the {name} exited with status {process.exitcode} while the servers were loading")

    def wait(self) -> None:
        """Until the run is over: node 0's trainer processes are done (on node 0, the trainer's rank 0; elsewhere,
        node 0 says so). Raises if a trainer process or the actor fails, every server of this node is gone, or
        (`rendezvous.NodeLost`) another node failed or went away. A signal to stop (`stop_requested`) goes on to the
        trainer processes; once they stopped with a checkpoint, `preemption.Preempted` (beyond node 0: once node 0
        says so, with its line)."""
        forwarded = False
        while True:
            signum = self.stop_requested()
            if signum and not forwarded:
                for process in self.trainers():
                    with contextlib.suppress(ProcessLookupError):  # one that ended already: `local_failure` says why
                        os.kill(process.pid, signum)
                forwarded = True
            if self.meeting is not None:
                self.meeting.check()
            failure = self.local_failure()
            if failure is not None:
                raise self.explained(failure)
            trainers = self.trainers()
            ended = all(p.exitcode is not None for p in trainers)
            if ended and any(p.exitcode == cli.PREEMPTED for p in trainers) and self.plan.rank == 0:
                raise self.stopped()
            finished = all(process.exitcode == 0 for process in trainers)
            if finished and (self.plan.rank == 0 or self.meeting is None or self.meeting.node0_done):
                return
            time.sleep(0.2)

    def stop_requested(self) -> int:
        """The signal that asks the run to stop (0: none): this launcher's, which it passes on to the other nodes'
        (`Rendezvous.request_stop`), or one another node's launcher received: a run stops on every node at once."""
        received = self.stop_signals.received
        if self.meeting is None:
            return received
        if received:
            self.meeting.request_stop(received)
        return received or self.meeting.stop_requested

    def trainers(self) -> list[multiprocessing.Process]:
        """This node's trainer processes."""
        return [process for name, process in self.roles.items() if name != "actor"]

    def local_failure(self) -> str | None:
        """What failed on this node: a trainer process or the actor, or every server. Once a signal asked the run to
        stop, only a trainer process: a cluster signals every process of a job, and the actor and the servers end on
        it, while the trainer finishes its step."""
        stopping = bool(self.stop_requested())
        failed = {
            name: process.exitcode
            for name, process in self.roles.items()
            if process.exitcode not in (None, 0, cli.PREEMPTED) and not (stopping and name == "actor")
        }
        if failed:  # a trainer process aborts (SIGABRT) when a peer of its process group dies: the peer is the cause
            name = min(failed, key=lambda name: failed[name] == -signal.SIGABRT)
            return f"the {name} exited with status {failed[name]}"
        if self.servers and all(p.poll() is not None for p in self.servers) and not stopping:
            return f"every server{' of this node' if self.meeting else ''} has exited; see {self.logs}"
        return None

    def explained(self, failure: str) -> Exception:
        """A failure on this node, or (`NodeLost`) the other node's whose loss caused it: a trainer whose servers
        on a killed node vanish fails before that node is missed, so the rendezvous is given time to tell."""
        if self.meeting is None:
            return RuntimeError(failure)
        deadline = time.monotonic() + rendezvous.SILENCE_LIMIT_S + 2 * rendezvous.HEARTBEAT_S
        while time.monotonic() < deadline:
            try:
                self.meeting.check()
            except rendezvous.NodeLost as lost:
                return lost
            time.sleep(0.2)
        return RuntimeError(f"node {self.plan.rank}: {failure}")

    def save_server_metrics(self) -> None:
        metrics = {}
        for url in self.server_urls:
            # the trainer's last update may still be on its way in: counted once it serves (a dropped or
            # stale server never gets there: its counters as they are)
            with contextlib.suppress(ServerError):
                request_json("GET", f"{url}/health?wait_for_version={self.args.optim.steps}&timeout_s=5", timeout_s=10)
            try:
                reply = request_json("GET", f"{url}/metrics", timeout_s=5)
            except ServerError as error:
                reply = {"error": str(error)}
            # the engine of a server started here is known; one given with --servers says (a home server's says none)
            metrics[url] = {**reply, "engine": self.engines.get(url) or reply.get("engine", "home")}
        with open(os.path.join(self.args.output_dir, "servers.json"), "w") as f:
            json.dump(metrics, f, indent=2)

    def stopped(self) -> preemption.Preempted:
        """The run stopped on a signal: where its checkpoint is, what a rerun with --resume continues from (step 0
        without one: it starts over)."""
        from lm_human_preference_details import checkpoint  # torch: only once the run has stopped

        path = checkpoint.state_file(checkpoint.folder(self.args.output_dir), "state.json")
        version = checkpoint.read_json(path)["version"] if path is not None else 0
        received = self.stop_requested()
        name = signal.Signals(received).name if received else "a signal to the trainer"
        return preemption.stopped(version, self.args.optim.steps, "step", name)

    def stop(self, grace_s: float = 10.0) -> None:
        """End every process of this node: SIGTERM, SIGKILL after `grace_s`. The trainer's processes get SIGKILL at
        once: they take SIGTERM as "stop after this step" (a kill mid-save keeps the previous checkpoint)."""
        processes = [p for p in self.roles.values() if p.is_alive()]
        for name, process in self.roles.items():
            if process not in processes:
                continue
            if name == "actor":
                process.terminate()
            else:
                process.kill()
        for server in self.servers:
            if server.poll() is None:
                server.terminate()
        deadline = time.monotonic() + grace_s
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        for server in self.servers:
            try:
                server.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        self.engine.cleanup()


def launch(args: GRPOArgs) -> None:
    """Start this node's part of the run, run to the last step, stop everything (also on failure or a signal)."""
    args.check()
    args.resume = resolve_resume(args)
    plan = nodes.plan_node(args)
    nodes.check_control_token(plan)
    agent_store = nodes.forget_placement_variables()  # read: the children get their own
    # the one place the engine is chosen
    engine = None if args.serving.servers else ServerEngine(args.serving.server_engine(), args.output_dir)
    if engine is not None and engine.name == "home" and plan.map.servers and len(plan.map.servers[0].devices) > 1:
        raise cli.UserError(
            f"--server-tensor-parallel {len(plan.map.servers[0].devices)}: the home server runs on one device; "
            "use --engine vllm"
        )
    if not plan.map.colocated:
        log.info("node %d of %d (%s):\n%s", plan.rank, plan.node.nnodes, plan.node.source, plan.map.table())
    meeting = meet(args, plan, agent_store) if plan.multi_node else None
    with preemption.listening() as stop:
        run_node(args, plan, engine, meeting, stop)


def run_node(args: GRPOArgs, plan: nodes.NodePlan, engine, meeting, stop: preemption.StopSignals) -> None:
    """`launch` once the node knows its plan: start, wait for the end or a signal (`stop`), stop everything."""
    run = None
    # Ctrl-C, even when started in the background by a shell, which leaves SIGINT ignored: `finally` stops the children
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    ok = False
    try:
        os.makedirs(args.output_dir, exist_ok=True)
        start = start_of_run(args, plan, engine, meeting)
        os.environ[TOKEN_ENV] = start_token(plan, start)
        run = Run(args, plan, engine, meeting, stop)
        if meeting is not None:
            meeting.watch()
        # the address every node reached node 0 at: its servers join the trainer's weight groups there
        trainer_host = plan.node.master_addr if meeting is not None else plan.address
        run.start_roles(
            nodes.role_args(args, plan, trainer_host),
            first_group=start.version * args.groups_per_step(),  # they load while the servers do
            trainer_group=(trainer_host, start.trainer_port),
        )
        if not args.serving.servers:
            run.start_servers(engine.model_for_servers(start.model), start.version)  # as this node resolves it
        run.gather_server_urls()
        if plan.rank == 0:
            world_file(args, plan, start, run.server_urls)
        run.send_server_urls()
        run.wait()
        if plan.rank == 0:
            run.save_server_metrics()
            print(run_summary(args.output_dir, plan, servers=len(run.server_urls)), flush=True)
        ok = True
    except BaseException as error:
        if meeting is not None and isinstance(error, preemption.Preempted):
            if plan.rank == 0:  # the others end with its line (beyond node 0 it came from there)
                meeting.stopped(str(error))
        elif meeting is not None and not isinstance(error, rendezvous.NodeLost):
            why = "stopped by a signal" if isinstance(error, (SystemExit, KeyboardInterrupt)) else str(error)
            meeting.fail(f"node {plan.rank} ({meeting.roles[plan.rank]}): {why}")
        raise
    finally:
        if run is not None:
            run.stop()
        if meeting is not None:
            meeting.part(ok)
        signal.signal(signal.SIGINT, previous_int)


def resolve_resume(args: GRPOArgs) -> bool:
    """`--resume` as yes or no (`--resume auto`: `checkpoint.resolve_resume`), before anything starts."""
    if args.resume != "auto":
        return args.resume
    from lm_human_preference_details import checkpoint  # torch: only for `auto`

    found = checkpoint.state_file(checkpoint.folder(args.output_dir), "state.json") is not None
    return checkpoint.resolve_resume(args.resume, found, args.output_dir)


def meet(args: GRPOArgs, plan: nodes.NodePlan, agent_store: str | None) -> rendezvous.Rendezvous:
    """Meet the other nodes' launchers at node 0's store (or torchrun's: `agent_store`, its restart count); they
    must have built the same map."""
    the_map = plan.map
    roles = {node: the_map.roles_of(node) for node in range(plan.node.nnodes)}
    meeting = rendezvous.Rendezvous(
        plan.rank,
        plan.node.nnodes,
        plan.node.master_addr,
        plan.node.master_port,
        roles,
        args.placement.join_timeout_s,
        agent_store,
    )
    try:
        meeting.meet(rendezvous.NodeHello(plan.rank, the_map.digest(), plan.address))
    except (rendezvous.RendezvousError, rendezvous.NodeLost) as error:  # refused here, or by another node
        raise cli.UserError(str(error)) from None
    return meeting


def start_of_run(args: GRPOArgs, plan: nodes.NodePlan, engine, meeting) -> rendezvous.RunStart:
    """Node 0 decides (resumed or new, the weights version, the servers' model) and empties or truncates the stream
    before any other node starts anything; the others wait for its word, and check that they see its folder."""
    if plan.rank != 0:
        start = meeting.run_start()
        nodes.check_shared_folder(args, plan, start.run_id)
        return start
    where = streams.parse_stream_url(args.stream_url())
    if args.resume and isinstance(where, streams.RedisStreamUrl) and where.maxlen is not None:
        # a checkpoint's stream position counts records from the stream's first; trimming shifts that count
        raise cli.UserError(
            f"--stream {args.stream}: --resume finds the checkpoint's place in the stream by counting records "
            "from its first, which maxlen trims away; run without maxlen to be able to resume"
        )
    if args.resume:
        from lm_human_preference_details.grpo import checkpoints  # torch: only to resume

        # the checkpoint holds the settings its trainer ran with: the map's counts of its processes
        state = checkpoints.checkpoint_state(nodes.role_args(args, plan, plan.address))
        model = checkpoints.checkpoint_model(args.output_dir)
        evaluations = checkpoints.evaluations_kept(args, state["version"])
    else:
        tracking.refuse_to_overwrite(args.output_dir, resumable=True)  # before the stream is emptied or anything starts
        state, model, evaluations = {"version": 0, "stream_position": 0}, args.task.model, 0
    version = state["version"]
    if engine is not None:
        engine.model_for_servers(model)  # before anything starts: a model the engine cannot serve is refused
    # servers started elsewhere
    check_serving(args.serving.servers, version, model, "resumes" if args.resume else "starts")
    token = nodes.node0_control_token()
    os.environ[TOKEN_ENV] = token  # the servers and the trainer this node starts inherit it
    # a new run starts from an empty stream (an earlier run's samples are not ours); a resumed run
    # drops what the crashed run generated after its checkpoint, from weights that are gone
    dropped = streams.truncate(args.stream_url(), state["stream_position"])
    if dropped:
        log.info("starting at step %d: %d groups of the stream dropped", version, dropped)
    streams.truncate(args.eval_stream_url(), evaluations)  # a new run's: none; a resumed run's: of earlier weights
    start = rendezvous.RunStart(
        version=version,
        model=model,  # each node resolves it for its engine (a preset's folder is in that node's cache)
        control_token=nodes.shared_control_token(token, plan.node.master_addr),
        control_token_sha256=nodes.token_sha256(token),
        trainer_port=free_port(),
        run_id=secrets.token_hex(8),
    )
    world_file(args, plan, start, [])
    if meeting is not None:
        meeting.announce(start)
    return start


def run_summary(output_dir: str, plan: nodes.NodePlan, servers: int) -> str:
    """The run in one line, the launcher's last: how the mean reward moved (the first fifth of the steps against the
    last), the mean lag, and where the run ran."""
    rows = [row for row in tracking.read_metrics(os.path.join(output_dir, "metrics.jsonl")) if "reward/mean" in row]
    fifth = max(1, len(rows) // 5)

    def mean(key: str, part: list[dict]) -> float:
        return sum(row[key] for row in part) / len(part)

    return (
        f"reward/mean {mean('reward/mean', rows[:fifth]):.3f} -> {mean('reward/mean', rows[-fifth:]):.3f} "
        f"(first fifth -> last fifth), lag {mean('lag/mean', rows):.2f}, nodes {plan.node.nnodes}, "
        f"servers {servers}, trainer processes {len(plan.map.trainers)}"
    )


def start_token(plan: nodes.NodePlan, start: rendezvous.RunStart) -> str:
    """This node's control token for the servers: node 0's (announced on this machine's loopback, else each node's
    own $GRPO_SERVER_TOKEN, checked against node 0's)."""
    if plan.rank == 0:
        return os.environ[TOKEN_ENV]  # set by start_of_run
    return nodes.control_token_of(start.control_token, start.control_token_sha256)


def world_file(args: GRPOArgs, plan: nodes.NodePlan, start: rendezvous.RunStart, server_urls: list[str]) -> None:
    """`world.json` in the run folder: the map, the nodes, the servers' URLs once known, and the run's id (a node
    beyond 0 that reads it sees node 0's folder)."""
    record = {
        "run_id": start.run_id,
        "map": plan.map.to_json(),
        "servers": server_urls,
        "nodes": plan.node.nnodes,
        "master": f"{plan.node.master_addr}:{plan.node.master_port}",
    }
    with open(os.path.join(args.output_dir, "world.json"), "w") as f:
        json.dump(record, f, indent=2)
    if server_urls and not plan.map.colocated:
        log.info("the run's processes:\n%s", plan.map.table(dict(enumerate(server_urls))))


@cli.main_with_user_errors
def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s launch %(message)s")
    args = cli.parse(GRPOArgs, get_preset, "tiny", presets=PRESETS)
    try:
        launch(args)
    except streams.StreamConnectionError as error:  # the stream's server is not there: the user starts it
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
