"""`--recipe`: a peer's loss settings in one flag (grpo/config.py's RECIPES), how it meets the other flags, how the
trainer applies the loss options whatever the packing, and a run of the tiny preset per recipe that learns."""

import copy
import dataclasses
import json
import os
import subprocess

import pytest
import torch

from lm_human_preference_details import cli
from lm_human_preference_details.grpo.config import RECIPES, GRPOArgs, LossArgs, get_preset
from lm_human_preference_details.grpo.trainer import accumulate_gradients, flatten_groups, pack
from tests.grpo.args import grpo_args
from tests.grpo.test_launch import LAUNCH, Launched, metrics, no_launcher_left_behind, success_rise  # noqa: F401
from tests.grpo.test_trainer import sampled_groups, tiny_math  # noqa: F401

LOSS_FIELDS = [field.name for field in dataclasses.fields(LossArgs)]


def parse(*flags: str) -> GRPOArgs:
    return cli.parse(GRPOArgs, get_preset, "tiny", argv=list(flags))


@pytest.mark.parametrize("name", list(RECIPES))
def test_a_recipe_sets_every_loss_option_to_its_values_and_the_rest_to_the_defaults(name):
    args, defaults = parse("--recipe", name), LossArgs()
    assert set(RECIPES[name].settings) <= set(LOSS_FIELDS)
    for field in LOSS_FIELDS:
        assert getattr(args.loss, field) == RECIPES[name].settings.get(field, getattr(defaults, field)), field
    assert args.recipe == name and args.optim.lr == get_preset("tiny").optim.lr  # the task's other values stay
    args.check()


def test_pipelinerl_is_its_base_yaml():
    args = parse("--recipe", "pipelinerl").loss
    # conf/finetune/base.yaml at 58d3934: policy_loss reinforce, epsilon_high 2e-2, clamp_log_ratio_ref_new_value 5,
    # kl_coef 0 (final_kl_coef: the same), entropy_bonus 0, divide_advantage_by_std false, overlong_filtering false;
    # populate_rl_data: the leave-one-out baseline; tokens_weights 1 / batch_size
    assert (args.loss_type, args.ratio_cap, args.kl_clamp, args.baseline) == ("reinforce", 1.02, 5.0, "leave_one_out")
    assert (args.kl_coef, args.kl_coef_final, args.entropy_coef, args.divide_by_std) == (0.0, None, 0.0, False)
    assert (args.loss_normalizer, args.overlong_filtering, args.use_advantages) == ("sequences", False, True)


def test_flags_after_a_recipe_override_it_and_a_recipe_overrides_the_flags_before_it():
    assert parse("--recipe", "pipelinerl", "--ratio-cap", "2").loss.ratio_cap == 2.0
    assert parse("--ratio-cap", "2", "--recipe", "pipelinerl").loss.ratio_cap == 1.02
    assert parse("--recipe=dapo", "--no-overlong-filtering").loss.overlong_filtering is False
    # a later recipe resets what an earlier one set
    assert parse("--recipe", "dapo", "--recipe", "pipelinerl").loss.clip_eps_high is None
    assert parse("--task", "tiny", "--recipe", "dr_grpo").loss.loss_normalizer == "max_tokens"
    assert parse().recipe == "default" and parse() == parse("--recipe", "default")


def test_an_unknown_recipe_is_a_user_error_naming_the_choices():
    with pytest.raises(cli.UserError, match="--recipe 'trl' is unknown; choose one of default, pipelinerl"):
        parse("--recipe", "trl")


