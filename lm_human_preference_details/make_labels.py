"""Make best-of-N preference labels with a programmatic labeler, in OAI's label-file format.

For each query the reference policy samples N responses (fixed length, the task's temperature,
truncated like the responses OAI showed its labelers, and like them only queries whose N responses
all contain the truncate token), the labeler scores them, and the best one's index is the label.
`python -m lm_human_preference_details.make_labels --task tiny --output labels.json`
"""

from dataclasses import dataclass, field

import torch
import tyro

from . import cli, labelers, tasks
from .data import Labels, QuerySampler, format_queries, write_labels
from .models import load_causal_lm
from .progress import progress_bar
from .sampling import sample_responses
from .tasks import TaskHParams
from .text import contains_truncate_token, load_tokenizer, strip_pad, truncate_after_token


@dataclass
class Args:
    """Best-of-N labels from a programmatic labeler, in OAI's label-file format."""

    preset: tyro.conf.Suppress[str] = "sentiment"
    task: TaskHParams = field(default_factory=TaskHParams)
    labeler: str = "vader"
    """`vader`, `vowels`, or `module:function` scoring (query texts, response texts) -> floats"""
    num_labels: int = 512
    """label records to write"""
    num_responses: int = 4
    """responses per query (best_of_N)"""
    batch_size: int = 64
    """queries sampled at once"""
    seed: int = 1
    """seed of the query order and of sampling"""
    output: str = "labels.json"
    """where to write the label file"""


@torch.no_grad()
def make_labels(
    lm,
    tokenizer,
    sampler: QuerySampler,
    task: TaskHParams,
    labeler: labelers.Labeler,
    num_labels: int,
    num_responses: int,
) -> Labels:
    """`num_labels` best-of-`num_responses` labels of the policy `lm`'s samples, with a progress bar in a terminal
    that also counts the tokens of the batch being sampled (on a CPU a batch can take minutes)."""
    pad_id = tokenizer.oai_pad_token_id
    device = next(lm.parameters()).device
    queries, samples, best = [], [], []
    made = batches_without_label = 0
    with progress_bar(num_labels, "labels", "label") as bar:
        while made < num_labels:
            query = next(sampler)  # (B, Q)
            contexts = format_queries(query, tokenizer, task).repeat_interleave(num_responses, dim=0).to(device)
            responses, _ = sample_responses(
                lm,
                contexts,
                pad_id,
                task.response_length,
                task.temperature,
                vocab_size=len(tokenizer),
                on_token=lambda t: bar.set_postfix_str(f"sampling token {t}/{task.response_length}"),
            )  # (B*K, R)
            responses = responses.cpu()
            if task.truncate_token is not None:
                # OAI: lm_human_preferences/lm_tasks.py#L54-L65
                # labelers see only responses that pass the filter (the truncate token at or after truncate_after;
                # stage 2 gives the others a fixed penalty, not the reward model's score), so a query is labeled
                # only when all its responses pass
                passes = (
                    contains_truncate_token(responses, task.truncate_token, task.truncate_after)
                    .view(len(query), num_responses)
                    .all(1)
                )
                query, responses = query[passes], responses.view(len(passes), num_responses, -1)[passes].flatten(0, 1)
                responses = truncate_after_token(responses, task.truncate_token, task.truncate_after, pad_id)
                batches_without_label = 0 if len(query) else batches_without_label + 1
                if batches_without_label == MAX_BATCHES_WITHOUT_LABEL:
                    raise cli.UserError(
                        f"{MAX_BATCHES_WITHOUT_LABEL} batches in a row had no query whose {num_responses} responses "
                        f"all contain --task.truncate-token {task.truncate_token} at or after --task.truncate-after "
                        f"{task.truncate_after}: the policy rarely samples it there; lower --task.truncate-after or "
                        "change the token"
                    )
                if not len(query):
                    continue
            query_texts = [text for q in query for text in [tokenizer.decode(strip_pad(q, pad_id))] * num_responses]
            response_texts = [tokenizer.decode(strip_pad(r, pad_id)) for r in responses]
            scores = torch.tensor(labeler(query_texts, response_texts), dtype=torch.float64).view(-1, num_responses)
            queries.append(query)
            samples.append(responses.view(len(query), num_responses, -1))
            best.append(labelers.pick_best(scores))
            bar.set_postfix_str("", refresh=False)  # the batch is sampled
            bar.update(min(made + len(query), num_labels) - made)
            made += len(query)
    return Labels(torch.cat(queries), torch.cat(samples), torch.cat(best))[:num_labels]


MAX_BATCHES_WITHOUT_LABEL = 50
"""batches in a row whose queries all have a response without the truncate token before the task is taken to make
none"""


def defaults_for_task(name: str) -> Args:
    preset = tasks.get_preset(name)
    return Args(preset=name, task=preset.task, labeler=preset.labels.labeler or "vader")


@cli.main_with_user_errors
def main() -> None:
    args = cli.parse(Args, defaults_for_task, default_task="sentiment", presets=tasks.PRESETS)
    tasks.check_task(args.task)
    cli.require(0, {"num_labels": args.num_labels, "batch_size": args.batch_size})
    cli.require(1, {"num_responses": args.num_responses})  # best of one says nothing
    torch.manual_seed(args.seed)
    labeler = labelers.load_labeler(args.labeler)
    tokenizer = load_tokenizer(args.task.base_model)
    lm = load_causal_lm(args.task.base_model)
    sampler = QuerySampler(args.task, tokenizer, batch_size=args.batch_size, seed=args.task.query_seed)
    labels = make_labels(lm, tokenizer, sampler, args.task, labeler, args.num_labels, args.num_responses)
    write_labels(args.output, labels, tokenizer.oai_pad_token_id)
    print(f"wrote {len(labels)} labels to {args.output}")


if __name__ == "__main__":
    main()
    cli.exit_finished_rank()
