"""The rows of benchmarks/grpo_speed.py's schedules table that run in one process each (`--role`): the raw compute
of an optimizer step and TRL's GRPOTrainer, seconds per step."""

import time

from grpo_speed_args import Args, run_settings

from lm_human_preference_details.benchmarking import synchronize


def raw_step_times(args: Args) -> list[float]:
    """The compute of an optimizer step alone, one process, nothing overlapped or sent anywhere:
    sample the step's completions (a prefill of every row, each prompt group_size times where the
    servers prefill it once, then one cached forward per token for the whole batch), score them, one forward and
    backward of the policy over prompt + completion with the run's loss (on policy: ratio 1), clip, one optimizer
    step. Seconds per step."""
    import torch
    from transformers import AutoTokenizer

    from lm_human_preference_details.assets import resolve_model_path
    from lm_human_preference_details.grpo.loss import LossSettings, policy_loss
    from lm_human_preference_details.grpo.rewards import load_task_problems
    from lm_human_preference_details.models import load_causal_lm, logprobs_of
    from lm_human_preference_details.optim import make_optimizer

    settings = run_settings(args)
    torch.manual_seed(settings.seed)
    device = torch.device(args.device)
    generator = torch.Generator(device=device).manual_seed(settings.seed)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(settings.task.model))
    vocab = len(tokenizer)
    model = load_causal_lm(settings.task.model).to(device)
    optim = settings.optim
    optimizer = make_optimizer(optim.optimizer, model.parameters(), lr=optim.lr, eps=optim.adam_eps)
    problems = load_task_problems(settings)
    groups, n = settings.groups_per_step(), settings.sampling.group_size
    times = []
    for step in range(args.steps + 1):  # the first step warms up, untimed
        start = time.perf_counter()
        batch = [problems[(step * groups + i) % len(problems)] for i in range(groups) for _ in range(n)]
        prompts = [tokenizer(p.prompt, add_special_tokens=False)["input_ids"] for p in batch]
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
        prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        completions, valid = sample_completions(model, ids, prompt_mask, settings, tokenizer, generator)
        advantages = completion_advantages(batch, completions, valid, tokenizer, settings)
        full_mask = torch.cat([prompt_mask, valid], 1)
        predicting = torch.arange(
            width - 1, full_mask.shape[1] - 1, device=device
        )  # the positions before each completion token
        logits = model(
            input_ids=torch.cat([ids, completions], 1),
            attention_mask=full_mask,
            position_ids=(full_mask.cumsum(1) - 1).clamp(min=0),
            logits_to_keep=predicting,
        ).logits[..., :vocab]
        logprobs = logprobs_of(logits, completions, settings.sampling.temperature)
        options = LossSettings(
            loss_type=settings.loss.loss_type, ratio_cap=settings.loss.ratio_cap, clip_eps=settings.loss.clip_eps
        )
        loss = policy_loss(logprobs, logprobs.detach(), advantages, valid, len(batch), options).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times[1:]


def sample_completions(model, ids, prompt_mask, settings, tokenizer, generator):
    """Completions of the left-padded prompts `ids` as the servers sample them (a prefill, then one cached forward per
    token for the whole batch, until `max_tokens` or every row's EOS), and the mask of their tokens up to EOS."""
    import torch

    from lm_human_preference_details.grpo.serving.engine import sample_tokens

    vocab, eos, sampling = len(tokenizer), tokenizer.eos_token_id, settings.sampling
    with torch.no_grad():
        mask, positions = prompt_mask, (prompt_mask.cumsum(1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
        tokens = []
        for t in range(sampling.max_tokens):
            logprobs = torch.log_softmax(out.logits[:, -1, :vocab].float() / sampling.temperature, -1)
            tokens.append(sample_tokens(logprobs, generator)[:, None])  # the servers' sampler
            if t + 1 == sampling.max_tokens or not sampling.ignore_eos and (torch.cat(tokens, 1) == eos).any(1).all():
                break
            mask, positions = torch.cat([mask, torch.ones_like(tokens[-1])], 1), positions[:, -1:] + 1
            out = model(
                input_ids=tokens[-1], attention_mask=mask, position_ids=positions, cache=out.cache, use_cache=True
            )
    completions = torch.cat(tokens, 1)
    after_eos = (completions == eos).long().cumsum(1) - (completions == eos).long()  # EOS itself is kept
    valid = torch.ones_like(completions) if sampling.ignore_eos else (after_eos == 0).long()
    return completions, valid


def completion_advantages(batch, completions, valid, tokenizer, settings):
    """The group advantages of the completions of `batch`'s problems, scored as the actor scores them."""
    import torch

    from lm_human_preference_details.grpo.loss import group_advantages
    from lm_human_preference_details.grpo.rewards import integer_reward, math_reward

    texts = [
        tokenizer.decode(row[:length], skip_special_tokens=True)
        for row, length in zip(completions.tolist(), valid.sum(1).tolist())
    ]
    rewards = []
    for problem, text in zip(batch, texts):
        reward = integer_reward(settings.task.answer_prefix + text, problem.answer)
        rewards.append(math_reward(settings.task.answer_prefix + text, problem.answer) if reward is None else reward)
    return group_advantages(
        torch.tensor(rewards, device=completions.device),
        settings.sampling.group_size,
        settings.loss.baseline,
        settings.loss.divide_by_std,
    )


def trl_step_times(args: Args) -> list[float]:
    """TRL's GRPOTrainer at the run's settings, seconds per optimizer step (all but the first)."""
    import tempfile

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lm_human_preference_details.assets import resolve_model_path
    from lm_human_preference_details.grpo.rewards import load_task_problems, math_reward

    settings = run_settings(args)
    sampling = settings.sampling
    problems = load_task_problems(settings)
    path = resolve_model_path(settings.task.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.pad_token = tokenizer.eos_token

    def reward(completions, answer, **_):  # the actor's reward: the answer prefix, then the last box
        return [math_reward(settings.task.answer_prefix + c, a) for c, a in zip(completions, answer)]

    ends: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_end(self, *_, **__):
            ends.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=settings.optim.batch_size,
            num_generations=sampling.group_size,
            steps_per_generation=1,
            gradient_accumulation_steps=1,
            max_completion_length=sampling.max_tokens,
            max_steps=args.steps,
            learning_rate=settings.optim.lr,
            temperature=sampling.temperature,
            beta=0.0,
            # --ignore-eos: every completion max_tokens long, as the servers sample them
            generation_kwargs={"min_new_tokens": sampling.max_tokens} if sampling.ignore_eos else None,
            report_to="none",
            save_strategy="no",
            logging_steps=1,
            use_cpu=args.device == "cpu",
            seed=0,
            disable_tqdm=True,
            bf16=False,  # TRL's default is bf16 autocast (also on a CPU); every other row computes in fp32
            gradient_checkpointing=False,  # TRL's default recomputes the forward in the backward; no other row does
        )
        dataset = Dataset.from_dict({"prompt": [p.prompt for p in problems], "answer": [p.answer for p in problems]})
        trainer = GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(path),
            reward_funcs=reward,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[StepTimer()],
        )
        trainer.train()
    return [b - a for a, b in zip(ends, ends[1:])]


ROLES = {"raw": raw_step_times, "trl": trl_step_times}
