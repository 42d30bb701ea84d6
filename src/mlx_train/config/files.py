"""The YAML layout of a config: sections of keys in, ``file:line`` errors out, sections back.

Which key of which section sets which field comes from the fields' ``Option`` (``section``,
``key``, ``aliases``, ``other_keys``); nothing here names a field.

Example::

    values = read("custom.yaml", options(TrainConfig), SECTIONS)   # {"epochs": 100, ...}, checked
    write("out.yaml", {"training": {"epochs": 3}}, "a header line")
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from collections.abc import Callable, Mapping
from typing import Any, cast

import yaml

from mlx_train.config.options import Deferred, Invalid, Option, convert, default_of, first_problem, resolve
from mlx_train.errors import ConfigError, did_you_mean

Fields = Mapping[str, dataclasses.Field[Any]]
# section -> {key: (field name, converter of the key's value or None)}
Routes = dict[str, dict[str, tuple[str, Callable[[Any], Any] | None]]]
# Rewrites the keys of another tool's files (mlx_lm.lora's) into field keys: (data, lines, source) -> data.
Dialect = Callable[[Mapping[str, Any], dict[tuple[Any, ...], int], str], dict[str, Any]]
# Other defaults than the fields', given the values a file sets: values -> {field: default}.
Defaults = Callable[[Mapping[str, Any]], Mapping[str, Any]]


def _spec(f: dataclasses.Field[Any]) -> Option:
    return cast(Option, f.metadata["option"])


def routes(fields: Fields, sections: tuple[str, ...]) -> Routes:
    """The keys each section accepts. A field is read in its own section under its name, its
    ``key`` and its aliases; ``training`` also takes every field name and alias (the seed schema
    puts batch_size and learning_rate there)."""
    table: Routes = {section: {} for section in sections}
    for name, f in fields.items():
        spec = _spec(f)
        own = {name: None, spec.key or name: None, **spec.aliases}
        table[spec.section].update({key: (name, convert_) for key, convert_ in own.items()})
        table["training"].update({key: (name, convert_) for key, convert_ in own.items() if key != spec.key})
    return table


def read(path: str | os.PathLike[str], fields: Fields, sections: tuple[str, ...], dialect: Dialect | None = None,
         defer: bool = False, defaults: Defaults | None = None) -> dict[str, Any]:
    """The checked field values a YAML file sets; an empty file sets none (``build`` says what
    ``dialect`` and ``defer`` do)."""
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as file:
            text = file.read()
    except OSError as error:
        raise ConfigError(f"cannot read config file {source}: {error.strerror or error}") from None
    data, lines = _parse(text, source, sections)
    return build(data, source, lines, fields, sections, dialect, defer, defaults)


class ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader that also reads ``1e-4`` (an exponent without a dot) as a float, as
    mlx_lm.lora's loader does (plain YAML 1.1 reads it as a string). A subclass, so parsing never
    depends on whether some other module changed ``yaml.SafeLoader`` itself.

    Example: ``yaml.load("lr: 1e-4", Loader=ConfigLoader)  # {'lr': 0.0001}``
    """


ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_yaml(text: str) -> Any:
    """``text`` parsed with ``ConfigLoader`` (what config files and ``--set`` values are read with)."""
    return yaml.load(text, Loader=ConfigLoader)  # noqa: S506 - a SafeLoader subclass


def _where(source: str, line: int | None) -> str:
    return f"{source}:{line}" if line else source


def _parse(text: str, source: str, sections: tuple[str, ...]) -> tuple[Any, dict[tuple[Any, ...], int]]:
    """Parse YAML keeping the line of each top-level and section key (from the composed nodes)."""
    lines: dict[tuple[Any, ...], int] = {}
    loader = ConfigLoader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return {}, lines

        def mapping(node: yaml.MappingNode, prefix: tuple[Any, ...]) -> dict[str, Any]:
            loader.flatten_mapping(node)  # resolve "<<:" merge keys
            result: dict[str, Any] = {}
            for key_node, value_node in node.value:
                key = loader.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                if not isinstance(key, str):
                    raise ConfigError(f"{_where(source, line)}: keys must be strings, got {key!r}")
                if key in result:
                    raise ConfigError(f"{_where(source, line)}: key '{'.'.join(prefix + (key,))}' appears "
                                      f"twice (first at line {lines[prefix + (key,)]}); keep one")
                lines[prefix + (key,)] = line
                if not prefix and key in sections and isinstance(value_node, yaml.MappingNode):
                    result[key] = mapping(value_node, (key,))
                else:
                    result[key] = loader.construct_object(value_node, deep=True)
            return result

        if isinstance(root, yaml.MappingNode):
            return mapping(root, ()), lines
        return loader.construct_object(root, deep=True), lines
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
        problem = " ".join(filter(None, [getattr(error, "context", None), getattr(error, "problem", None)]))
        where = _where(source, mark.line + 1 if mark else None)
        raise ConfigError(f"{where}: invalid YAML: {problem or error}") from None
    finally:
        loader.dispose()


