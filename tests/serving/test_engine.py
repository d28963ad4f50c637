"""The engine (in process): logprobs, continuous batching, weights swapped between two decode steps while
sequences carry on with their KV cache; and the settings' checks and the actor's schedule (the trainer's side
of the same tokens: tests/grpo/test_trainer.py)."""

import threading
import time

import pytest
import torch

from lm_human_preference_details.assets import tiny_math_prompt
from lm_human_preference_details.grpo.config import ProcessArgs, get_preset
from lm_human_preference_details.grpo.serving.engine import Engine, GenerationRequest, sample_tokens
from lm_human_preference_details.grpo.serving.server import load_for_inference
from tests.grpo.args import grpo_args


@pytest.fixture(scope="module")
def tiny_math():
    return load_for_inference("tiny-math", "cpu")


def full_forward_logprobs(model, prompt_ids, token_ids, temperature, vocab_size):
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + token_ids])).logits[0, len(prompt_ids) - 1 : -1, :vocab_size]
    logprobs = torch.log_softmax(logits / temperature, -1)
    return logprobs.gather(1, torch.tensor(token_ids)[:, None])[:, 0]


def test_a_temperature_that_would_turn_the_batch_into_nan_is_refused_before_it_is_queued(tiny_math):
    model, tokenizer = tiny_math
    with Engine(model, max_batch_size=4, seed=0, vocab_size=len(tokenizer)) as engine:
        prompt = tokenizer(tiny_math_prompt(1, 2))["input_ids"]
        for temperature in (1e-50, 0.0, float("nan")):  # 1e-50 is 0 in float32: logits / 0
            with pytest.raises(ValueError, match=r"temperature .*: expected a finite number >= 0.0001"):
                engine.submit(GenerationRequest(prompt, max_new_tokens=2, temperature=temperature))
        assert (
            len(
                engine.submit(GenerationRequest(prompt, max_new_tokens=2, temperature=1e-4))
                .result(timeout=60)
                .token_ids
            )
            >= 1
        )


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_are_those_of_a_full_forward_pass(tiny_math, temperature):
    model, tokenizer = tiny_math
    with Engine(model, max_batch_size=4, seed=0, vocab_size=len(tokenizer)) as engine:
        prompts = [tokenizer(tiny_math_prompt(a, b))["input_ids"] for a in range(3) for b in range(4)]
        prompts[0] = tokenizer("12+34=\\boxed{")["input_ids"]  # another length: rows of the cache differ
        futures = [engine.submit(GenerationRequest(p, max_new_tokens=12, temperature=temperature)) for p in prompts]
        for prompt, future in zip(prompts, futures):
            generation = future.result(timeout=60)
            assert len(generation.token_ids) == 12 and generation.finish_reason == "length"
            expected = full_forward_logprobs(model, prompt, generation.token_ids, temperature, len(tokenizer))
            torch.testing.assert_close(torch.tensor(generation.logprobs), expected, atol=2e-5, rtol=0)


def assert_full_forward_logprobs(model, tokenizer, requests, futures):
    for request, future in zip(requests, futures):
        generation = future.result(timeout=60)
        expected = full_forward_logprobs(
            model, request.prompt_ids, generation.token_ids, request.temperature, len(tokenizer)
        )
        torch.testing.assert_close(torch.tensor(generation.logprobs), expected, atol=2e-5, rtol=0)


