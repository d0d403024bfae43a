"""The command line: a recipe's settings as `--section.field value` through tyro, and the
tools' own flags through `OneLineParser` (argparse); either way a mistake is one `error:` line.

Settings: tyro parses them over `config.JobConfig` with the recipe's values as the defaults (the
trainer, and the tools that take recipe settings: memory_report.py as given, plan.py and
bench.py through --set); a value it refuses, an unknown name (with the closest valid one) and a
number out of its `Range` are one `ConfigError` each. tyro 1.0.17 reports a refused value only
as the text it prints before `SystemExit(2)`; `_tyro_error` reads the message back out of it
(docs/design.md says which cases and why).

Tools' flags: argparse's default error prints a usage block of several lines before the error;
`--help` still prints the whole usage. argparse takes an argument that starts with '-' for an
option unless it looks like a negative number, and its idea of a number is narrow ('-5' and
'-.5'; Python 3.14 adds '-1e-3' and '-1_000'): '--device-memory -5GiB' was refused as
"expected one argument". Here a value that starts with '-' and a digit (or '-.' and a digit)
given after an option that takes one is handed to argparse joined to it, as
'--device-memory=-5GiB', so it reaches the check that can say what is wrong with it.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import difflib
import io
import os
import re
import sys
from collections.abc import Callable

import tyro
from tyro.constructors import ConstructorRegistry, PrimitiveConstructorSpec

from hybrid2d import config
from hybrid2d.errors import ConfigError
from hybrid2d.sizes import parse_size, unit_of

# ---- settings: tyro over JobConfig ------------------------------------------------------------

_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")
_REGISTRY = ConstructorRegistry()


@_REGISTRY.primitive_rule
def _bool_rule(info) -> PrimitiveConstructorSpec | None:
    """Booleans take true/false in any case (and yes/no, on/off, 1/0); a bare flag is true.
    (tyro's own rule takes only True and False, and makes a bare flag an error.)"""
    if info.type is not bool:
        return None

    def parse(args: list[str]) -> bool:
        text = args[0].lower() if args else "true"
        if text not in _TRUE + _FALSE:
            raise ValueError(f"{args[0]!r} is not true or false")
        return text in _TRUE

    return PrimitiveConstructorSpec(
        nargs=(0, 1),
        metavar="{true,false}",
        instance_from_str=parse,
        is_instance=lambda x: isinstance(x, bool),
        str_from_instance=lambda x: [str(x)],
    )


def _number_rule(kind: type, word: str):
    """Numbers whose refusal reads as one: `'abc' is not a whole number` rather than Python's
    `invalid literal for int() with base 10`. Whole numbers may be written 1e3."""

    def rule(info) -> PrimitiveConstructorSpec | None:
        if info.type is not kind:
            return None

        def parse(args: list[str]):
            try:
                value = float(args[0])
            except ValueError:
                raise ValueError(f"{args[0]!r} is not {word}") from None
            if kind is int:
                if not value.is_integer():
                    raise ValueError(f"{args[0]!r} is not {word}")
                return int(args[0]) if args[0].lstrip("+-").isdigit() else int(value)
            return value

        return PrimitiveConstructorSpec(
            nargs=1,
            metavar=kind.__name__.upper(),
            instance_from_str=parse,
            is_instance=lambda x: isinstance(x, kind) and not isinstance(x, bool),
            str_from_instance=lambda x: [str(x)],
        )

    return rule


_REGISTRY.primitive_rule(_number_rule(int, "a whole number"))
_REGISTRY.primitive_rule(_number_rule(float, "a number"))


def _cli(cfg: config.JobConfig, args: list[str], **kwargs):
    """tyro over config.JobConfig with cfg's values as the defaults."""
    return tyro.cli(
        config.JobConfig,
        args=args,
        default=cfg,
        use_underscores=True,
        config=(tyro.conf.FlagConversionOff,),
        registry=_REGISTRY,
        **kwargs,
    )


def _tyro_error(text: str) -> str:
    """The message of tyro's error output as one line: the text between its title line and the
    next rule or blank line (framed on a terminal, plain otherwise; the help after it is left
    out)."""
    body: list[str] = []
    for line in text.strip().splitlines()[1:]:
        line = line.strip(" │╭╮╰╯")
        if set(line) <= {"─", "-"}:  # a rule or a blank line: the message ends after one
            if body:
                break
            continue
        body.append(line)
    message = " ".join(" ".join(body).split()) or "the command line could not be parsed"
    return message.removeprefix("Error parsing ")


def apply_overrides(cfg: config.JobConfig, args: list[str]) -> set[str]:
    """Apply `--section.field value` pairs (or `--section.field=value`) to cfg in place.

    tyro parses them; a value it refuses, an unknown name (with the closest valid one) and a
    number out of its range are one ConfigError line each. Returns the dotted names set.
    """
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            parsed, unknown = _cli(cfg, list(args), add_help=False, return_unknown_args=True)
    except SystemExit:
        raise ConfigError(_choice_error(_tyro_error(err.getvalue() + out.getvalue()))) from None
    if unknown:
        raise _unknown(unknown[0])
    flags = [a for a in args if a.startswith("--") and a != "--"]  # "--": end of the flags
    names = {a[2:].partition("=")[0].replace("-", "_") for a in flags}
    for name in names:
        section, _, key = name.rpartition(".")
        value = getattr(getattr(parsed, section) if section else parsed, key)
        config.check_range(name, value)
        setattr(getattr(cfg, section) if section else cfg, key, value)
    return names


def _choice_error(message: str) -> str:
    """tyro's refusal of a Literal choice, in the form of the other errors and with the closest
    valid choice: "--parallel.activation_checkpoint: 'fulll' is not one of none, full,
    selective; did you mean full?"."""
    match = re.fullmatch(
        r"invalid choice '(.*)' for argument '(--[\w.]+)'\. Expected one of \((.*)\)\.?", message
    )
    if not match:
        return message
    value, flag, listed = match.groups()
    choices = [c.strip().strip("'\"") for c in listed.split(",") if c.strip()]
    close = difflib.get_close_matches(value, choices, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]}?" if close else ""
    return f"{flag}: {value!r} is not one of {', '.join(choices)}{hint}"


