"""Check a job's configuration before any process starts:
`python -m titan_draft.cli.validate --world-size N <job args>`.

Prints one line naming the key and the fix, and exits 2, for any setting that cannot work
(including unknown TOML keys, which torchtitan's parser rejects, and a missing or malformed config
file), and for a dump folder that another running job holds (titan_draft/infra/job_guard.py).
"""
import sys
import tomllib
import warnings

from titan_draft.config import ConfigError, parse_config, validate
from titan_draft.infra.job_guard import check_dump_folder


def check(argv: list[str], world_size: int):
    """The job's config (torchtitan's JobConfig) if it can work; else ConfigError."""
    check_config_file(argv)
    with warnings.catch_warnings():  # tyro's warning about a mistyped TOML value: validate() says it in one line
        warnings.simplefilter("ignore", UserWarning)
        cfg = parse_config(argv)
    validate(cfg, world_size)
    return cfg


def check_config_file(argv: list[str]) -> None:
    """A missing or malformed --job.config_file, in one line (torchtitan logs a traceback first)."""
    for i, arg in enumerate(argv):  # the first one, as torchtitan reads it
        key, has_value, value = arg.partition("=")
        if key in ("--job.config_file", "--job.config-file") and (has_value or i + 1 < len(argv)):
            path = value if has_value else argv[i + 1]
            break
    else:
        return
    try:
        with open(path, "rb") as f:
            tomllib.load(f)
    except OSError as err:
        raise ConfigError(f"job.config_file: cannot read {path} ({err.strerror})") from err
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"job.config_file: {path} is not valid TOML: {err}") from err


def main(argv: list[str]) -> int:
    world_size = 1
    if argv[:1] == ["--world-size"]:
        world_size, argv = int(argv[1]), argv[2:]
    try:
        check_dump_folder(check(argv, world_size).job.dump_folder)  # another job there: say so before starting
    except (ConfigError, ValueError, FileNotFoundError) as err:
        print("config error: " + " ".join(str(err).split()), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