def test_cache_columns_move_grow_and_are_dropped_without_changing_logprobs(tiny_math):
    """The batch's buffers start 64 columns wide. A longer prompt reaching an idle engine grows them;
    one joining live rows moves those right (and grows them); long generations run out of columns
    (the buffers double); short rows refilled for longer than 64 steps leave the columns of finished
    rows behind (dropped in place). Every logprob stays a full forward's."""
    model, tokenizer = tiny_math
    short = [tokenizer(tiny_math_prompt(a, 1))["input_ids"] for a in range(5)]
    long = tokenizer("".join(tiny_math_prompt(a, b) for a in range(3) for b in range(3)))["input_ids"]
    assert len(long) > 64 + 11

    with Engine(model, max_batch_size=4, seed=1, vocab_size=len(tokenizer)) as engine:
        for prompt in (short[0], long):  # the second arrives with no row live
            request = GenerationRequest(prompt, max_new_tokens=8)
            assert_full_forward_logprobs(model, tokenizer, [request], [engine.submit(request)])

    with Engine(model, max_batch_size=4, seed=2, vocab_size=len(tokenizer)) as engine:
        requests = [GenerationRequest(p, max_new_tokens=n) for p, n in zip(short, [70, 20, 45, 9, 60])]
        futures = engine.submit_many(requests)
        while not engine.stats["decode_steps"]:
            threading.Event().wait(0.001)
        paused, resume = threading.Event(), threading.Event()
        engine.call_between_steps(lambda: (paused.set(), resume.wait(60)))
        paused.wait(60)  # the short rows are live and at most 11 + 70 columns wide: the long prompt is wider
        requests += [GenerationRequest(long, max_new_tokens=60)] * 2
        futures += engine.submit_many(requests[-2:])
        resume.set()
        assert_full_forward_logprobs(model, tokenizer, requests, futures)
        assert engine._batch.mask.shape[1] >= 256  # grown for the long prompt (128), then doubled

    with Engine(model, max_batch_size=4, seed=3, vocab_size=len(tokenizer)) as engine:
        # rows of 11 + at most 20 columns refilled as they finish: 80 decode steps in 64 columns
        requests = [GenerationRequest(short[i % 5], max_new_tokens=(6, 11, 16, 20)[i % 4]) for i in range(24)]
        assert_full_forward_logprobs(model, tokenizer, requests, engine.submit_many(requests))
        assert engine.stats["decode_steps"] > 64 and engine._batch.mask.shape[1] == 64


def test_samples_of_one_prompt_share_its_prefill(tiny_math):
    model, tokenizer = tiny_math
    engine = Engine(model, max_batch_size=16, seed=0, vocab_size=len(tokenizer))
    first, second = (tokenizer(tiny_math_prompt(a, 2))["input_ids"] for a in (1, 3))
    requests = [GenerationRequest(first, 6)] * 5 + [GenerationRequest(second, 6)] * 3
    futures = engine.submit_many(requests)  # queued before the engine starts: one admission
    with engine:
        generations = [f.result(timeout=60) for f in futures]
        assert engine.stats["prefill_tokens"] == len(first) + len(second)  # not 5 x first + 3 x second
        assert len({tuple(g.token_ids) for g in generations[:5]}) > 1  # each row samples on its own
        for request, generation in zip(requests, generations):
            expected = full_forward_logprobs(model, request.prompt_ids, generation.token_ids, 1.0, len(tokenizer))
            torch.testing.assert_close(torch.tensor(generation.logprobs), expected, atol=2e-5, rtol=0)


def test_finished_slots_are_refilled_and_stop_tokens_end_sequences(tiny_math):
    model, tokenizer = tiny_math
    with Engine(model, max_batch_size=4, seed=0, vocab_size=len(tokenizer)) as engine:
        prompt = tokenizer(tiny_math_prompt(1, 2))["input_ids"]
        lengths = [2, 9, 3, 7, 4, 8, 5, 6, 2, 9, 3, 7, 4, 8, 5, 6]
        # queued at once (submitted one by one, the engine could start on part of them)
        generations = [
            f.result(timeout=60) for f in engine.submit_many([GenerationRequest(prompt, n) for n in lengths])
        ]
        assert [len(g.token_ids) for g in generations] == lengths
        # without refilling, each wave of 4 would decode for its longest member: mean occupancy about 2.6
        assert engine.stats["decode_rows"] / engine.stats["decode_steps"] > 3.3
        assert engine.load() == {"active": 0, "queued": 0}

        stopped = engine.submit(
            GenerationRequest(prompt, 30, stop_token_ids=frozenset([tokenizer.eos_token_id]))
        ).result(timeout=60)
        assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == tokenizer.eos_token_id
        assert tokenizer.eos_token_id not in stopped.token_ids[:-1]


def test_a_watch_gets_each_step_s_tokens_once_and_they_add_up_to_the_generations(tiny_math):
    """A streamed request's view (`submit_many`'s `watch`): one call per step, each sequence's one new token with its
    logprob and version, the finish reason on its last; all in before its future resolves."""
    model, tokenizer = tiny_math
    prompt = tokenizer(tiny_math_prompt(1, 2))["input_ids"]
    requests = [GenerationRequest(prompt, 5, top_logprobs=2), GenerationRequest(prompt, 3, top_logprobs=2)]
    calls: list[list] = []
    with Engine(model, max_batch_size=4, seed=0, vocab_size=len(tokenizer)) as engine:
        futures = engine.submit_many(requests, watch=calls.append)
        generations = [f.result(timeout=60) for f in futures]
    assert [sorted(position for position, _ in call) for call in calls] == [[0, 1]] * 3 + [[0]] * 2
    for position, generation in enumerate(generations):
        deltas = [delta for call in calls for p, delta in call if p == position]
        assert all(len(d.token_ids) == len(d.logprobs) == len(d.versions) == len(d.top_logprobs) == 1 for d in deltas)
        assert [d.finish_reason for d in deltas] == [""] * (len(deltas) - 1) + ["length"]
        for name in ("token_ids", "logprobs", "versions", "top_logprobs"):
            assert [x for d in deltas for x in getattr(d, name)] == getattr(generation, name)