def _unknown(arg: str) -> ConfigError:
    """The error for the first argument tyro did not know."""
    if not arg.startswith("--") or arg == "--":
        return ConfigError(f"unexpected argument {arg!r}; settings look like --train.steps 50")
    key = arg[2:].partition("=")[0].replace("-", "_")
    if key in config.RETIRED_KEYS:
        return ConfigError(
            f"--{key} was removed (hybrid2d now always does what it enabled); drop it"
        )
    close = config.closest(key, config.setting_names())
    return ConfigError(
        f"unknown setting --{key}; "
        + (f"did you mean --{close}?" if close else "--help lists the settings")
    )


def print_help(
    cfg: config.JobConfig, prog: str | None = None, description: str | None = None
) -> None:
    """tyro's --help for every setting, with its help text and cfg's value as the default."""
    with contextlib.suppress(SystemExit):
        _cli(cfg, ["--help"], prog=prog, description=description)


def describe(cfg: config.JobConfig) -> str:
    """Every setting with its current value, one per line (for --help-config)."""
    return "\n".join(
        f"--{n} {getattr(o, f.name)!r}" for n, (o, f) in config.leaf_fields(cfg).items()
    )


# ---- an entry point's own flags: argparse, one error line ------------------------------------


# A value that argparse would take for an option: '-' then a digit, or '-.' then a digit.
_DASHED_VALUE = re.compile(r"-\.?\d")


class OneLineParser(argparse.ArgumentParser):
    """Bad arguments: one `error: <what>` line on stderr and exit 2 (or, with
    raise_config_error, a ConfigError of that line for a caller that prints errors on rank 0
    only: the recipe). `hint` is added to every error, after a semicolon."""

    def __init__(self, *args, hint: str = "", raise_config_error: bool = False, **kwargs):
        self.options: dict[str, argparse.Action] = {}  # option string -> its action
        self.hint = hint
        self.raise_config_error = raise_config_error
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        self.options.update(dict.fromkeys(action.option_strings, action))
        return action

    def parse_known_args(self, args=None, namespace=None):
        given = list(sys.argv[1:] if args is None else args)
        joined: list[str] = []
        for arg in given:
            previous = self.options.get(joined[-1]) if joined else None
            if previous is not None and previous.nargs != 0 and _DASHED_VALUE.match(arg):
                joined[-1] = f"{joined[-1]}={arg}"  # argparse takes '--flag=-5GiB' as a value
            else:
                joined.append(arg)
        return super().parse_known_args(joined, namespace)

    def error(self, message: str):
        setting = re.search(r"--(\w+\.\w+)(?:=(\S+)|\s+(\S+))?", message)
        if message.startswith("unrecognized") and setting and "--set" in self.options:
            # A trainer setting typed as in recipes/llama.py: say how this tool takes it.
            value = setting.group(2) or setting.group(3) or "VALUE"
            message += f"; this tool takes recipe settings as --set {setting.group(1)}={value}"
        if self.hint:
            message += f"; {self.hint}"
        if self.raise_config_error:
            raise ConfigError(message)
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


def positive_size(text: str, flag: str, bare_bytes: bool = False) -> int:
    """Bytes that `text`, given to `flag` (e.g. '--device-memory'), names; a ConfigError naming
    the flag when it is no size, a negative or zero one, or a number without a unit ('24' was
    read as 24 bytes where 24GiB was meant). `bare_bytes`: a flag documented to take bytes as a
    bare number, as Hugging Face's max_shard_size does."""
    body = text.strip()
    negative = body.startswith("-")
    try:
        value = parse_size(body[1:] if negative else body, flag, minimum=0)
    except ConfigError:
        parse_size(text, flag)  # raises, naming the text as given
        raise
    if negative or value < 1:
        raise ConfigError(f"{flag}: {text!r} is not a positive size (e.g. 80GiB, 80GB)")
    if not bare_bytes and unit_of(body) == "":
        raise ConfigError(
            f"{flag} {text!r} has no unit: say {body}GiB ({body} x 2^30 bytes) or {body}GB "
            f"({body} x 10^9)"
        )
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
