"""The launchers' rendezvous over a real TCPStore, node 0 in this process and node 1 in another (each of those
tests pays for a process that imports torch: slow)."""

import multiprocessing
import os
import signal
import time

import pytest

from lm_human_preference_details.grpo import rendezvous
from lm_human_preference_details.grpo.launch import free_port
from lm_human_preference_details.grpo.rendezvous import NodeHello, NodeLost, Rendezvous, RendezvousError, RunStart
from lm_human_preference_details.preemption import Preempted

ROLES = {0: "trainer ranks 0-1, actor, rendezvous", 1: "servers 0-1"}
START = RunStart(
    version=3, model="tiny-math", control_token="t" * 64, control_token_sha256="s", trainer_port=12345, run_id="r"
)


def node(rank: int, port: int, digest: str = "map", timeout_s: float = 30) -> Rendezvous:
    meeting = Rendezvous(rank, 2, "127.0.0.1", port, ROLES, timeout_s)
    meeting.meet(NodeHello(rank, digest, "127.0.0.1"))
    return meeting


def node_1(port: int, digest: str, said: multiprocessing.Queue, then: str) -> None:
    """Node 1's launcher, reduced to its rendezvous: what it heard goes to `said`."""
    try:
        meeting = node(1, port, digest)
        said.put(meeting.run_start())
        meeting.publish_servers({0: "http://127.0.0.1:1", 1: "http://127.0.0.1:2"})
        meeting.watch()
        if then == "hang":
            time.sleep(600)
        if then == "stop":  # its launcher received SIGTERM
            meeting.request_stop(signal.SIGTERM)
        try:
            while not meeting.node0_done:
                meeting.check()
                time.sleep(0.1)
            said.put("done")
        except Preempted as stopped:  # node 0 said where the run stopped
            said.put(str(stopped))
        meeting.part(ok=True)
    except (RendezvousError, NodeLost) as error:
        said.put(str(error))


def start_node_1(port: int, digest: str = "map", then: str = "finish"):
    context = multiprocessing.get_context("spawn")
    said = context.Queue()
    process = context.Process(target=node_1, args=(port, digest, said, then), daemon=True)
    process.start()
    return process, said


@pytest.mark.slow
@pytest.mark.parametrize("then", ["finish", "stop"])
def test_nodes_meet_share_the_start_and_the_servers_then_part_or_stop_on_node_1s_signal(then):
    """At the end node 0 says the run is done; or node 1 asks every node to stop (its launcher received SIGTERM):
    node 0 hears it within a heartbeat or two, and once it says where the run stopped, node 1 ends with that line."""
    port = free_port()
    process, said = start_node_1(port, then=then)
    meeting = node(0, port)
    meeting.announce(START)
    meeting.watch()
    assert said.get(timeout=30) == START
    assert meeting.server_urls(2, while_waiting=lambda: None) == {0: "http://127.0.0.1:1", 1: "http://127.0.0.1:2"}
    if then == "stop":
        deadline = time.monotonic() + 3 * rendezvous.HEARTBEAT_S
        while meeting.stop_requested != signal.SIGTERM:
            assert time.monotonic() < deadline, "node 1's request to stop was not heard"
            time.sleep(0.05)
        meeting.check()  # a stop is no failure
        meeting.stopped("stopped at step 7 of 9 on SIGTERM: rerun with --resume")
    meeting.part(ok=then == "finish")
    expected = "done" if then == "finish" else "stopped at step 7 of 9 on SIGTERM: rerun with --resume"
    assert said.get(timeout=30) == expected
    process.join(30)
    assert process.exitcode == 0


@pytest.mark.slow
def test_a_node_with_another_map_is_refused_on_both_sides():
    port = free_port()
    process, said = start_node_1(port, digest="other")
    with pytest.raises((RendezvousError, NodeLost), match="node 1's world map differs from node 0's"):
        node(0, port)  # found here, or told by node 1, whichever comes first
    assert "node 1's world map differs from node 0's" in said.get(timeout=30)
    process.join(30)


def test_a_node_that_never_joins_is_named():
    with pytest.raises(RendezvousError, match=r"node 1 did not join within 1 s \(servers 0-1\)"):
        node(0, free_port(), timeout_s=1)


def test_node_1_without_node_0_says_where_it_looked():
    port = free_port()
    with pytest.raises(RendezvousError, match=f"node 0's rendezvous at 127.0.0.1:{port} did not answer"):
        Rendezvous(1, 2, "127.0.0.1", port, ROLES, timeout_s=1)


@pytest.mark.slow
def test_a_killed_node_is_named_by_node_0_and_its_end_reaches_the_others(monkeypatch):
    monkeypatch.setattr(rendezvous, "SILENCE_LIMIT_S", 2.0)
    port = free_port()
    process, said = start_node_1(port, then="hang")
    meeting = node(0, port)
    meeting.announce(START)
    meeting.watch()
    said.get(timeout=30)
    meeting.server_urls(2, while_waiting=lambda: None)
    time.sleep(2 * rendezvous.HEARTBEAT_S)  # node 1 has been heard
    os.kill(process.pid, signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(NodeLost, match=r"node 1 \(servers 0-1\) fell silent"):
        while True:
            meeting.check()
            time.sleep(0.1)
    assert time.monotonic() - killed < 2.0 + 3 * rendezvous.HEARTBEAT_S


@pytest.mark.slow
def test_node_0_gone_ends_node_1_with_a_line_naming_it():
    port = free_port()
    context = multiprocessing.get_context("spawn")
    node_0 = context.Process(target=hold_then_vanish, args=(port,), daemon=True)
    node_0.start()
    meeting = node(1, port)
    meeting.run_start()
    meeting.watch()
    node_0.join(30)
    with pytest.raises(NodeLost, match=r"node 0 \(trainer ranks 0-1, actor, rendezvous\) is gone"):
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            meeting.check()
            time.sleep(0.1)


def hold_then_vanish(port: int) -> None:
    """Node 0 that starts the run and then dies without a word."""
    meeting = node(0, port)
    meeting.announce(START)
    time.sleep(1)
    os._exit(1)
