"""The trainer (`grpo/trainer.py`) in process: its view of the engine's tokens (packed forward, logprobs,
gradients), the stream read a step at a time, the push schedule, the metrics of a step, and its checkpoint."""

import copy
import dataclasses
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from lm_human_preference_details import preemption
from lm_human_preference_details.cli import UserError
from lm_human_preference_details.grpo import trainer
from lm_human_preference_details.grpo.checkpoints import checkpoint_model, save_checkpoint
from lm_human_preference_details.grpo.config import get_preset
from lm_human_preference_details.grpo.records import Attempt, Group
from lm_human_preference_details.grpo.serving.engine import Engine, GenerationRequest
from lm_human_preference_details.grpo.serving.server import load_for_inference
from lm_human_preference_details.grpo.streams import open_writer
from lm_human_preference_details.grpo.trainer import (
    GroupReader,
    ServerUpdates,
    StepTimer,
    accumulate_gradients,
    batch_tensors,
    check_group,
    flatten_groups,
    load_learner,
    log_step,
    pack,
    step_metrics,
    token_logprobs,
)
from tests.grpo.args import grpo_args


@pytest.fixture(scope="module")
def tiny_math():
    return load_for_inference("tiny-math", "cpu")


def sampled_groups(tiny_math, prompts: list[str], max_tokens: list[int], attempts: int) -> list[Group]:
    """Stream records of `attempts` engine samples of each prompt (temperature 0.8, stopping at EOS)."""
    model, tokenizer = tiny_math
    with Engine(model, max_batch_size=8, seed=3, vocab_size=len(tokenizer)) as engine:
        prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
        requests = [
            GenerationRequest(p, max_new_tokens=n, temperature=0.8, stop_token_ids=frozenset([tokenizer.eos_token_id]))
            for p, n in zip(prompt_ids, max_tokens)
        ]
        futures = engine.submit_many([r for r in requests for _ in range(attempts)])
        generations = [f.result(timeout=60) for f in futures]
    return [
        Group(
            prompt_ids=p,
            problem_id=str(i),
            attempts=[
                Attempt(completion_ids=g.token_ids, logprobs=g.logprobs, versions=g.versions, reward=0.0)
                for g in generations[i * attempts : (i + 1) * attempts]
            ],
        )
        for i, p in enumerate(prompt_ids)
    ]


def test_trainer_logprobs_match_the_engine_on_policy(tiny_math):
    """The trainer's packed forward (each prompt once, its attempts right-padded after it) reproduces
    the server's sampling logprobs, so the importance ratio of on-policy tokens is 1."""
    model, tokenizer = tiny_math
    groups = sampled_groups(
        tiny_math, ["1+2=\\boxed{", "33+4=\\boxed{", "0+0=\\boxed{", "9*9=\\boxed{"], [5, 11, 3, 8], attempts=3
    )
    samples = flatten_groups(groups)
    micro_batches = pack(groups, token_budget=40)  # 4 prompts of 11-12 tokens + 12 completions do not fit
    attempts = sorted((i, j) for mb in micro_batches for i, first, end in mb for j in range(first, end))
    assert attempts == [(i, j) for i in range(4) for j in range(3)] and len(micro_batches) > 1
    for indices in micro_batches:
        batch = batch_tensors(groups, indices, "cpu")
        with torch.no_grad():
            new, _ = token_logprobs(model, batch, 0.8, len(tokenizer))
        mask = batch["mask"].bool()
        rows = batch["rows"].tolist()
        assert [samples[r].completion_ids for r in rows] == [
            row[m].tolist() for row, m in zip(batch["completion_ids"], mask)
        ]
        torch.testing.assert_close(new[mask], batch["behaviour"][mask], atol=2e-5, rtol=0)