def test_the_help_lists_the_recipes_and_the_options_with_their_provenance():
    result = subprocess.run(LAUNCH + ["--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    help_text = " ".join(result.stdout.replace("│", " ").split())  # tyro wraps the lines in a box
    for name in RECIPES:
        assert f"`{name}`" in help_text, name
    for flag in ["--" + field.replace("_", "-") for field in LOSS_FIELDS]:
        assert flag in help_text, flag
    for provenance in (
        "base.yaml at 58d3934",
        "arXiv 2503.20783",
        "arXiv 2503.14476",
        "TRL's GRPOTrainer runs it: loss_type dr_grpo",
    ):
        assert provenance in help_text, provenance


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--loss-type", "ppo_clip", "--importance-sampling", "token_mask"],
            "error: --importance-sampling token_mask weighs --loss-type reinforce's gradient",
        ),
        (["--kl-clamp", "0"], "error: --kl-clamp must be > 0, got 0.0"),
        (["--kl-coef-final", "-1"], "error: --kl-coef-final must be >= 0"),
        (["--recipe", "grpo"], "error: --recipe 'grpo' is unknown; choose one of default, pipelinerl, dr_grpo, dapo"),
    ],
)
def test_bad_loss_options_are_one_line_errors(tmp_path, flags, message):
    result = subprocess.run(
        LAUNCH + ["--output-dir", str(tmp_path / "run"), *flags], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].startswith(message), result.stderr


def scored_groups(tiny_math):  # noqa: F811
    """Three groups of four engine samples with rewards that differ within each group, one completion in each
    cut by the length limit (finish_reason `length`)."""
    groups = sampled_groups(tiny_math, ["1+2=\\boxed{", "33+44=\\boxed{", "2+2=\\boxed{"], [6, 9, 4], attempts=4)
    for i, group in enumerate(groups):
        for j, attempt in enumerate(group.attempts):
            attempt.reward = float((i + j) % 2)
            attempt.finish_reason = "length" if j == 1 else "stop"
    return groups


def gradients_and_stats(tiny_math, groups, args, step=0):  # noqa: F811
    """The float64 gradient of one step's loss (`accumulate_gradients`, the initial weights as the KL's reference)
    and its stats."""
    model = copy.deepcopy(tiny_math[0]).double()
    rewards = torch.tensor([s.reward for s in flatten_groups(groups)], dtype=torch.float64)
    stats = accumulate_gradients(model, copy.deepcopy(model), groups, rewards, args, len(tiny_math[1]), step=step)
    return {name: p.grad.clone() for name, p in model.named_parameters()}, stats


OPTIONS = {
    **{f"--recipe {name}": ["--recipe", name] for name in RECIPES},
    "group_tokens, relu, batch std, KL and entropy schedules": [
        *("--loss-normalizer", "group_tokens", "--relu-policy-weights", "--divide-by-std", "--std-over", "batch"),
        *("--kl-coef", "0.1", "--kl-coef-final", "0", "--entropy-coef", "0.01", "--entropy-coef-final", "0.05"),
    ],
    "gspo over sequence means, rewards as weights": [
        *("--loss-type", "gspo", "--loss-normalizer", "sequence_mean", "--no-use-advantages"),
    ],
    "sequence_mask, overlong filtering": [
        *("--importance-sampling", "sequence_mask", "--ratio-cap", "1.5", "--overlong-filtering"),
    ],
}