class _Values:
    """Field values gathered from a file, each with the path and line that set it."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.values: dict[str, Any] = {}
        self.origins: dict[str, tuple[str, int | None]] = {}  # field -> (path, line) that set it whole
        self.option_origins: dict[str, tuple[str, int | None]] = {}  # dict field -> first key added to it
        self.explicit: set[str] = set()  # fields written under a section key

    def put(self, name: str, value: Any, path: str, line: int | None, option: str | None = None) -> None:
        clash = self.origins.get(name) or (None if option else self.option_origins.get(name))
        if clash:
            at = f" (line {clash[1]})" if clash[1] else ""
            raise ConfigError(f"{_where(self.source, line)}: {path} sets {name}, which {clash[0]}{at} "
                              "already sets; keep only one of them")
        if option:
            self.option_origins.setdefault(name, (path, line))
            self.values.setdefault(name, {})[option] = value
        else:
            self.origins[name] = (path, line)
            self.values[name] = value

    def origin(self, name: str) -> tuple[str, int | None]:
        return self.origins.get(name) or self.option_origins.get(name) or (name, None)


def build(data: Any, source: str, lines: dict[tuple[Any, ...], int], fields: Fields,
          sections: tuple[str, ...], dialect: Dialect | None = None, defer: bool = False,
          defaults: Defaults | None = None) -> dict[str, Any]:
    """Map sections, keys and aliases onto fields and check every value with its location.

    Returns the values the data sets. A hyper-parameter written under a section counts as set
    even at its default value (``optimizer: {name: sgd, beta1: 0.9}`` is an error); in a flat
    dict, such as ``to_dict()``, only values that differ from the default do. A top-level key
    that is no section is a field name or alias. ``dialect`` first rewrites another tool's keys;
    a ``Deferred`` value it makes is resolved against the other values, or with ``defer`` returned
    as it is (for a caller that adds more values before resolving). ``defaults`` gives other
    defaults than the fields' (``mlx-train finetune``'s); the values returned then include them.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: a config must be a mapping of sections ({', '.join(sections)}) "
                          f"or field names, got {type(data).__name__}")
    if dialect is not None:
        data = dialect(data, lines, source)
    table = routes(fields, sections)
    flat = table["training"]
    found = _Values(source)
    for key, value in data.items():
        line = lines.get((key,))
        # "optimizer" and "model" are both sections (a mapping) and fields (a name); "data" is a section and
        # an alias of a field (mlx_lm.lora's data: DIR).
        if key in sections and (isinstance(value, Mapping) or value is None or key not in flat):
            if not isinstance(value, (Mapping, type(None))):
                raise ConfigError(f"{_where(source, line)}: section '{key}' must be a mapping of keys to "
                                  f"values, got {value!r}")
            for sub, sub_value in (value or {}).items():
                _section_key(found, table, fields, key, sub, sub_value, lines.get((key, sub)))
        elif isinstance(key, str) and key in fields:
            found.put(key, value, key, line)
        elif isinstance(key, str) and key in flat:
            name, alias_value = flat[key]
            if alias_value is not None and not isinstance(value, Deferred):
                try:
                    value = alias_value(value)
                except Invalid as error:
                    raise ConfigError(f"{_where(source, line)}: {key} {error}") from None
            found.put(name, value, key, line)
        else:
            raise ConfigError(f"{_where(source, line)}: unknown top-level key {key!r}"
                              f"{did_you_mean(str(key), tuple(sections) + tuple(fields))}; expected a section "
                              f"({', '.join(sections)}) or a TrainConfig field (mlx-train train --help)")
    for name, value in found.values.items():
        path, line = found.origin(name)
        if isinstance(value, Deferred):
            continue
        try:
            found.values[name] = convert(fields[name], value)
        except Invalid as error:
            raise ConfigError(f"{_where(source, line)}: {path} {error}") from None
    values = dict(found.values)
    if defaults is not None:
        values = {**defaults(values), **values}
    if defer:
        return values
    try:
        values = resolve(values, fields)
    except ConfigError as error:
        raise ConfigError(f"{source}: {error}" if not str(error).startswith(source) else str(error)) from None
    complete = {name: values.get(name, default_of(f)) for name, f in fields.items()}
    problem = first_problem(fields, complete, found.explicit)
    if problem:
        path, line = found.origin(problem[0])
        raise ConfigError(f"{_where(source, line)}: {path} {problem[1]}")
    return values