def test_sample_tokens_draws_each_row_from_its_distribution(monkeypatch):
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]])
    logprobs = probs.log().repeat(100_000, 1)  # zero probabilities: -inf
    tokens = sample_tokens(logprobs, torch.Generator().manual_seed(0)).view(-1, 2)
    counts = torch.bincount(tokens[:, 0], minlength=6) / len(tokens)
    torch.testing.assert_close(counts, probs[0], atol=0.005, rtol=0)  # over 3 standard deviations
    assert counts[[1, 4, 5]].sum() == 0 and (tokens[:, 1] == 5).all()  # never a token of probability 0

    # the draw's extremes: 0 must not pick the leading zero-probability entries, 1 (rounded up) not
    # run past the last entry; an entry whose exp underflows is a zero too
    one_token = torch.log_softmax(torch.tensor([[-200.0, -200.0, 5.0, -200.0, -200.0]]), -1)
    for draw in (0.0, 1.0):
        monkeypatch.setattr(torch, "rand", lambda shape, draw=draw, **kw: torch.full(shape, draw, dtype=kw["dtype"]))
        assert sample_tokens(one_token, torch.Generator()).tolist() == [2]
    monkeypatch.undo()
    with pytest.raises(ValueError, match="NaN or all -inf"):
        sample_tokens(torch.tensor([[0.0, float("nan")]]), torch.Generator())
    with pytest.raises(ValueError, match="NaN or all -inf"):
        sample_tokens(torch.full((1, 3), float("-inf")), torch.Generator())


def test_stopping_the_engine_fails_its_running_sequences_and_cancels_its_queued_ones(tiny_math):
    """A running future cannot be cancelled: stop() must fail it, or its waiter hangs until its own timeout."""
    model, tokenizer = tiny_math
    engine = Engine(model, max_batch_size=1, seed=0, vocab_size=len(tokenizer))  # not started: both requests queue
    prompt = tokenizer(tiny_math_prompt(1, 2))["input_ids"]
    running, queued = engine.submit_many([GenerationRequest(prompt, max_new_tokens=12)] * 2)  # one row: one runs
    release = threading.Event()
    held = engine.call_between_steps(lambda: release.wait(30))  # taken with the first admission, before its prefill
    engine.start()
    stopping = threading.Thread(target=engine.stop)
    try:
        while not running.running():
            time.sleep(0.01)
        stopping.start()
        while not engine._stopped:
            time.sleep(0.01)
    finally:
        release.set()  # then one prefill and one decode step, and the loop sees the stop
    stopping.join(timeout=30)
    assert held.result(timeout=1) is True
    with pytest.raises(RuntimeError, match="engine stopped before the sequence finished"):
        running.result(timeout=1)
    assert queued.cancelled()


def test_rows_of_different_temperatures_keep_theirs_when_rows_move(tiny_math):
    """Each row samples at its own request's temperature, also after finished rows are refilled and
    live rows move into their places."""
    model, tokenizer = tiny_math
    with Engine(model, max_batch_size=3, seed=4, vocab_size=len(tokenizer)) as engine:
        prompts = [tokenizer(tiny_math_prompt(a, 3))["input_ids"] for a in range(4)]
        requests = [
            GenerationRequest(prompts[i % 4], max_new_tokens=(3, 9, 5, 12)[i % 4], temperature=(0.6, 1.4)[i % 2])
            for i in range(10)
        ]
        assert_full_forward_logprobs(model, tokenizer, requests, engine.submit_many(requests))


def test_bad_requests_are_refused_before_queueing(tiny_math):
    model, tokenizer = tiny_math
    engine = Engine(model, max_batch_size=2, vocab_size=len(tokenizer))
    with pytest.raises(ValueError, match="empty"):
        engine.submit(GenerationRequest([], 4))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.submit(GenerationRequest([1, len(tokenizer)], 4))
    with pytest.raises(ValueError, match="exceeds the model's 256 positions"):
        engine.submit(GenerationRequest([1] * 250, 10))


