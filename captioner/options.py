"""Command lines derived from dataclasses: each option is declared once, as a typed field.

A field's type says what the option takes, `Annotated` its help and, where it differs from the
field's name, its flag:

    epochs: Annotated[int, "passes over the training captions"] = 30          # --epochs N
    baseline: Annotated[Literal["mean", "greedy"], "--scst-baseline", "..."] = "mean"
    hard: HardAttentionConfig = field(default_factory=HardAttentionConfig)    # its fields, flattened
    fine_tune: Annotated[FineTuneConfig | None, "--fine-tune-encoder", "..."] = None

`Literal` gives the choices; `bool` a switch (`--no-x` when the default is True); `list[str]`
one or more values; a field without a default a required option; a field without help text
no option at all (it is set by the program). A nested dataclass adds its own fields' options
under its docstring's first line; an optional one is switched on by its own flag, and its options
are refused without it.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from typing import Annotated, Any, Literal, Union

from captioner.errors import OptionError

NOT_GIVEN = None  # what argparse holds for an option left out; the dataclass default applies

# Every command's --device: a field `device: Device = "auto"`, checked by `check_device` as `from_args` reads it.
Device = Annotated[str, "auto (a GPU if there is one), cpu, cuda or cuda:N"]
DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def check_device(name: str) -> None:
    """Raises ValueError naming --device unless `name` is auto, cpu, cuda or cuda:N."""
    if not DEVICE.fullmatch(name):
        raise OptionError(f"--device: expected auto, cpu, cuda or cuda:N, got {name!r}")


def choose_device(name: str = "auto", local_rank: int = 0):
    """The device a command runs on (checked by `check_device`): "auto" → this process's GPU if there is
    one, else the CPU; cuda without a GPU is refused."""
    import torch  # here: the options of every command are read before torch is needed

    if name.startswith("cuda") and not torch.cuda.is_available():
        raise OptionError(f"--device {name}: no CUDA device is available here; use --device cpu")
    if name == "auto":
        return torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    return torch.device(f"cuda:{local_rank}" if name == "cuda" else name)


def check_positive(obj, *names: str) -> None:
    """Raises ValueError naming the first field of `names` that is set (not None) and not positive."""
    for name in names:
        value = getattr(obj, name)
        if value is not None and not value > 0:
            raise OptionError(f"--{name.replace('_', '-')} must be positive, got {value}")


def _parts(hint) -> tuple[Any, list[str], str]:
    """(bare type, flags, help) of an Annotated hint."""
    if typing.get_origin(hint) is not Annotated:
        return hint, [], ""
    bare, *extras = typing.get_args(hint)
    flags = [x for x in extras if isinstance(x, str) and x.startswith("--")]
    helps = [x for x in extras if isinstance(x, str) and not x.startswith("--")]
    return bare, flags, " ".join(helps)


def _optional(tp) -> tuple[Any, bool]:
    """(X, True) for `X | None`, else (tp, False)."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _fields(cls) -> list[tuple[dataclasses.Field, Any, list[str], str]]:
    hints = typing.get_type_hints(cls, include_extras=True)
    return [(f, *_parts(hints[f.name])) for f in dataclasses.fields(cls) if f.init]


def field_info(cls, name: str) -> tuple[Any, str, Any]:
    """(bare type, help, default) of the settings field `name`: what a form that sets it shows."""
    f, bare, _, text = next(x for x in _fields(cls) if x[0].name == name)
    return _optional(bare)[0], text, _default(f)


def add_options(
    parser: argparse.ArgumentParser,
    cls,
    *,
    skip: tuple[str, ...] = (),
    group: str | None = None,
    required_by: str | None = None,
    prefix: str = "",
    derived: dict[str, str] | None = None,
) -> None:
    """Add an option for every field of dataclass `cls` (nested dataclasses flattened). `prefix`: where in
    the namespace a nested dataclass's values go ("fine_tune."); `derived`: for fields whose default the
    program derives (None in the dataclass), the default the help states."""
    target = parser.add_argument_group(group) if group else parser
    for f, tp, flags, text in _fields(cls):
        tp, optional = _optional(tp)
        if f.name in skip or not (text or dataclasses.is_dataclass(tp)):
            continue
        flags = flags or [f"--{f.name.replace('_', '-')}"]
        if dataclasses.is_dataclass(tp):
            _add_nested(parser, target, f.name, tp, optional, flags[0], text, prefix=prefix, derived=derived)
            continue
        flags, kwargs = _argument(f, tp, optional, flags, text, prefix=prefix, required_by=required_by, derived=derived)
        target.add_argument(*flags, **kwargs)


