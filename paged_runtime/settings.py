"""The settings schema: each setting is declared once, as a field of a config dataclass, and every front end is
generated from those declarations.

A field declared with ``setting(default, help, ...)`` carries its type (the annotation), its default (or the
environment variable that backs it), its bounds or choices, its help, its other spellings (vLLM's, and
huggingfaceserver's for the KServe adapter) and the front ends that show it. From that:

- the dataclass checks every value in ``check_settings`` (its ``__post_init__`` calls it);
- ``add_arguments`` adds the argparse flags (``paged-runtime serve``, the KServe adapter), grouped as the
  fields say; flags hold no defaults (``argparse.SUPPRESS``): an absent flag leaves the field's own default;
- ``pydantic_fields`` gives the pydantic fields of Ray Serve's ``AppArgs`` (``serve run ... key=value``), which
  ``parse_text`` and ``check_values`` complete.

``from_source`` builds a config from whatever a front end parsed (a namespace, a pydantic model, a dict). This
module imports neither torch nor pydantic (pydantic only inside ``pydantic_fields``): the Ray ingress and the
CLI's ``--help`` use it without loading the runtime.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FRONT_ENDS = frozenset({"serve", "kserve", "ray"})  # LLM(...) takes every EngineConfig field as a keyword
_NO_DEFAULT = dataclasses.MISSING


@dataclass(frozen=True)
class Setting:
    """How one config field is offered and checked (the field itself holds the name and type)."""
    help: str
    default: Any = None  # the value when no environment variable (``env``) is set
    group: str = "engine"  # the --help section ("engine", "server", ...)
    choices: tuple[str, ...] | None = None
    ge: float | None = None  # bounds: value >= ge, value > gt, value <= le (None: unbounded)
    gt: float | None = None
    le: float | None = None
    env: tuple[str, ...] = ()  # environment variables backing the default, first set wins
    aliases: tuple[str, ...] = ()  # other flag spellings on every parser (vLLM's)
    hf_aliases: tuple[str, ...] = ()  # huggingfaceserver's spellings: the KServe adapter's parser only
    parse: Callable[[str], Any] | None = None  # text -> value, for flags, env variables and Ray's strings
    front_ends: frozenset[str] = FRONT_ENDS
    metavar: str | None = None
    secret: bool = False  # never shown (a key): --help names its variables instead of a value
    action: type[argparse.Action] | None = None  # a flag with its own way of collecting values


def setting(default: Any = None, help: str = "", **kwargs: Any) -> Any:
    """A config field: ``default`` (or the first of ``env`` that is set, read through ``parse``) and its
    ``Setting``. Use as ``name: type = setting(default, "help", ...)`` in a dataclass."""
    spec = Setting(help, default, **kwargs)
    metadata = {"setting": spec}
    if spec.env:
        return dataclasses.field(default_factory=lambda: env_default(spec), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def env_default(spec: Setting) -> Any:
    for name in spec.env:
        text = os.environ.get(name)
        if text:
            return spec.parse(text) if spec.parse else text
    return spec.default


def settings_of(cls: type) -> list[tuple[dataclasses.Field, Setting, Any]]:
    """(field, setting, type) of every declared setting of dataclass ``cls``, in declaration order."""
    hints = typing.get_type_hints(cls)
    return [(f, f.metadata["setting"], hints[f.name]) for f in dataclasses.fields(cls) if "setting" in f.metadata]


# ---- checking ----------------------------------------------------------------------------------------------
def check_value(name: str, spec: Setting, value: Any) -> None:
    """ValueError naming the setting where ``value`` is outside its choices or bounds (None passes: unset)."""
    if value is None:
        return
    if spec.choices is not None and value not in spec.choices:
        raise ValueError(f"{name} must be one of {', '.join(spec.choices)}; got {value!r}")
    if spec.ge is None and spec.gt is None and spec.le is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if (spec.ge is not None and not value >= spec.ge) or (spec.gt is not None and not value > spec.gt) or (
            spec.le is not None and not value <= spec.le):
        raise ValueError(f"{name} must be {bounds_text(spec)}, got {value}")


def bounds_text(spec: Setting) -> str:
    if spec.ge == 1 and spec.le is None:
        return "positive"
    if spec.ge == 0 and spec.le is None:
        return "non-negative"
    low = f"[{spec.ge:g}" if spec.ge is not None else f"({spec.gt:g}" if spec.gt is not None else "(-inf"
    return f"in {low}, {spec.le:g}]" if spec.le is not None else f"at least {spec.ge:g}" if spec.ge is not None \
        else f"greater than {spec.gt:g}"


def check_settings(config: Any) -> None:
    """Check every declared setting of dataclass instance ``config`` (its ``__post_init__`` calls this)."""
    for f, spec, _ in settings_of(type(config)):
        check_value(f.name, spec, getattr(config, f.name))


def from_source(cls: type, source: Any, **overrides: Any) -> Any:
    """``cls`` from any object whose attributes (or keys) carry its field names (parsed flags, an adapter's
    args, a dict); names it lacks keep their defaults, ``overrides`` win."""
    get = source.get if isinstance(source, dict) else lambda name, default: getattr(source, name, default)
    values = {f.name: v for f in dataclasses.fields(cls) if (v := get(f.name, _NO_DEFAULT)) is not _NO_DEFAULT}
    return cls(**(values | overrides))


# ---- argparse ----------------------------------------------------------------------------------------------
def _base(annotation: Any) -> tuple[Any, bool]:
    """(the type without None, whether None is allowed) of an annotation such as ``int | None``."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]), True
    return annotation, False


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _checked_parser(name: str, spec: Setting, parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse_flag(text: str) -> Any:
        try:
            value = parse(text)
            check_value(name, spec, value)
        except (TypeError, ValueError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return value
    parse_flag.__name__ = name  # argparse's "invalid <name> value" message
    return parse_flag


def _help(spec: Setting) -> str:
    if spec.secret:
        shown = "$" + ", else $".join(spec.env) if spec.env else "none"
    else:
        shown = repr(spec.default) if isinstance(spec.default, str) else str(spec.default)
        if spec.env:
            shown = f"${' or $'.join(spec.env)}, else {shown}"
    return f"{spec.help} (default: {shown})".replace("%", "%%")


def add_arguments(parser: argparse.ArgumentParser, classes: tuple[type, ...], front_end: str,
                  groups: dict[str, Any] | None = None) -> None:
    """Flags for every setting of ``classes`` that ``front_end`` shows, in argument groups by ``Setting.group``
    (``groups`` may hand in groups the caller made). An absent flag sets nothing: the field keeps its default."""
    groups = groups if groups is not None else {}
    for cls in classes:
        for f, spec, annotation in settings_of(cls):
            if front_end not in spec.front_ends:
                continue
            group = groups.get(spec.group) or groups.setdefault(spec.group, parser.add_argument_group(spec.group))
            names = [flag_name(f.name), *spec.aliases, *(spec.hf_aliases if front_end == "kserve" else ())]
            group.add_argument(*names, dest=f.name, default=argparse.SUPPRESS, help=_help(spec),
                               **_argparse_kind(f.name, spec, annotation))


def _argparse_kind(name: str, spec: Setting, annotation: Any) -> dict[str, Any]:
    base, _ = _base(_without_dataclasses(annotation))
    if spec.action is not None:
        return {"action": spec.action, "nargs": "+", "metavar": spec.metavar}
    if base is bool:
        return {"action": argparse.BooleanOptionalAction}
    kind: dict[str, Any] = {"metavar": spec.metavar}
    parse = spec.parse
    if typing.get_origin(base) is list:  # a flag takes the items; ``parse`` reads one text (env, Ray) as a list
        kind["nargs"] = "+"
        base, parse = typing.get_args(base)[0], None
    parse = parse or (base if base in (int, float) else str)  # a union (a dict or its JSON): the text
    if spec.choices is not None:
        kind["choices"] = spec.choices  # argparse lists them in --help and in its error
        kind["type"] = parse
    else:
        kind["type"] = _checked_parser(name, spec, parse)
    return kind


# ---- pydantic (Ray Serve's AppArgs) ------------------------------------------------------------------------
def pydantic_fields(classes: tuple[type, ...], front_end: str = "ray") -> dict[str, tuple[Any, Any]]:
    """``create_model`` field definitions for every setting of ``classes`` that ``front_end`` shows, each
    typed as declared and defaulting to the field's default. ``parse_text`` and ``check_values`` complete them
    (a model validator before and after pydantic's own)."""
    from pydantic import Field
    fields: dict[str, tuple[Any, Any]] = {}
    for cls in classes:
        for f, spec, annotation in settings_of(cls):
            if front_end in spec.front_ends:
                # An environment-backed default is read when a model is made, as the dataclass reads it
                field = Field(default_factory=lambda spec=spec: env_default(spec), description=spec.help) \
                    if spec.env else Field(default=spec.default, description=spec.help)
                fields[f.name] = (_wire_type(spec, annotation), field)
    return fields


def _wire_type(spec: Setting, annotation: Any) -> Any:
    """What a front end passes: the declared type without config objects it builds itself, plus text where a
    parse function reads it ("2GiB") and one string for a list."""
    base, optional = _base(_without_dataclasses(annotation))
    if spec.parse is not None and base is not str or typing.get_origin(base) is list:
        base = base | str
    return base | None if optional else base


def _without_dataclasses(annotation: Any) -> Any:
    """``SpeculativeConfig | dict | str | None`` -> ``dict | str | None``: a front end passes the text or dict."""
    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return annotation
    kept = [a for a in typing.get_args(annotation) if not dataclasses.is_dataclass(a)]
    return typing.Union[tuple(kept)] if len(kept) > 1 else kept[0]


def _specs(classes: tuple[type, ...], front_end: str) -> dict[str, Setting]:
    return {f.name: spec for cls in classes for f, spec, _ in settings_of(cls) if front_end in spec.front_ends}


def parse_text(classes: tuple[type, ...], values: Any, front_end: str = "ray") -> Any:
    """``values`` (a dict of raw inputs) with each string of a setting that has a parse function parsed."""
    if not isinstance(values, dict):
        return values
    specs = _specs(classes, front_end)
    return {name: specs[name].parse(v) if name in specs and specs[name].parse and isinstance(v, str) else v
            for name, v in values.items()}


def check_values(classes: tuple[type, ...], model: Any, front_end: str = "ray") -> None:
    """Check each setting's value on ``model`` against its choices and bounds (ValueError naming it)."""
    for name, spec in _specs(classes, front_end).items():
        check_value(name, spec, getattr(model, name))


# ---- how text becomes a value ------------------------------------------------------------------------------
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """'2147483648', '2G', '2GiB', '512MiB' -> bytes (K/M/G/T are powers of 1024, as vLLM's --kv-cache-memory)."""
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"expected a byte count such as 2147483648, 512MiB or 2GiB, got {text!r}")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * 1024 ** " kmgt".index(unit or " "))


