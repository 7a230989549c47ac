"""Build a service's config dataclass from CLI flags and ``KVMESH_*`` environment variables.

One convention for every service: field ``nats_url`` <-> flag ``--nats-url`` <-> env
``KVMESH_NATS_URL``. Precedence: flag > env > dataclass default. Supported field types: ``int``,
``float``, ``bool`` (``--x/--no-x``; env ``1/true/yes/on`` or ``0/false/no/off``), ``str``,
``Literal[...]`` of str (choices), ``X | None`` of those (env/flag value ``none`` or empty -> None)
and ``tuple[X, ...]`` (comma-separated). Help text and choices may also come from field metadata:
``field(default=..., metadata={"help": "...", "choices": (...)})`` (or the ``option`` helper).

Validation stays in the dataclass's ``__post_init__`` (``check_positive`` and ``check_at_least``
word the common bounds alike); its ValueError becomes a ConfigError that names the service
config, so a user sees which flag or variable to fix.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, TypeVar

ENV_PREFIX = "KVMESH_"
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"

C = TypeVar("C")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class ConfigError(ValueError):
    """A flag or KVMESH_* variable that does not make a valid service config."""


def option(
    default: Any = dataclasses.MISSING,
    *,
    help: str = "",
    choices: Iterable[str] = (),
    secret: bool = False,
):
    """A dataclass field with help text and (optional) choices for its flag. A ``secret`` field
    (a key, a password) is left out of the config's repr, so logs never show it."""
    metadata = {"help": help, "choices": tuple(choices)}
    if isinstance(default, list | dict | set):
        raise TypeError("use a tuple for sequence defaults (configs are frozen)")
    return dataclasses.field(default=default, metadata=metadata, repr=not secret)


def check_worker_id(worker_id: str | None) -> None:
    """A worker id names NATS subjects (``kvmesh.<mesh>.decode.<id>.reserve``): one non-empty token."""
    if worker_id is not None and (not worker_id or any(c in worker_id for c in ". *>")):
        raise ValueError(
            f"worker_id {worker_id!r} must be a non-empty NATS subject token (no '.', ' ', '*', '>')"
        )


def check_positive(config: object, *names: str) -> None:
    """Raise a ValueError naming the first of the fields ``names`` of ``config`` that is not
    above 0 (a field left None passes: it is unset)."""
    for name in names:
        value = getattr(config, name)
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be positive, got {value}")


def check_at_least(config: object, minimum: int, *names: str) -> None:
    """Raise a ValueError naming the first of the fields ``names`` of ``config`` below
    ``minimum`` (a field left None passes: it is unset)."""
    for name in names:
        value = getattr(config, name)
        if value is not None and not value >= minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def env_key(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def known_env_keys(cls: type) -> set[str]:
    """Every KVMESH_* variable ``config_from_args(cls, ...)`` reads."""
    return {env_key(f.name) for f in _config_fields(cls)}


def unknown_env_keys(
    cls: type, env: Mapping[str, str], *, also_known: Iterable[str] = ()
) -> list[str]:
    """KVMESH_* variables in ``env`` that ``cls`` does not read (typos, another service's keys)."""
    known = known_env_keys(cls) | set(also_known)
    return sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in known)


def add_config_arguments(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    exclude: Iterable[str] = (),
    groups: Sequence[tuple[str, Sequence[str]]] = (),
) -> None:
    """Add one flag per field of ``cls``. Defaults are SUPPRESSed so env and defaults apply later.

    Each flag's help ends with its default, once: the field's value unless its help text says
    the default itself (or there is none to show), and its ``KVMESH_*`` variable. ``groups``
    titles the flags in ``--help`` (``(title, field names)``, in order); fields left out of them
    follow under one group of their own."""
    excluded = set(exclude)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in _config_fields(cls) if f.name not in excluded}
    grouped = [name for _, names in groups for name in names]
    unknown = sorted(set(grouped) - set(fields))
    if unknown or len(set(grouped)) != len(grouped):
        raise ValueError(f"{cls.__name__}: flag groups name {unknown or 'a field twice'}")
    rest = [name for name in fields if name not in grouped]
    titled = [*groups, *([("options", rest)] if groups else [])]
    for title, names in titled or [(f"{cls.__name__} (env: {ENV_PREFIX}<FIELD>)", rest)]:
        group = parser.add_argument_group(title)
        for name in names:
            _add_flag(group, fields[name], hints[name])


def _add_flag(group: Any, f: dataclasses.Field, tp: Any) -> None:
    base, _ = _unwrap_optional(tp)
    choices = _choices(f, base)
    help_text = f.metadata.get("help", "")
    shown = "; ".join(filter(None, (_default_text(f, help_text), f"env {env_key(f.name)}")))
    help_text = f"{help_text} ({shown})" if help_text else f"({shown})"
    if base is bool:
        group.add_argument(
            flag_name(f.name),
            dest=f.name,
            action=argparse.BooleanOptionalAction,
            default=argparse.SUPPRESS,
            help=help_text,
        )
        return
    group.add_argument(
        flag_name(f.name),
        dest=f.name,
        default=argparse.SUPPRESS,
        metavar=_metavar(f.name, base, choices),
        help=help_text,
    )