def test_a_prompt_alone_gets_the_engines_first_logprob_exactly_so_its_first_ratio_is_one(tiny_math):
    """A prompt sampled alone by the engine and recomputed alone by the trainer, in float32: the first token's
    logits come from the same forward of the same prompt in both, and both read `models.temperature_log_softmax`,
    so its logprob is bitwise the engine's and pi/mu is exactly 1. (Later tokens: the engine decodes one at a
    time, the trainer all at once, which round differently: within the tolerance of the test above.)"""
    model, tokenizer = tiny_math
    for prompt in ["1+2=\\boxed{", "33+4=\\boxed{", "9*9=\\boxed{"]:
        groups = sampled_groups(tiny_math, [prompt], [4], attempts=1)
        batch = batch_tensors(groups, [(0, 0, 1)], "cpu")
        with torch.no_grad():
            new, _ = token_logprobs(model, batch, 0.8, len(tokenizer))
        first, behaviour = new[:, 0], batch["behaviour"][:, 0]
        assert first.dtype == torch.float32 and torch.equal(first, behaviour), (first, behaviour)
        assert torch.equal(torch.exp(first - behaviour), torch.ones_like(first))


def test_shared_prompt_forward_has_the_gradient_of_one_forward_per_sample(tiny_math):
    """The loss's gradient through `token_logprobs` (each prompt once, prompts of different lengths)
    equals the gradient through a plain forward of every prompt + completion. In float64: in float32 the
    two summation orders differ by up to ~5e-4 relative on some weights."""
    groups = sampled_groups(tiny_math, ["1+2=\\boxed{", "33+44=\\boxed{"], [6, 9], attempts=4)
    model, tokenizer = copy.deepcopy(tiny_math[0]).double(), tiny_math[1]
    samples = flatten_groups(groups)
    weights = torch.randn(
        len(samples), generator=torch.Generator().manual_seed(0), dtype=torch.float64
    )  # each sample weighs differently

    def gradients(loss):
        model.zero_grad()
        loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    batch = batch_tensors(groups, [(1, 0, 3), (0, 0, 4), (1, 3, 4)], "cpu")  # rows in another order than the samples'
    new, _ = token_logprobs(model, batch, 0.8, len(tokenizer))
    shared = gradients((new * batch["mask"] * weights[batch["rows"], None]).sum())
    plain_loss = 0.0
    prompts = [g.prompt_ids for g in groups for _ in g.attempts]
    for p, sample, weight in zip(prompts, samples, weights):
        c = sample.completion_ids
        logits = model(torch.tensor([p + c])).logits[0, len(p) - 1 : -1, : len(tokenizer)]
        plain_loss = plain_loss + weight * torch.log_softmax(logits / 0.8, -1).gather(1, torch.tensor(c)[:, None]).sum()
    plain = gradients(plain_loss)
    for name in plain:
        torch.testing.assert_close(shared[name], plain[name], atol=1e-10, rtol=1e-8)


