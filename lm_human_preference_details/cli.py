"""What every stage script shares on its command line: `--task` presets and one-line errors.

torch and transformers are imported where they are used: light processes (the reward verifier's
worker) import `UserError` from here without paying seconds of start-up for them.
"""

import dataclasses
import functools
import os
import sys
from collections.abc import Callable, Collection
from typing import Literal, TypeVar

import tyro

from .preemption import EXIT_STATUS as PREEMPTED
from .preemption import Preempted

T = TypeVar("T")

Resume = bool | Literal["auto"]
"""a stage's `--resume`: alone (True), continue the run in --output-dir from its last checkpoint; `auto`, continue it
if it has one, else start it (a job that is requeued reruns the same command: `checkpoint.resolve_resume`)"""


class UserError(ValueError):
    """Bad input from the user: printed as one line naming the field and the fix, no traceback."""


def require(minimum: float, fields: dict[str, float], strictly: bool = True) -> None:
    """UserError naming the first field (`--name` as the command line spells it, value) that is not above
    `minimum` (or, with strictly=False, at least it); NaN is never."""
    for name, value in fields.items():
        if not (value > minimum if strictly else value >= minimum):
            raise UserError(f"--{name.replace('_', '-')} must be {'>' if strictly else '>='} {minimum:g}, got {value}")


def parse(
    args_type: type[T],
    defaults_for_task: Callable[[str], T],
    default_task: str,
    argv: list[str] | None = None,
    description: str | None = None,
    presets: Collection[str] = (),
) -> T:
    """`--task NAME` picks the preset whose values become the defaults; every other flag overrides them (`--recipe
    NAME`, for an args type with recipes, stands for its flags in its place: `expand_recipes`).
    `--help` names the command as the user types it (`command_of` the calling module), opens with `description`
    (default: the docstring of `args_type`) and lists `presets`, the names `--task` takes."""
    quiet_transformers()
    prog = command_of(sys._getframe(1).f_globals)
    argv = list(sys.argv[1:] if argv is None else argv)
    task = default_task
    for i, arg in enumerate(argv):
        if arg == "--task" and i + 1 < len(argv):
            task = argv[i + 1]
            del argv[i : i + 2]
            break
        if arg.startswith("--task="):
            task = arg.split("=", 1)[1]
            del argv[i]
            break
    argv = expand_recipes(args_type, spell_resume(args_type, argv))
    task_flag = f"--task {{{','.join(presets)}}}" if presets else "--task NAME"
    description = (
        f"{description or args_type.__doc__}\n\n`{task_flag}` (default: {default_task}) picks a preset whose values "
        "are the defaults below; any flag overrides them."
    )
    return tyro.cli(args_type, prog=prog, default=defaults_for_task(task), args=argv, description=description)


def expand_recipes(args_type: type, argv: list[str]) -> list[str]:
    """Each `--recipe NAME` followed, in its place, by the flags it stands for (`args_type.recipe_flags(NAME)`, for
    an args type that has recipes): they override the task's values and the flags before it, the flags after it
    override them."""
    recipe_flags = getattr(args_type, "recipe_flags", None)
    if recipe_flags is None:
        return argv
    expanded = []
    for i, arg in enumerate(argv):
        expanded.append(arg)
        if arg.startswith("--recipe="):
            expanded += recipe_flags(arg.split("=", 1)[1])
        elif i and argv[i - 1] == "--recipe":
            expanded += recipe_flags(arg)
    return expanded


def spell_resume(args_type: type, argv: list[str]) -> list[str]:
    """For an args type whose `resume` is a `Resume`, `--resume` with no value after it as `--resume True` and
    `--no-resume` as `--resume False`: tyro reads a flag that also takes `auto` only with a value, and command lines
    from before `auto` give none (a plain bool `--resume`, GRPO's, stays a flag)."""
    fields = {f.name: f.type for f in dataclasses.fields(args_type)}
    if fields.get("resume") != Resume:
        return argv
    spelled = []
    for i, arg in enumerate(argv):
        if arg == "--no-resume":
            spelled += ["--resume", "False"]
        elif arg == "--resume" and (i + 1 == len(argv) or argv[i + 1].startswith("-")):
            spelled += ["--resume", "True"]
        else:
            spelled.append(arg)
    return spelled


def command_of(module_globals: dict) -> str | None:
    """`python -m package.module` for the module whose globals these are (its import name, also when it runs as
    `__main__`); None for a script run by its path, whose command argparse already shows as the user typed it."""
    spec = module_globals.get("__spec__")
    if spec is None or not spec.name:
        return None
    return f"python -m {spec.name.removesuffix('.__main__')}"


def flag_given(argv: list[str], flag: str) -> bool:
    """Whether the user gave `flag` (`--flag VALUE` or `--flag=VALUE`): a quickstart picks a default only if not."""
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def split_passthrough(argv: list[str] | None = None) -> tuple[list[str], list[str]]:
    """A script's own flags, and the flags after `--` that it hands to the stage it runs."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        return argv, []
    return argv[: argv.index("--")], argv[argv.index("--") + 1 :]


def quiet_transformers() -> None:
    """Progress bars and notices drown the training log. Through the environment, which transformers
    reads when it is imported (so a process that never uses it, like grpo.launch, does not import it
    for this, and the processes it starts inherit the setting), and directly where it is imported."""
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # transformers' own bars follow huggingface_hub's switch
    if "transformers" in sys.modules:
        transformers = sys.modules["transformers"]
        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    elif "huggingface_hub" in sys.modules:  # it read the environment already
        sys.modules["huggingface_hub"].utils.disable_progress_bars()


def exit_finished_rank(status: int = 0) -> None:
    """End this process now with `status` if it is one rank of several (WORLD_SIZE > 1), without the interpreter's
    teardown; a stage script calls it once `main` has returned, and `main_with_user_errors` with `PREEMPTED` for a run
    a signal stopped. `main_with_user_errors` destroyed the process group, but the sharding engines' own threads
    (FSDP2's, DeepSpeed's) can still abort the teardown of a finished run ("terminate called without an active
    exception"), as GRPO's processes avoid with the same `exit_now`."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from lm_human_preference_details.grpo.lifetime import exit_now  # the standard library only

        exit_now(status)


def main_with_user_errors(main: Callable[[], None]) -> Callable[[], None]:
    """Run `main`; a UserError ends the process with `error: ...` on one line and exit status 2, a run stopped on a
    signal (`Preempted`, after its checkpoint) with its line (from the first process) and `PREEMPTED`.

    The process group of a multi-process run is destroyed before the interpreter exits: left to the
    interpreter's teardown, gloo can abort a finished run ("terminate called without an active exception").
    """

    @functools.wraps(main)
    def wrapped():
        preempted = False
        try:
            main()
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        except Preempted as e:
            if int(os.environ.get("RANK", "0")) == 0:
                print(e, file=sys.stderr, flush=True)
            preempted = True
        except KeyboardInterrupt:  # Ctrl-C: a run with checkpoints continues with --resume
            print("interrupted", file=sys.stderr)
            sys.exit(130)
        finally:
            torch = sys.modules.get("torch")  # a process that never imported torch has no group (nor imports it now)
            if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        if preempted:
            exit_finished_rank(PREEMPTED)
            sys.exit(PREEMPTED)

    return wrapped