def _default_text(f: dataclasses.Field, help_text: str) -> str:
    """``default: X`` for a flag's help, or "" where its help says the default itself or there
    is none (None, an empty tuple)."""
    if "default:" in help_text:
        return ""
    default = _default_of(f)
    if default is None or default == ():
        return ""
    if isinstance(default, bool):
        return f"default: {'on' if default else 'off'}"
    if isinstance(default, tuple):
        return "default: " + ",".join(map(str, default))
    return f"default: {default}"


def config_from_args(
    cls: type[C],
    args: argparse.Namespace | None = None,
    env: Mapping[str, str] | None = None,
    **overrides: Any,
) -> C:
    """Build ``cls`` from parsed flags (strings, as added by add_config_arguments), env and defaults.

    ``overrides`` win over everything (e.g. ``mode="colocated"`` for ``serve colocated``).
    """
    env = os.environ if env is None else env
    given = vars(args) if args is not None else {}
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in _config_fields(cls):
        if f.name in overrides:
            kwargs[f.name] = overrides[f.name]
            continue
        if f.name in given:
            raw, source = given[f.name], flag_name(f.name)
        elif env_key(f.name) in env:
            raw, source = env[env_key(f.name)], env_key(f.name)
        else:
            continue
        kwargs[f.name] = _convert(raw, hints[f.name], f, source)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{cls.__name__}: {exc}") from None


def command_config(cls: type[C], args: argparse.Namespace, command: str) -> C | None:
    """``config_from_args(cls, args)`` for the CLI command ``command`` (e.g. "kvmesh up"): a
    ConfigError is printed to stderr as ``<command>: <error>`` and gives None (the command then
    exits 2, as for a bad flag)."""
    try:
        return config_from_args(cls, args)
    except ConfigError as exc:
        print(f"{command}: {exc}", file=sys.stderr)
        return None


def config_to_argv(config: Any, *, only_changed: bool = True) -> list[str]:
    """The flags that rebuild ``config`` (used by ``kvmesh up`` to start child processes)."""
    argv: list[str] = []
    hints = typing.get_type_hints(type(config))
    for f in _config_fields(type(config)):
        value = getattr(config, f.name)
        if only_changed and f.default is not dataclasses.MISSING and value == f.default:
            continue
        base, _ = _unwrap_optional(hints[f.name])
        if base is bool:
            argv.append(flag_name(f.name) if value else "--no-" + f.name.replace("_", "-"))
        elif value is None:
            argv += [flag_name(f.name), "none"]
        elif isinstance(value, tuple):
            argv += [flag_name(f.name), ",".join(str(v) for v in value)]
        else:
            argv += [flag_name(f.name), str(value)]
    return argv


# --- internals --------------------------------------------------------------------------------


def _config_fields(cls: type) -> tuple[dataclasses.Field, ...]:
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    return tuple(f for f in dataclasses.fields(cls) if f.init)


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return "required"


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
        raise TypeError(f"unsupported config field type {tp}")
    return tp, False


def _choices(f: dataclasses.Field, base: Any) -> tuple[str, ...]:
    if typing.get_origin(base) is Literal:
        return tuple(str(a) for a in typing.get_args(base))
    return tuple(f.metadata.get("choices", ()))


def _metavar(name: str, base: Any, choices: tuple[str, ...]) -> str:
    if choices:
        return "{" + ",".join(choices) + "}"
    if typing.get_origin(base) is tuple:
        return name.upper() + "[,...]"
    return name.upper()


def _convert(raw: Any, tp: Any, f: dataclasses.Field, source: str) -> Any:
    base, optional = _unwrap_optional(tp)
    if not isinstance(raw, str):  # bool flags arrive as bools from BooleanOptionalAction
        return raw
    text = raw.strip()
    if optional and text.lower() in ("", "none", "null"):
        return None
    if typing.get_origin(base) is tuple:
        item_tp = typing.get_args(base)[0]
        items = [s.strip() for s in text.split(",") if s.strip()]
        return tuple(_scalar(s, item_tp, (), source) for s in items)
    return _scalar(text, base, _choices(f, base), source)


def _scalar(text: str, tp: Any, choices: tuple[str, ...], source: str) -> Any:
    if choices and text not in choices:
        raise ConfigError(f"{source}={text!r}: expected one of {', '.join(choices)}")
    if typing.get_origin(tp) is Literal:
        return text
    if tp is bool:
        low = text.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ConfigError(
            f"{source}={text!r}: expected a boolean (1/0, true/false, yes/no, on/off)"
        )
    if tp in (int, float):
        try:
            return tp(text)
        except ValueError:
            raise ConfigError(f"{source}={text!r}: expected {tp.__name__}") from None
    if tp is str:
        return text
    raise TypeError(f"unsupported config field type {tp} ({source})")