def test_a_steps_gradient_and_stats_do_not_depend_on_how_its_groups_are_packed(tiny_math):
    """The loss is summed over the step's tokens and divided by the step's number of sequences in every
    micro-batch, so one micro-batch or one per attempt gives the same gradient (float64), and the same stats."""
    groups = sampled_groups(tiny_math, ["1+2=\\boxed{", "33+44=\\boxed{", "2+2=\\boxed{"], [6, 9, 4], attempts=4)
    for i, group in enumerate(groups):  # rewards that differ within each group: advantages that are not 0
        for j, attempt in enumerate(group.attempts):
            attempt.reward = float((i + j) % 2)
    rewards = torch.tensor([s.reward for s in flatten_groups(groups)])
    model, tokenizer = copy.deepcopy(tiny_math[0]).double(), tiny_math[1]
    runs = []
    for budget in (10**6, 8):  # everything at once; one attempt per micro-batch
        args = grpo_args(get_preset("tiny"), group_size=4, token_budget=budget, temperature=0.8, kl_coef=0.0)
        model.zero_grad()
        stats = accumulate_gradients(model, None, groups, rewards.double(), args, len(tokenizer))
        runs.append(({name: p.grad.clone() for name, p in model.named_parameters()}, stats))
    assert len(pack(groups, 8)) == 12 and len(pack(groups, 10**6)) == 1
    (whole_grads, whole_stats), (split_grads, split_stats) = runs
    for name, grad in whole_grads.items():
        torch.testing.assert_close(split_grads[name], grad, atol=1e-12, rtol=1e-9)
    assert any(grad.abs().max() > 0 for grad in whole_grads.values())
    assert split_stats.keys() == whole_stats.keys() >= {"entropy", "ratio/max", "ess"}
    for key, value in whole_stats.items():
        assert split_stats[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_pack_fills_the_token_budget_and_splits_only_groups_over_it():
    def group(prompt: int, completions: list[int]) -> Group:
        return Group(problem_id="p", prompt_ids=[1] * prompt, attempts=[one_attempt([2] * c) for c in completions])

    def tokens(batch) -> int:  # prompts once each + every completion, each padded to the micro-batch's longest
        prompt = max(len(groups[i].prompt_ids) for i, _, _ in batch)
        completion = max(len(a.completion_ids) for i, first, end in batch for a in groups[i].attempts[first:end])
        return len(batch) * prompt + sum(end - first for _, first, end in batch) * completion

    groups = [group(5, [3, 1]), group(4, [6, 2]), group(5, [1, 1]), group(3, [4, 4]), group(6, [2, 2])]
    batches = pack(groups, token_budget=30)
    assert sorted(part for b in batches for part in b) == [(i, 0, 2) for i in range(5)]  # no group split
    assert all(tokens(b) <= 30 for b in batches) and len(batches) == 3
    groups = [group(10, [8, 8, 8, 8, 8]), group(2, [2])]
    assert pack(groups, token_budget=30) == [
        [(0, 0, 2)],
        [(0, 2, 4)],
        [(0, 4, 5)],
        [(1, 0, 1)],
    ]  # 2 x (10 + 8 x 2) > 30
    assert pack(groups, token_budget=12) == [[(0, i, i + 1)] for i in range(5)] + [
        [(1, 0, 1)]
    ]  # over it alone: one attempt


def test_shared_prompt_forward_refuses_sliding_window_layers():
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=16,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        sliding_window=4,
    )
    group = Group(problem_id="p", prompt_ids=[1, 2, 3, 4, 5, 6], attempts=[one_attempt([7, 8])] * 2)
    batch = batch_tensors([group], [(0, 0, 2)], "cpu")
    with pytest.raises(NotImplementedError, match="sliding-window"):
        token_logprobs(MistralForCausalLM(config).eval(), batch, 1.0, 16)


def test_the_trainer_refuses_groups_sampled_with_other_settings_than_its_own():
    """A trainer and an actor started apart with different flags: a group of another size would be merged with
    or split from its neighbours by the baseline, logprobs at another temperature make every ratio pi/mu wrong."""
    args = get_preset("tiny")  # groups of 8, temperature 1
    group = stream_group(0, problem_id="sum-1-2")
    check_group(group, args)
    check_group(dataclasses.replace(group, temperature=None), args)  # a stream from before it was recorded
    with pytest.raises(UserError, match="group for problem 'sum-1-2' has 4 attempts, this trainer's --group-size is 8"):
        check_group(dataclasses.replace(group, attempts=group.attempts[:4]), args)
    with pytest.raises(UserError, match="sampled at temperature 0.7, this trainer's --temperature is 1.0"):
        check_group(dataclasses.replace(group, temperature=0.7), args)


def one_attempt(completion_ids: tuple[int, ...] = (1,)) -> Attempt:
    """An attempt with reward 1, sampled at weights 0, each token at probability 1."""
    n = len(completion_ids)
    return Attempt(completion_ids=list(completion_ids), logprobs=[0.0] * n, versions=[0] * n, reward=1.0)


def stream_group(problem: int, attempts: int = 8, **fields) -> Group:
    """A stream record of `attempts` one-token attempts at problem `problem`."""
    return dataclasses.replace(
        Group(problem_id=f"p{problem}", prompt_ids=[1, 2], temperature=1.0, attempts=[one_attempt()] * attempts),
        **fields,
    )


