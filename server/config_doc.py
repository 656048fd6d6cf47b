"""The flags' documentation and the README's reference tables, generated from the code so
they cannot drift.

- Every flag's help and default: the docstring of the config field behind it
  (`EngineConfig`'s sections, `ServerConfig`), or the flag's argparse help where no config
  field stands behind it. `document_flags` puts them on the parser (`server.cli.build_parser`
  calls it), so `pagoda serve --help` and the README table say the same.
- The configuration table: those flags, then the engine arguments that only the Python
  API sets.
- The metrics table: every series `GET /metrics` exposes, read from a rendered
  `server.metrics.Metrics`.

    python -m server.config_doc            # print both tables
    python -m server.config_doc --write    # rewrite them in README.md between their markers

tests/ops/test_readme_tables.py fails when README.md differs from this output.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import sys
import textwrap
from pathlib import Path
from typing import Any

README = Path(__file__).resolve().parent.parent / "README.md"

CONFIG_BEGIN = "<!-- config-table:begin (generated: python -m server.config_doc --write) -->"
CONFIG_END = "<!-- config-table:end -->"
METRICS_BEGIN = "<!-- metrics-table:begin (generated: python -m server.config_doc --write) -->"
METRICS_END = "<!-- metrics-table:end -->"

# Flags whose config field has another name than the flag's dest.
_FIELD_OF_FLAG = {
    "health_stall_timeout": "health_stall_timeout_s",
    "max_queue_time": "max_queue_time_s",
    "request_timeout": "request_timeout_s",
    "shutdown_timeout": "shutdown_timeout_s",
    "grammar_compile_timeout": "grammar_compile_timeout_s",
    "responses_store_ttl": "responses_store_ttl_s",
    "client_read_timeout": "client_read_timeout_s",
}
# The default shown for flags whose argparse default depends on the environment.
_ENV_DEFAULTS = {"api_key": "`$PAGODA_API_KEY`, else none"}


@dataclasses.dataclass(frozen=True, slots=True)
class FieldDoc:
    owner: str  # e.g. "ModelConfig"
    name: str
    default: Any
    doc: str


@dataclasses.dataclass(frozen=True, slots=True)
class FlagRow:
    flag: str  # e.g. "`--max-num-seqs`"
    default: str
    doc: str


def field_docs(cls: type) -> dict[str, FieldDoc]:
    """A dataclass's fields with the docstring literal written right after each of them."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for stmt, nxt in zip(body, body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        out[f.name] = FieldDoc(cls.__name__, f.name, default, docs.get(f.name, ""))
    return out


def config_fields() -> dict[str, FieldDoc]:
    """Every documented config field by name: the engine sections, then the server's."""
    from engine.config import EngineConfig
    from server.config import ServerConfig

    fields: dict[str, FieldDoc] = {}
    for section in dataclasses.fields(EngineConfig):
        fields.update(field_docs(section.default_factory))  # type: ignore[arg-type]
    fields.update(field_docs(ServerConfig))
    return fields


def serve_parser() -> argparse.ArgumentParser:
    from server.cli import build_parser

    parser = build_parser()
    return parser._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]


