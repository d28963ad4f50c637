"""Print the installed versions of this project's dependencies, transitively, for `.ci/constraints.txt`.

    python .ci/freeze.py > .ci/constraints.txt    # after the suite passed with what is installed

CI installs with these pins, so a new release of a dependency cannot break main between two sessions;
refreshing them is a deliberate commit. Only the dependency closure of the extras CI installs is
listed (not whatever else this machine has), with local version labels dropped (torch's `+cpu`).
"""

from importlib import metadata

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# the extras tests/run.sh installs
PROJECT, EXTRAS = "lm-human-preference-details", {"test", "offline", "grpo", "oai", "shard"}


def applies(requirement: Requirement, extras: set[str]) -> bool:
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate({**default_environment(), "extra": extra}) for extra in extras | {""})


def closure() -> dict[str, str]:
    versions: dict[str, str] = {}
    extras_seen: dict[str, set[str]] = {}
    todo = [(PROJECT, EXTRAS)]
    while todo:
        name, extras = todo.pop()
        distribution = metadata.distribution(name)  # not installed: this environment is not CI's
        key = canonicalize_name(distribution.metadata["Name"])
        if key in extras_seen and extras <= extras_seen[key]:
            continue
        extras_seen.setdefault(key, set()).update(extras)
        versions[key] = distribution.version.split("+")[0]
        todo += [(r.name, set(r.extras)) for r in map(Requirement, distribution.requires or []) if applies(r, extras)]
    versions.pop(canonicalize_name(PROJECT))
    return versions


if __name__ == "__main__":
    print("# made by `python .ci/freeze.py > .ci/constraints.txt` (see that script); CI installs with these pins")
    for name, version in sorted(closure().items()):
        print(f"{name}=={version}")