def test_weights_change_between_decode_steps_and_sequences_keep_their_cache(tiny_math):
    model, tokenizer = tiny_math
    model = type(model)(model.config)
    model.load_state_dict(load_for_inference("tiny-math", "cpu")[0].state_dict())
    new_weights = {name: p.detach() + 0.05 * torch.randn_like(p) for name, p in model.named_parameters()}
    with Engine(model.eval(), max_batch_size=8, seed=1, vocab_size=len(tokenizer)) as engine:
        prompts = [tokenizer(tiny_math_prompt(a, 1))["input_ids"] for a in range(8)]
        futures = [engine.submit(GenerationRequest(p, max_new_tokens=200, temperature=1.0)) for p in prompts]
        while engine.stats["generated_tokens"] < 8 * 20:  # well into decoding
            threading.Event().wait(0.001)

        def apply_weights():
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.copy_(new_weights[name])
            return 1

        pause = engine.schedule_update(apply_weights).result(timeout=60)
        assert pause > 0
        for prompt, future in zip(prompts, futures):
            g = future.result(timeout=120)
            switch = g.versions.index(1)
            assert 0 < switch < len(g.token_ids) == 200  # one sequence, two weight versions, not restarted
            assert g.versions == [0] * switch + [1] * (200 - switch)
            # the keys and values before the switch were kept (PipelineRL), not recomputed with the
            # new weights: the later tokens' logprobs are not those of a full pass with the new weights
            new_full = full_forward_logprobs(model, prompt, g.token_ids, 1.0, len(tokenizer))
            assert not torch.allclose(torch.tensor(g.logprobs[switch:]), new_full[switch:], atol=1e-4)


def test_grpo_args_check_names_the_field():
    from lm_human_preference_details.cli import UserError

    with pytest.raises(UserError, match="--batch-size 60 must be a multiple of --group-size 8"):
        grpo_args(batch_size=60, group_size=8).check()
    with pytest.raises(UserError, match="--steps-ahead must be >= 1"):
        grpo_args(steps_ahead=0).check()
    with pytest.raises(
        UserError,
        match="--steps-ahead 2.5 starts 20 problems ahead, which requests of 8 problems cannot split "
        r"\(it would act as 2\): pass a --problems-per-request that divides both 8 and 20",
    ):
        grpo_args(batch_size=64, group_size=8, steps_ahead=2.5, problems_per_request=0).check()
    with pytest.raises(
        UserError, match="--steps-ahead 2.3 is 18.4 problems ahead, not a whole number: pass a multiple of 1/8"
    ):
        grpo_args(batch_size=64, group_size=8, steps_ahead=2.3).check()
    grpo_args(batch_size=64, group_size=8, steps_ahead=2.5, problems_per_request=4).check()
    grpo_args(mode="sync", batch_size=64, group_size=8, steps_ahead=2.5, problems_per_request=0).check()  # sync: unused
    assert (
        grpo_args(batch_size=24, group_size=8, steps_ahead=7 / 3, problems_per_request=1)
        .run_schedule()
        .problems_ahead()
        == 7
    )  # 7.000000000000001
    with pytest.raises(UserError, match="--steps-ahead nan is nan problems ahead"):
        grpo_args(steps_ahead=float("nan")).check()
    with pytest.raises(UserError, match="--problems-per-request 3 must divide the 8 problems of an optimizer step"):
        grpo_args(batch_size=64, group_size=8, problems_per_request=3).check()
    with pytest.raises(UserError, match="--problems-per-request must be >= 0, got -1"):
        grpo_args(problems_per_request=-1).check()
    for temperature in (0.0, 1e-50, float("nan"), float("inf")):  # 1e-50 is 0 in float32
        with pytest.raises(UserError, match=r"--temperature must be a finite number >= 0.0001"):
            grpo_args(temperature=temperature).check()
    one_request_per_step = grpo_args(batch_size=16, group_size=8, problems_per_request=0)
    one_request_per_step.check()  # 0 fits every batch size: all of a step's problems
    assert one_request_per_step.request_problems() == 2 and grpo_args(problems_per_request=4).request_problems() == 4
    assert get_preset("tiny").serving.problems_per_request == 0  # the preset: one request per optimizer step
    with pytest.raises(
        UserError,
        match="--problems-per-request 0: 1024 samples in one request .* divides the 128 problems "
        "of a step into requests of at most 64",
    ):  # a server takes at most 512 (MAX_CHOICES)
        grpo_args(batch_size=1024, group_size=8, problems_per_request=0).check()
    grpo_args(batch_size=1024, group_size=8, problems_per_request=64).check()
    grpo_args(batch_size=1024, group_size=8, problems_per_request=0, chat=True).check()  # chat: one request per problem
    if not torch.cuda.is_available():
        with pytest.raises(
            UserError, match="--weight-backend nccl sends GPU tensors and no GPU is visible; use --weight-backend gloo"
        ):
            ProcessArgs(weight_backend="nccl").check_weight_backend()