def test_the_trainer_reads_a_step_of_groups_at_a_time_and_in_sync_mode_the_whole_round_first(tmp_path):
    """Two groups a step. `sync` with rounds of 3 steps, run for 4: before step 1 the trainer waits for the whole
    round (6 groups), steps 2 and 3 take theirs from what it read (asking once whether every process has its
    groups), step 4 (the last round, cut short) reads its own; the position (what a checkpoint records) counts only
    the groups trained on."""
    args = grpo_args(get_preset("tiny"), mode="sync", sync_steps=3, steps=4, batch_size=16, output_dir=str(tmp_path))
    writer = open_writer(args.stream_url())
    for problem in range(5):
        writer.write(stream_group(problem))
    asked = []

    def everyone_has(ready: bool) -> bool:  # the round's last group comes while the trainer waits
        asked.append(ready)
        if asked == [False, False]:
            writer.write(stream_group(5))
        return ready

    stream = GroupReader(args, start=0, everyone_has=everyone_has)
    assert [g.problem_id for g in stream.read_step(0)] == ["p0", "p1"] and asked[:2] == [False, False]
    assert asked[-1] and stream.position == 2
    assert [g.problem_id for g in stream.read_step(1)] == ["p2", "p3"] and stream.position == 4
    waited = len(asked)
    assert [g.problem_id for g in stream.read_step(2)] == ["p4", "p5"] and asked[waited:] == [True]
    writer.write(stream_group(6, attempts=4))  # another group size than the trainer's: refused
    writer.write(stream_group(7))
    with pytest.raises(UserError, match="group for problem 'p6' has 4 attempts"):
        stream.read_step(3)
    stream.close()
    writer.close()

    others = iter([False, False])  # another trainer process waits for its groups: this one reads past no round
    stream = GroupReader(args, start=2, everyone_has=lambda ready: ready and next(others, True))
    assert [g.problem_id for g in stream.read_step(1)] == ["p2", "p3"]  # a resumed run, mid-round
    assert stream.reader.position == 6 and next(others, None) is None  # the round's p2-p5, not p6 and p7
    stream.close()


def test_the_weights_go_to_the_servers_after_every_step_or_every_round_and_after_the_last(monkeypatch):
    pushed = []

    class Sender:
        def __init__(self, urls, backend, host):
            self.urls = urls

        def push_tensors(self, parameters, version, dtype, bucket_bytes):
            pushed.append((version, dtype, bucket_bytes))
            return []

    monkeypatch.setattr(trainer, "WeightSender", Sender)
    monkeypatch.setattr(trainer, "served_dtype", lambda url: torch.bfloat16)
    for mode, expected in (("pipeline", [1, 2, 3, 4, 5, 6]), ("sync", [4, 6])):
        args = grpo_args(get_preset("tiny"), mode=mode, sync_steps=4, steps=6, update_bucket_mb=0.5)
        servers = ServerUpdates(args, ["http://127.0.0.1:1"])
        pushed.clear()
        times = [servers.push_if_due(torch.nn.Linear(1, 1), version) for version in range(1, 7)]
        assert [v for v, _, _ in pushed] == expected
        assert {(dtype, bucket_bytes) for _, dtype, bucket_bytes in pushed} == {(torch.bfloat16, 2**19)}
        assert all((t > 0) == (v in expected) for v, t in zip(range(1, 7), times))


def test_a_push_that_fails_once_the_trainer_received_a_signal_to_stop_is_no_failure(monkeypatch, caplog):
    """A job's servers end on the signal that stops the trainer: its checkpoint holds the weights that reached none."""

    class Sender:
        def __init__(self, urls, backend, host):
            pass

        def push_tensors(self, parameters, version, dtype, bucket_bytes):
            raise RuntimeError("every server was dropped from weight updates")

    monkeypatch.setattr(trainer, "WeightSender", Sender)
    monkeypatch.setattr(trainer, "served_dtype", lambda url: torch.float32)
    servers = ServerUpdates(grpo_args(get_preset("tiny"), mode="pipeline"), ["http://127.0.0.1:1"])
    stop = preemption.StopSignals()
    with pytest.raises(RuntimeError, match="every server was dropped"):
        servers.push_if_due(torch.nn.Linear(1, 1), 1, stop=stop)
    stop.received = signal.SIGTERM
    servers.push_if_due(torch.nn.Linear(1, 1), 2, stop=stop)
    assert "weights 2 reached no server (every server was dropped" in caplog.text


