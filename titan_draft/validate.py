"""Check a job's configuration before any process starts: `python -m titan_draft.validate --world-size N <job args>`.

Prints one line naming the key and the fix, and exits 2, for any setting that cannot work
(including unknown TOML keys, which torchtitan's parser rejects).
"""
import sys

from titan_draft import _compat  # noqa: F401  (before torchtitan)
from titan_draft.config import ConfigError, parse_config, validate


def check(argv: list[str], world_size: int) -> None:
    validate(parse_config(argv), world_size)


def main(argv: list[str]) -> int:
    world_size = 1
    if argv[:1] == ["--world-size"]:
        world_size, argv = int(argv[1]), argv[2:]
    try:
        check(argv, world_size)
    except (ConfigError, ValueError, FileNotFoundError) as err:
        print("config error: " + " ".join(str(err).split()), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