@pytest.mark.parametrize(
    "mode, lookahead, version, last_allowed",
    [
        ("pipeline", 2, 0, 15),
        ("pipeline", 2.5, 0, 19),
        ("pipeline", 2.5, 3, 43),
        ("sync", 2.5, 4, 8 * 8 - 1),
        ("sync", 2.5, 0, 4 * 8 - 1),
        ("sync", 2.5, 3, 4 * 8 - 1),
    ],
)  # 3: resumed mid-round
def test_the_actor_starts_groups_up_to_its_lookahead_beyond_the_servers_weights(mode, lookahead, version, last_allowed):
    from lm_human_preference_details.grpo.actor import Actor

    args = grpo_args(
        mode=mode, batch_size=64, group_size=8, steps_ahead=lookahead, sync_steps=4, problems_per_request=4
    )
    actor = Actor(args, ["http://127.0.0.1:1", "http://127.0.0.1:2"], problems=[])
    actor.servers[1].version = version  # the newest weights any server has
    assert actor.may_start(last_allowed) and not actor.may_start(last_allowed + 1)


@pytest.mark.parametrize(
    "mode, behind, usable",
    [("pipeline", 2, True), ("pipeline", 3, False), ("sync", 0, True), ("sync", 1, False), ("sync", 4, False)],
)
def test_a_server_behind_the_newest_weights_gets_requests_only_within_the_lookahead(mode, behind, usable):
    """`sync`: a round's samples all come from the weights it began with, so a server still receiving them
    (or one that failed to) gets none of the round's requests; `pipeline`: up to `steps_ahead` behind."""
    from lm_human_preference_details.grpo.actor import Actor

    args = grpo_args(mode=mode, batch_size=64, group_size=8, steps_ahead=2, sync_steps=4)
    actor = Actor(args, ["http://127.0.0.1:1", "http://127.0.0.1:2"], problems=[])
    actor.servers[0].version, actor.servers[1].version = 8, 8 - behind
    assert actor.usable(actor.servers[0]) and actor.usable(actor.servers[1]) == usable


def test_the_actor_fails_when_no_server_has_been_usable_for_the_request_timeout():
    """All servers down, or all left behind by the newest weights: no sample would ever come, so the run fails."""
    import asyncio
    import time

    from lm_human_preference_details.grpo.actor import Actor, ActorError

    actor = Actor(
        grpo_args(mode="sync", request_timeout_s=0.5), ["http://127.0.0.1:1", "http://127.0.0.1:2"], problems=[]
    )
    actor.servers[0].down_until = time.monotonic() + 3600  # down
    actor.servers[0].version, actor.servers[1].version = 8, 4  # 1 is a round behind 0's weights

    async def acquire():
        actor._changed = asyncio.Condition()
        return await actor._acquire_server()

    start = time.monotonic()
    with pytest.raises(
        ActorError,
        match=r"no server has been usable for 0.5 s \(--request-timeout-s\): http://127.0.0.1:1 at "
        r"version 8, http://127.0.0.1:2 at version 4, the newest weights are version 8",
    ):
        asyncio.run(acquire())
    assert time.monotonic() - start < 5
    actor.servers[1].version = 8  # caught up: it is used
    assert asyncio.run(acquire()) is actor.servers[1]


def test_an_evaluation_request_goes_out_past_the_in_flight_cap():
    """Training requests wait for a free slot; an evaluation's go out at once, so that its tokens come from as few
    weight versions as the server's queue allows."""
    import asyncio

    from lm_human_preference_details.grpo.actor import Actor

    actor = Actor(grpo_args(max_in_flight=2, request_timeout_s=0.5), ["http://127.0.0.1:1"], problems=[])
    actor.servers[0].in_flight = 2  # full

    async def acquire(capped: bool):
        actor._changed = asyncio.Condition()
        return await asyncio.wait_for(actor._acquire_server(capped), timeout=0.2)

    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(acquire(capped=True))
    assert asyncio.run(acquire(capped=False)) is actor.servers[0] and actor.servers[0].in_flight == 3