@pytest.mark.parametrize("options", list(OPTIONS))
def test_a_steps_gradient_does_not_depend_on_the_packing_under_every_option(tiny_math, options):  # noqa: F811
    """Every normaliser divides by the whole batch's counts in each micro-batch, so one micro-batch or one per attempt
    gives the same gradient and stats (float64); the stats are means over the tokens in the loss."""
    groups = scored_groups(tiny_math)
    runs = []
    for budget in (10**6, 8):
        settings = ["--group-size", "4", "--token-budget", str(budget), "--temperature", "0.8", "--steps", "4"]
        args = parse(*settings, *OPTIONS[options])
        runs.append(gradients_and_stats(tiny_math, groups, args, step=2))
    (whole, whole_stats), (split, split_stats) = runs
    for name, grad in whole.items():
        torch.testing.assert_close(split[name], grad, atol=1e-12, rtol=1e-9)
    assert any(grad.abs().max() > 0 for grad in whole.values())
    for key, value in whole_stats.items():
        assert split_stats[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    assert 0.5 < whole_stats["ratio/mean"] < 2 and 0 <= whole_stats["ratio/clipfrac"] <= 1
    assert whole_stats.get("weight/max", 0) <= args.loss.ratio_cap


def test_overlong_filtering_gives_a_cut_completion_no_gradient(tiny_math):  # noqa: F811
    """Its logprobs under the behaviour policy change its weight, so without filtering they change the gradient;
    with it they do not: the cut completions are out of the loss."""
    groups = scored_groups(tiny_math)
    changed = copy.deepcopy(groups)
    for group in changed:
        group.attempts[1].logprobs = [lp - 0.7 for lp in group.attempts[1].logprobs]
    for filtering in (False, True):
        args = grpo_args(get_preset("tiny"), group_size=4, temperature=0.8, overlong_filtering=filtering)
        before, after = (
            gradients_and_stats(tiny_math, groups, args)[0],
            gradients_and_stats(tiny_math, changed, args)[0],
        )
        same = all(torch.allclose(before[name], after[name], atol=1e-14, rtol=0) for name in before)
        assert same == filtering, filtering
    assert len(pack(groups, 8)) > 1


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [name for name in RECIPES if name != "default"])  # default: test_grpo_launch.py
def test_the_tiny_preset_learns_under_every_recipe(tmp_path, recipe):
    run = Launched(tmp_path / recipe, "--recipe", recipe, "--steps", "100")
    assert run.finish() == 0, run.output()
    rows = metrics(run.output_dir)
    assert [r["step"] for r in rows] == list(range(1, 101))
    first, last = success_rise(rows)
    assert last > first + 0.1, (recipe, first, last)
    with open(os.path.join(run.output_dir, "args.json")) as f:
        recorded = json.load(f)
    loss = recorded["loss"]
    assert recorded["recipe"] == recipe and all(loss[k] == v for k, v in RECIPES[recipe].settings.items())
    if loss["loss_type"] == "reinforce":  # the capped weight beside the raw ratio
        assert all(r["weight/max"] <= loss["ratio_cap"] + 1e-6 for r in rows)
    assert run.leftovers() == []


def test_every_loss_option_the_flags_offer_is_one_the_loss_implements():
    """The flags' choices (grpo/loss_options.py's names) each run through the loss: a loss type is a function of
    the loss's registry, an importance-sampling mode, a normaliser, a baseline and a std are accepted."""
    from typing import get_args, get_type_hints

    from lm_human_preference_details.grpo import loss

    choices = {name: get_args(hint) for name, hint in get_type_hints(LossArgs).items()}
    assert set(choices["loss_type"]) == set(loss.POLICY_OBJECTIVES)
    x, mask = torch.zeros(1, 2), torch.ones(1, 2)
    for mode in choices["importance_sampling"]:
        loss.policy_loss(x, x, torch.ones(1), mask, 1, loss.LossSettings(importance_sampling=mode))
    for normalizer in choices["loss_normalizer"]:
        loss.token_weights(mask, normalizer, 1, num_tokens=2, max_tokens=2, group_tokens=torch.ones(1))
    for baseline in choices["baseline"]:
        for std_over in choices["std_over"]:
            loss.group_advantages(torch.tensor([0.0, 1.0]), 2, baseline, True, std_over=std_over)


def test_a_group_of_one_trains_only_on_the_rewards():
    """A group of one is its own baseline (advantage 0, as in PipelineRL): refused unless the rewards weigh log pi."""
    with pytest.raises(cli.UserError, match="--group-size 1: a group needs at least 2 attempts .*--no-use-advantages"):
        parse("--group-size", "1", "--batch-size", "8").check()
    parse("--group-size", "1", "--batch-size", "8", "--no-use-advantages").check()