def test_a_steps_metrics_say_its_lag_throughput_and_where_its_time_went(monkeypatch):
    clock = iter([10.0, 12.0, 15.0, 16.0, 16.0, 20.0])
    monkeypatch.setattr(trainer.time, "perf_counter", lambda: next(clock))
    timer = StepTimer()
    timer.waiting_for_data()
    timer.training()
    first = timer.step_done(push_s=1.0)
    assert first == {"interval": 5.0, "wait_data_s": 2.0, "train_s": 2.0, "push_s": 1.0, "elapsed_s": 5.0}
    timer.waiting_for_data()
    timer.training()
    assert timer.step_done(push_s=0.0) == {
        "interval": 5.0,  # from the previous step's end (15), not from its wait (16)
        "wait_data_s": 0.0,
        "train_s": 4.0,
        "push_s": 0.0,
        "elapsed_s": 10.0,
    }

    samples = [
        Attempt(completion_ids=[7, 8], logprobs=[0.0] * 2, versions=[4, 4], reward=1.0),
        Attempt(completion_ids=[7, 8, 9, 2], logprobs=[0.0] * 4, versions=[2, 2, 3, 3], reward=1.0),
    ]
    metrics = step_metrics(samples, torch.tensor([1.0, 0.0]), 5, 0.25, first, broadcast_s=0.5)
    assert list(metrics) == [
        "reward/mean",
        "success/rate",
        "lag/min",
        "lag/mean",
        "lag/max",
        "samples_per_s",
        "tokens_per_s",
        "grad_norm",
        "completion/length",
        "time/wait_data_s",
        "time/train_s",
        "time/push_s",
        "time/broadcast_s",
        "time/elapsed_s",
        "samples",
    ]  # metrics.jsonl's columns, in this order
    # step 5's gradient was taken at weights 4: lags 0, 0, 2, 2, 1, 1
    assert (metrics["lag/min"], metrics["lag/mean"], metrics["lag/max"]) == (0, 1.0, 2)
    assert metrics["reward/mean"] == metrics["success/rate"] == 0.5 and metrics["completion/length"] == 3.0
    assert (metrics["samples_per_s"], metrics["tokens_per_s"], metrics["samples"]) == (0.4, 1.2, 10)
    assert (metrics["grad_norm"], metrics["time/broadcast_s"], metrics["time/train_s"]) == (0.25, 0.5, 2.0)

    class Tracker:
        def __init__(self):
            self.logged, self.tables = [], []

        def log(self, step, metrics):
            self.logged.append(step)

        def log_samples(self, step, rows):
            self.tables.append((step, rows))

    tracker = Tracker()
    args = grpo_args(get_preset("tiny"), steps=5, sample_interval=2, group_size=1)
    for version in range(1, 6):
        log_step(tracker, args, version, [Group(problem_id="p", prompt_ids=[1], attempts=samples[:1])], metrics)
    assert tracker.logged == [1, 2, 3, 4, 5]
    assert [step for step, _ in tracker.tables] == [2, 4, 5]  # every 2nd step, and the last
    assert tracker.tables[0][1] == [{"problem_id": "p", "reward": 1.0, "completion": ""}]  # the first group's


FLAT_SETTINGS = """
output_dir mode sync_steps steps_ahead model problems arith_digits arith_template num_problems answer_prefix
chat chat_example integer_answers group_size max_tokens temperature ignore_eos steps batch_size lr optimizer
adam_eps grad_clip recipe loss_type ratio_cap importance_sampling clip_eps clip_eps_high baseline divide_by_std
std_over use_advantages relu_policy_weights loss_normalizer overlong_filtering kl_coef kl_coef_final kl_clamp
entropy_coef entropy_coef_final token_budget sample_interval save_interval resume num_servers trainer_processes
servers engine server_batch_size max_in_flight problems_per_request update_bucket_mb server_dtype weight_backend
stream trainer_host threads request_timeout_s
"""
"""the names a checkpoint's settings had when GRPOArgs was one flat class"""


