"""What the tools' command lines share: a bad argument is one `error:` line and exit code 2, and
sizes given to them must be positive.

argparse's default error prints a usage block of several lines before the error; `--help` still
prints the whole usage. argparse takes an argument that starts with '-' for an option unless it
looks like a negative number, and its idea of a number is narrow ('-5' and '-.5'; Python 3.14
adds '-1e-3' and '-1_000'): '--device-memory -5GiB' was refused as "expected one argument". Here
every argument that starts with '-' and a digit (or '-.' and a digit) is a value (no tool has an
option spelt like that), so it reaches the check that can say what is wrong with it.
"""

from __future__ import annotations

import argparse
import atexit
import os
import re
import sys
from collections.abc import Callable

from hybrid2d.errors import ConfigError
from hybrid2d.sizes import parse_size


class OneLineParser(argparse.ArgumentParser):
    """Bad arguments: one `error: <what>` line on stderr and exit 2."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"-\.?\d")  # argparse: "looks like a number"

    def error(self, message: str):
        setting = re.search(r"--(\w+\.\w+)(?:=(\S+)|\s+(\S+))?", message)
        takes_set = "--set" in self._option_string_actions
        if message.startswith("unrecognized") and setting and takes_set:
            # A trainer setting typed as in recipes/llama.py: say how this tool takes it.
            value = setting.group(2) or setting.group(3) or "VALUE"
            message += f"; this tool takes recipe settings as --set {setting.group(1)}={value}"
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


def positive_size(text: str, flag: str) -> int:
    """Bytes that `text`, given to `flag` (e.g. '--device-memory'), names; a ConfigError naming
    the flag when it is no size, or a negative or zero one."""
    body = text.strip()
    negative = body.startswith("-")
    try:
        value = parse_size(body[1:] if negative else body, flag, minimum=0)
    except ConfigError:
        parse_size(text, flag)  # raises, naming the text as given
        raise
    if negative or value < 1:
        raise ConfigError(f"{flag}: {text!r} is not a positive size (e.g. 80GiB, 80GB)")
    return value


def run_and_exit(main: Callable[[], int]) -> None:
    """sys.exit(main()), without the interpreter's teardown: freeing torch's modules and C++
    state takes about 1 s per process (0.9 s after `import torch` alone, on a loaded 2-core
    host) and does nothing for a command that has finished: main has closed its files, writers
    and process group. Call it before torch is imported: the exit handler registered here then
    runs after every handler registered later (atexit is last in, first out), torch's included,
    and non-daemon threads have been joined before any of them. An uncaught exception still
    prints its traceback and exits 1."""
    status = [1]

    def leave() -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe: nothing left to say
                pass
        os._exit(status[0])

    atexit.register(leave)
    try:
        code = main()
        status[0] = 0 if code is None else code
    except SystemExit as e:
        status[0] = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        raise
    except KeyboardInterrupt:
        status[0] = 130
        raise
