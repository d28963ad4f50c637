"""The limit row of benchmarks/grpo_speed.py's generation table: vLLM's own offline `LLM.generate`, built from the
engine arguments, environment and sampling that grpo/serving/vllm_server.py derives from the same server flags,
timing the prompts, samples per prompt and tokens of the server's timed requests, all given at once.

    PYTHONPATH=. .venv-vllm/bin/python benchmarks/vllm_generate.py --prompts prompts.json --n 8 --max-tokens 24 \\
        --out limit.json -- --model tiny-math --threads 2 --max-batch-size 256

Runs in the vLLM environment (argparse only: it has no tyro). `--prompts` is a JSON file
`{"warm_up": [prompt, ...], "timed": [prompt, ...]}`: the warm-up prompts are generated first, untimed (vLLM's
first generate is slower), then the timed ones. Each prompt is tokenized as the server tokenizes a request's, and
sampled `--n` times, `--max-tokens` tokens each past EOS (the actor's `ignore_eos` requests). The flags after `--`
are the server's (`grpo.serving.vllm_server.parse_args`); the result, JSON, goes to `--out` and stdout.
"""

import argparse
import json
import shutil
import sys
import time

from lm_human_preference_details.grpo.serving.request_checks import Sampling
from lm_human_preference_details.grpo.serving.vllm_server import (
    _environment,
    engine_arguments,
    engine_dtype,
    parse_args,
    sampling_params,
)


def generate(prompts: dict[str, list[str]], n: int, max_tokens: int, temperature: float, server) -> dict:
    """Load the engine of `server`'s flags, generate the warm-up prompts, then time the timed ones."""
    from transformers import AutoTokenizer
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    from lm_human_preference_details.assets import resolve_model_path

    path = resolve_model_path(server.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    start = time.perf_counter()
    llm = LLM(**engine_arguments(server, path, engine_dtype(server.dtype)))
    load_s = time.perf_counter() - start
    params = sampling_params(Sampling(max_tokens, temperature, frozenset(), n))  # ignore_eos: no stop token

    def timed(texts: list[str]) -> tuple[float, list]:
        # as grpo.serving.http_contract tokenizes a request's prompts (outside the time: the engine's work is timed)
        ids = [TokensPrompt(prompt_token_ids=tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
        start = time.perf_counter()
        outputs = llm.generate(ids, params, use_tqdm=False)
        return time.perf_counter() - start, outputs

    warm_up_s, _ = timed(prompts["warm_up"])
    seconds, outputs = timed(prompts["timed"])
    completions = [c for output in outputs for c in output.outputs]
    tokens = sum(len(c.token_ids) for c in completions)
    return {
        "sequences": len(completions),
        "tokens": tokens,
        "seconds": seconds,
        "samples_per_s": len(completions) / seconds,
        "tokens_per_s": tokens / seconds,
        "warm_up_s": warm_up_s,
        "load_s": load_s,
    }


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    own, server_flags = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", required=True, help='JSON file: {"warm_up": [...], "timed": [...]} prompts')
    parser.add_argument("--n", type=int, required=True, help="samples of each prompt")
    parser.add_argument("--max-tokens", type=int, required=True, help="tokens of each sample (past EOS)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    parser.add_argument("--out", required=True, help="where the result goes (JSON)")
    args = parser.parse_args(own)
    server = parse_args(server_flags)
    if server.exit_with_parent:
        from lm_human_preference_details.grpo.lifetime import exit_with_parent

        exit_with_parent()
    owned = _environment(server)  # before vLLM is imported: it reads them then
    try:
        with open(args.prompts) as f:
            result = generate(json.load(f), args.n, args.max_tokens, args.temperature, server)
    finally:
        if owned:
            shutil.rmtree(owned, ignore_errors=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":  # vLLM starts its engine with spawn, which imports this module again
    main()