def _add_nested(parser, target, name: str, tp, optional: bool, flag: str, text: str, *, prefix: str, derived) -> None:
    """The options of a nested dataclass field, in a help section of their own."""
    nested = f"{prefix}{name}."
    title = (tp.__doc__ or name).strip().splitlines()[0].split(";")[0].rstrip(".")
    if optional:  # switched on by its own flag; its fields follow
        target.add_argument(flag, dest=prefix + name, action="store_true", help=text)
        add_options(parser, tp, group=title, required_by=flag, prefix=nested, derived=derived)
    else:
        add_options(parser, tp, group=title, prefix=nested, derived=derived)


def _argument(
    f: dataclasses.Field, tp, optional: bool, flags: list[str], text: str, *, prefix: str, required_by, derived
) -> tuple[list[str], dict[str, Any]]:
    """The flags of a plain field's option, and `add_argument`'s keywords for it (its help included)."""
    default = _default(f)
    kwargs: dict[str, Any] = {"dest": prefix + f.name, "default": NOT_GIVEN, "metavar": f.name.upper()}
    shown = "" if default in (dataclasses.MISSING, None) else f" (default: {_shown(default)})"
    if default is None and f.name in (derived or {}):
        shown = f" (default: {derived[f.name]})"
    if required_by:
        shown += f"; with {required_by}"
    if tp is bool and optional:  # None: the program decides; --x / --no-x decide instead
        kwargs.update(action=argparse.BooleanOptionalAction)
        kwargs.pop("metavar")
        shown = shown if f.name in (derived or {}) else ""
    elif tp is bool:
        if default is True and not flags[0].startswith("--no-"):
            flags = [f"--no-{f.name.replace('_', '-')}"]
        kwargs.update(action="store_const", const=default is not True)
        kwargs.pop("metavar")
        shown = ""
    elif typing.get_origin(tp) is list:
        kwargs.update(nargs="+", type=typing.get_args(tp)[0])
    elif typing.get_origin(tp) is Literal:
        choices = typing.get_args(tp)
        kwargs.update(choices=choices, type=type(choices[0]))
        kwargs.pop("metavar")
    else:
        kwargs.update(type=tp)
    if default is dataclasses.MISSING:
        kwargs["required"] = True
    return flags, {"help": text + shown, **kwargs}


def _shown(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def from_args(cls, args: argparse.Namespace, *, skip: tuple[str, ...] = (), prefix: str = "", **fixed):
    """The dataclass `cls` from parsed options: given values, else the dataclass's defaults. Raises
    OptionError for an option of an optional nested dataclass given without its switch, or a bad --device."""
    values = dict(fixed)
    hints = typing.get_type_hints(cls, include_extras=True)
    for f, tp, flags, text in _fields(cls):
        tp, optional = _optional(tp)
        if f.name in skip or f.name in values or not (text or dataclasses.is_dataclass(tp)):
            continue
        if dataclasses.is_dataclass(tp):
            nested = f"{prefix}{f.name}."
            given = _given(tp, args, nested)
            if optional and not getattr(args, prefix + f.name, None):
                if given:
                    raise OptionError(f"{given[0]} needs {(flags or ['--' + f.name.replace('_', '-')])[0]}")
                values[f.name] = None
            else:
                values[f.name] = from_args(tp, args, prefix=nested)
            continue
        value = getattr(args, prefix + f.name, NOT_GIVEN)
        if value is not NOT_GIVEN:
            if hints[f.name] == Device:
                check_device(value)
            values[f.name] = value
    return cls(**values)


def _given(cls, args: argparse.Namespace, prefix: str) -> list[str]:
    out = []
    for f, _, flags, _ in _fields(cls):
        if getattr(args, prefix + f.name, NOT_GIVEN) is not NOT_GIVEN:
            out.append((flags or [f"--{f.name.replace('_', '-')}"])[0])
    return out


def command_line(obj) -> list[str]:
    """The options that give `obj` (a dataclass instance) from its class's defaults, as arguments."""
    args = []
    for f, tp, flags, text in _fields(type(obj)):
        tp, optional = _optional(tp)
        value, default = getattr(obj, f.name), _default(f)
        flag = (flags or [f"--{f.name.replace('_', '-')}"])[0]
        if dataclasses.is_dataclass(tp):
            if value is not None:
                args += ([flag] if optional else []) + command_line(value)
            continue
        if not text or value == default:
            continue
        if tp is bool and not optional:
            args.append(flag if default is not True or flag.startswith("--no-") else f"--no-{flag[2:]}")
        elif isinstance(value, list):
            args += [flag, *map(str, value)]
        elif value is not None:
            args += [flag, str(value)]
    return args
