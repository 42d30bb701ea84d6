"""MkDocs hook: fills generated parts of pages from the code, so they cannot go stale.

A page line ``<!-- generated: trainconfig-fields -->`` becomes a table of every config field (the
config that holds it: ``TrainConfig``, ``LaunchConfig`` or ``FinetuneConfig``; YAML section, default,
meaning), read from the field declarations; ``<!-- generated: finetune-defaults -->`` the fields
whose default differs under ``mlx-train finetune`` (``FinetuneConfig``'s); a line
``<!-- generated: cli-help COMMAND -->`` becomes the output of ``mlx-train COMMAND --help``.
The sources under ``src/`` of this checkout are imported (before an installed copy).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
from typing import Any

MARKER = re.compile(r"^<!-- generated: (?P<what>[\w-]+)(?: (?P<arg>[\w-]+))? -->$", re.MULTILINE)


def on_config(config: Any, **kwargs: Any) -> Any:
    src = os.path.join(os.path.dirname(os.path.abspath(config.config_file_path)), "src")
    if src not in sys.path:
        sys.path.insert(0, src)
    return config


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    return MARKER.sub(lambda match: _render(match["what"], match["arg"], page.file.src_uri), markdown)


def _render(what: str, arg: str | None, where: str) -> str:
    if what == "trainconfig-fields":
        return _fields_table()
    if what == "finetune-defaults":
        return _finetune_defaults()
    if what == "cli-help" and arg:
        return _cli_help(arg)
    raise ValueError(f"{where}: unknown generated part {what!r} (trainconfig-fields, finetune-defaults, "
                     "cli-help COMMAND)")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _fields_table() -> str:
    from mlx_train.config import FinetuneConfig, LaunchConfig, TrainConfig
    from mlx_train.config.options import default_of
    from mlx_train.config.sections import all_fields

    helps = FinetuneConfig.fields_help()
    rows = ["| field | config | YAML section | default | meaning |", "|---|---|---|---|---|"]
    for name, declared in all_fields().items():
        field = helps[name]
        owner = next(cls for cls in (TrainConfig, LaunchConfig, FinetuneConfig) if name in cls.fields_help())
        value = default_of(declared)
        default = "null" if value is None else repr(value)
        meaning = field.help + (f" One of: {', '.join(field.choices)}." if field.choices else "")
        rows.append(f"| `{name}` | `{owner.__name__}` | `{field.section}` | `{_cell(default)}` | {_cell(meaning)} |")
    return "\n".join(rows)


def _finetune_defaults() -> str:
    from mlx_train.config import FinetuneConfig
    from mlx_train.config.options import default_of
    from mlx_train.config.sections import all_fields

    rows = ["| field | declared default (`train`) | `finetune`'s default (mlx_lm.lora's) |", "|---|---|---|"]
    for name, value in FinetuneConfig.defaults().items():
        declared = default_of(all_fields()[name])
        if value != declared:
            rows.append(f"| `{name}` | `{_cell(repr(declared))}` | `{_cell(repr(value))}` |")
    return "\n".join(rows)


def _cli_help(command: str) -> str:
    from mlx_train.cli.main import COMMANDS, main

    if command not in COMMANDS:
        raise ValueError(f"no mlx-train command {command!r} (commands: {', '.join(COMMANDS)})")
    shown = io.StringIO()
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "80"
    try:
        with contextlib.redirect_stdout(shown):
            code = main([command, "--help"])
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns
    if code != 0:
        raise RuntimeError(f"mlx-train {command} --help exited {code}")
    return f"```text\n{shown.getvalue().rstrip()}\n```"