def _section_key(found: _Values, table: Routes, fields: Fields, section: str, key: Any, value: Any,
                 line: int | None) -> None:
    keys = table[section]
    path = f"{section}.{key}"
    if isinstance(key, str) and key in keys:
        name, alias_value = keys[key]
        if alias_value is not None:
            try:
                value = alias_value(value)
            except Invalid as error:
                raise ConfigError(f"{_where(found.source, line)}: {path} {error}") from None
        found.put(name, value, path, line)
        found.explicit.add(name)
        return
    home = next((other for other, other_keys in table.items() if other != "training" and key in other_keys
                 and not _spec(fields[other_keys[key][0]]).shared_name), None)
    rest = next((name for name, f in fields.items() if _spec(f).section == section and _spec(f).other_keys), None)
    # Keys of data:/model: that are not fields are options, unless they look like a typo of a field.
    close = difflib.get_close_matches(str(key), keys, n=1, cutoff=0.8)
    if rest and isinstance(key, str) and not close and not home:
        found.put(rest, value, path, line, option=key)
        return
    if home:
        advice = f"; {key} belongs in section '{home}' (or 'training')"
    elif section == "training":
        aliases = [alias for f in fields.values() for alias in _spec(f).aliases]
        advice = f"; valid keys: TrainConfig fields (mlx-train train --help) and {', '.join(aliases)}"
    else:
        advice = f"; valid keys: {', '.join(_section_names(table, fields, section))}"
    raise ConfigError(f"{_where(found.source, line)}: unknown key {key!r} in section '{section}'"
                      f"{did_you_mean(str(key), keys)}{advice}")


def _section_names(table: Routes, fields: Fields, section: str) -> list[str]:
    """The keys to list for a section: each field's YAML key and aliases, not its flat name twice."""
    names = []
    for key, (name, _) in table[section].items():
        if key == name and _spec(fields[name]).key:
            continue
        names.append(key)
    return names


def sectioned(values: Mapping[str, Any], fields: Fields, sections: tuple[str, ...],
              leave_out: set[str] | frozenset[str] = frozenset()) -> dict[str, dict[str, Any]]:
    """``values`` in the YAML layout: each field under its section and key; the dict of a section's
    other keys spread into it (kept whole, under its field name, if one of its keys is taken)."""
    table = routes(fields, sections)
    out: dict[str, dict[str, Any]] = {section: {} for section in sections}
    for name, f in fields.items():
        spec = _spec(f)
        if name in leave_out:
            continue
        if not spec.other_keys:
            out[spec.section][spec.key or name] = values[name]
            continue
        extra = values[name]
        taken = [k for k in extra if k in table[spec.section] or difflib.get_close_matches(k, table[spec.section],
                                                                                            n=1, cutoff=0.8)]
        if taken:
            out[spec.section][name] = extra
        else:
            out[spec.section].update(extra)
    return {section: keys for section, keys in out.items() if keys}


def dump(data: Mapping[str, Any], header: str) -> str:
    """``data`` as YAML text under a one-line comment ``header``."""
    return f"# {header}\n" + yaml.safe_dump(dict(data), sort_keys=False)


def write(path: str | os.PathLike[str], data: Mapping[str, Any], header: str) -> None:
    """Write ``data`` as YAML under a one-line comment ``header``."""
    with open(path, "w", encoding="utf-8") as file:
        file.write(dump(data, header))