def test_a_checkpoint_resumes_the_weights_the_optimizer_and_the_stream_position_under_the_same_settings(tmp_path):
    args = grpo_args(get_preset("tiny"), output_dir=str(tmp_path), wandb_mode="disabled")
    with pytest.raises(UserError, match=r"--resume: no checkpoint in .* \(none saved yet\? see --save-interval\)"):
        load_learner(grpo_args(args, resume=True))
    learner = load_learner(args)
    assert (learner.version, learner.stream_position, learner.reference) == (0, 0, None)
    model, optimizer = learner.model, learner.optimizer
    model(torch.tensor([[1, 2, 3]])).logits.square().mean().backward()
    optimizer.step()
    save_checkpoint(args, model, learner.tokenizer, optimizer, version=3, stream_position=24)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint"]  # nothing left beside it
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["model", "optimizer.pt", "state.json"]
    assert checkpoint_model(str(tmp_path)) == str(tmp_path / "checkpoint" / "model")  # what the servers load
    with open(tmp_path / "checkpoint" / "state.json") as f:
        settings = json.load(f)["settings"]
    assert settings["lr"] == args.optim.lr
    assert set(FLAT_SETTINGS.split()) <= set(settings)  # as before the sub-configs: their checkpoints resume, checked

    os.rename(tmp_path / "checkpoint", tmp_path / "checkpoint.old")  # a save killed between its two renames
    resumed = load_learner(grpo_args(args, resume=True, steps=args.optim.steps + 10))  # steps may change
    assert (resumed.version, resumed.stream_position) == (3, 24)
    for (name, saved), resumed_parameter in zip(model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(saved, resumed_parameter), name
    saved_state, resumed_state = optimizer.state_dict(), resumed.optimizer.state_dict()
    assert saved_state["param_groups"] == resumed_state["param_groups"]
    for key, state in saved_state["state"].items():
        for name, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(resumed_state["state"][key][name])), name
    with pytest.raises(UserError, match=r"was saved with other settings \(lr: 0.0005 then, 0.001 now\)"):
        load_learner(grpo_args(args, resume=True, lr=1e-3))


def test_the_launcher_reads_a_checkpoint_without_importing_the_trainer():
    code = (
        "import sys; from lm_human_preference_details.grpo import checkpoints, launch; "
        "assert 'lm_human_preference_details.grpo.trainer' not in sys.modules"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_an_evaluations_line_averages_each_problems_pass_at_k_over_its_own_samples():
    """pass@1 and pass@k per problem from its own samples (more than asked, below), then averaged: the
    direct counts here are 1/2 and 1 for the first problem, 0 and 0 for the second."""
    from lm_human_preference_details.grpo.records import EvaluatedProblem, Evaluation

    def problem(rewards: list[float]) -> EvaluatedProblem:
        n = len(rewards)
        return EvaluatedProblem(
            problem_id="p", prompt="q", answer="1", completions=["a"] * n, rewards=rewards, tokens=[3] * n
        )

    evaluation = Evaluation(
        step=20,
        version_min=20,
        version_max=21,
        samples=2,
        seconds=0.5,
        problems=[problem([1.0, 0.0]), problem([0.0, 0.0])],
    )
    line = trainer.evaluation_metrics(evaluation)
    assert line["eval/pass@1"] == (0.5 + 0.0) / 2 and line["eval/pass@k"] == (1.0 + 0.0) / 2
    assert (line["eval/step"], line["eval/mean_tokens"], line["eval/version_max"]) == (20, 3.0, 21)
    evaluation.problems[1] = problem([0.0, 0.0, 1.0])  # three samples of one: pass@2 counts 2 of its 3 pairs
    assert trainer.evaluation_metrics(evaluation)["eval/pass@k"] == pytest.approx((1.0 + 2 / 3) / 2)