def json_object(value: dict[str, Any] | str, name: str, known: typing.Iterable[str]) -> dict[str, Any]:
    """A setting given as a JSON object (``--speculative-config``, ``--kv-events-config``): its text or a dict,
    as a new dict; a ValueError naming ``name`` for bad JSON, another type, or a key outside ``known``."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be an object, got {type(value).__name__}")
    unknown = set(value) - set(known)
    if unknown:
        raise ValueError(f"{name} has unknown keys {sorted(unknown)}; its keys are {list(known)}")
    return dict(value)


def parse_words(text: str) -> list[str]:
    """'a b', 'a,b' -> ['a', 'b']: a list given as one text (an environment variable, a Ray argument)."""
    return [word for word in re.split(r"[\s,]+", text) if word]


def parse_switch(text: str) -> bool:
    """A switch given as text (an environment variable, a Ray argument): 0, false, no or off (any case) is off,
    any other text on."""
    return text.strip().lower() not in ("0", "false", "no", "off")


def read_chat_template(text: str) -> str:
    """A chat template: a file's contents, or the text itself when it is a Jinja template (as vLLM)."""
    path = Path(text).expanduser()
    if path.is_file():
        return path.read_text()
    if any(c in text for c in "{}\n"):
        return text
    raise ValueError(f"{text!r} is neither a readable file nor a Jinja template")


class CollectPaths(argparse.Action):
    """``--model A --model B`` (or ``--model A B``): every path given, in order (several models, one server)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest, None) or []), *values])


class ExtendOrigins(argparse.Action):
    """``--allowed-origins A B`` or vLLM's ``--allowed-origins '["A", "B"]'``: one flat list of origins."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        origins = []
        for value in values:
            if value.lstrip().startswith("["):
                try:
                    parsed = json.loads(value)
                except ValueError:
                    parsed = None
                if not isinstance(parsed, list) or not all(isinstance(o, str) for o in parsed):
                    parser.error(f"{option_string}: {value!r} is not a JSON list of origins")
                origins += parsed
            else:
                origins.append(value)
        setattr(namespace, self.dest, origins)