def _format_default(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"`{value}`"


def _flag_text(action: argparse.Action) -> str:
    flag = max(action.option_strings, key=len)
    if isinstance(action.metavar, str) and action.metavar.startswith("{"):
        return f"`{flag} {action.metavar}`"
    if action.choices:
        return f"`{flag} {{{','.join(map(str, action.choices))}}}`"
    return f"`{flag}`"


def flag_doc(action: argparse.Action, field: FieldDoc | None) -> tuple[str, str]:
    """(what the flag does, its default in Markdown) from the config field behind it, or
    from the flag's own `help=` where no documented field stands behind it."""
    if action.nargs == 0:
        # A switch: its help says what giving it does; the field's doc says what the
        # setting is. A config file names the setting, not the switch.
        doc, shown = action.help or (field.doc if field else ""), "not set"
        if max(action.option_strings, key=len).lstrip("-").replace("-", "_") != action.dest:
            doc += f" (in a `--config` file: `{action.dest}: {str(not action.default).lower()}`)"
    elif field is not None and field.doc:
        doc = field.doc
        # A flag left unset (None) means the config field's default applies.
        default = field.default if action.default is None else action.default
        shown = _ENV_DEFAULTS.get(action.dest) or _format_default(default)
    else:
        doc = action.help or ""
        shown = _ENV_DEFAULTS.get(action.dest) or _format_default(action.default)
    return doc, shown


def document_flags(parser: argparse.ArgumentParser) -> None:
    """Give every flag of `parser` its help text and shown default, from the config
    classes (one source with the README table); `server.cli.build_parser` calls it.

    The help becomes the doc alone (`%` escaped for argparse); the default goes to the
    action's `default_text`, which `FlagHelpFormatter` appends in `--help` and
    `flag_rows` puts in its own column.
    """
    fields = config_fields()
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        doc, shown = flag_doc(action, fields.get(_FIELD_OF_FLAG.get(action.dest, action.dest)))
        if not doc:
            raise ValueError(f"flag {_flag_text(action)} has neither a documented config field nor argparse help")
        action.help = doc.replace("%", "%%")
        action.default_text = shown  # type: ignore[attr-defined]


def plain_default(shown: str) -> str:
    """A Markdown default as the terminal shows it."""
    return shown.replace("`", "")


class FlagHelpFormatter(argparse.HelpFormatter):
    """`--help` with each flag's default after its help: the one `document_flags` set,
    else the argparse default of an optional flag that takes a value."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        shown = getattr(action, "default_text", None)
        if shown is None and action.option_strings and action.nargs != 0 and not action.required \
                and action.default is not None and action.default is not argparse.SUPPRESS:
            shown = str(action.default)
        if shown is not None:
            text += f" (default: {plain_default(shown)})".replace("%", "%%")
        return text


def flag_rows() -> list[FlagRow]:
    """One row per `pagoda serve` flag, in the order of `pagoda serve --help`."""
    rows = []
    for action in serve_parser()._actions:
        if not action.option_strings or action.dest == "help":
            continue
        rows.append(FlagRow(_flag_text(action), action.default_text, action.help.replace("%%", "%")))  # type: ignore[attr-defined]
    return rows


def api_only_fields() -> list[FieldDoc]:
    """Engine fields no flag sets: `LLM(...)` / `EngineConfig.from_engine_args` only."""
    from engine.config import EngineConfig

    dests = {_FIELD_OF_FLAG.get(a.dest, a.dest) for a in serve_parser()._actions}
    out = []
    for section in dataclasses.fields(EngineConfig):
        for field in field_docs(section.default_factory).values():  # type: ignore[arg-type]
            if field.name not in dests:
                out.append(field)
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def config_table() -> str:
    lines = [
        "| Flag (`pagoda serve`) | Default | What it does |",
        "|---|---|---|",
    ]
    for row in flag_rows():
        lines.append(f"| {row.flag} | {_cell(row.default)} | {_cell(row.doc)} |")
    lines += [
        "",
        "Engine arguments without a flag (Python API: `LLM(name=value)`):",
        "",
        "| Argument | Default | What it does |",
        "|---|---|---|",
    ]
    for field in api_only_fields():
        lines.append(f"| `{field.name}` | {_format_default(field.default)} | {_cell(field.doc)} |")
    return "\n".join(lines)


def metric_families() -> list[tuple[str, str, str, list[str]]]:
    """(exposed name, type, help, labels) of every family `/metrics` serves."""
    from server.metrics import Metrics

    metrics = Metrics("model")
    out = []
    for family in metrics.registry.collect():
        labels = sorted({k for s in family.samples for k in s.labels if k not in ("le",)})
        if family.type == "counter":
            name = f"`{family.name}_total`"
        elif family.type == "histogram":
            name = f"`{family.name}_bucket`, `_sum`, `_count`"
        else:
            name = f"`{family.name}`"
        out.append((name, family.type, " ".join(family.documentation.split()), labels))
    return out


def metrics_table() -> str:
    lines = ["| Series | Type | Labels | What it measures |", "|---|---|---|---|"]
    for name, kind, doc, labels in metric_families():
        lines.append(f"| {name} | {kind} | {', '.join(labels)} | {_cell(doc)} |")
    return "\n".join(lines)


def replace_between(text: str, begin: str, end: str, body: str) -> str:
    """`text` with the lines between the `begin` and `end` marker lines replaced by `body`."""
    start = text.index(begin) + len(begin)
    stop = text.index(end, start)
    return text[:start] + "\n" + body + "\n" + text[stop:]


def render_readme(text: str) -> str:
    text = replace_between(text, CONFIG_BEGIN, CONFIG_END, config_table())
    return replace_between(text, METRICS_BEGIN, METRICS_END, metrics_table())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m server.config_doc", description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the tables in README.md")
    ns = parser.parse_args(argv)
    if ns.write:
        README.write_text(render_readme(README.read_text()))
        print(f"updated {README}")
    else:
        print(config_table() + "\n\n" + metrics_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
