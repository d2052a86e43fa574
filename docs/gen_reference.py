"""Writes the generated reference pages of the documentation site from the code:

    docs/reference/cli.md    the `flotilla` command, from its argparse parser (flotilla.cli.build_parser)
    docs/reference/http.md   the serving endpoints, from their FastAPI apps' OpenAPI schemas and the
                             pydantic bodies the OpenAI-compatible routes validate with

    python docs/gen_reference.py             # rewrite both pages
    python docs/gen_reference.py --check     # exit 1 when a committed page differs from the code
    python docs/gen_reference.py --out DIR   # write them under DIR instead (tests/unit/test_docs.py)

It documents the checkout it lives in (its platform/ goes first on the import path). Importing the
serving apps needs Ray Serve installed but starts no Ray.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
REGENERATE = "python docs/gen_reference.py"
PAGES = ("reference/cli.md", "reference/http.md")

# argparse wraps usage lines at the terminal's width: a fixed width keeps the pages the same everywhere.
os.environ["COLUMNS"] = "100"
sys.path.insert(0, str(ROOT / "platform"))


# ------------------------------------------------------------------ Markdown helpers
def md(text: str) -> str:
    """Prose for a Markdown table cell or paragraph: `<`, `>` outside code spans would be read as HTML."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # even parts are outside backticks
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def cell(text: str) -> str:
    """Prose for a table cell: one line, and no bare `|` (which would end the cell)."""
    parts = " ".join(text.split()).split("`")
    return "".join(md(part).replace("|", "\\|") if i % 2 == 0 else code(part) for i, part in enumerate(parts))


def code(text: str) -> str:
    """`text` as inline code. A `|` would end a table cell on GitHub even inside backticks, and an
    escaped one shows its backslash in MkDocs: such code is written as HTML, the pipe as an entity."""
    if "|" in text:
        return "<code>" + html.escape(text).replace("|", "&#124;") + "</code>"
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines + [""]


# ------------------------------------------------------------------ the CLI
def _help(action: argparse.Action, parser: argparse.ArgumentParser) -> str:
    if not action.help or action.help == argparse.SUPPRESS:
        return ""
    params = dict(vars(action), prog=parser.prog)
    if params.get("choices") is not None:
        params["choices"] = ", ".join(str(c) for c in params["choices"])
    return action.help % params


def _argument(action: argparse.Action) -> str:
    names = ", ".join(action.option_strings) if action.option_strings else (action.metavar or action.dest)
    if action.option_strings and action.nargs != 0:
        metavar = action.metavar or action.dest.upper()
        value = f"[{metavar}]" if action.nargs == "?" else metavar
        names += f" {value}"
    return code(names)


def _examples(epilog: str) -> list[str]:
    """A subcommand's epilog: its example commands as a code block, then its prose."""
    from flotilla.cli import EXIT_CODES_TEXT

    text = epilog.replace(EXIT_CODES_TEXT, "").strip()
    blocks = text.split("\n\n")
    out: list[str] = []
    for block in blocks:
        lines = block.splitlines()
        if lines and lines[0].strip() == "examples:":
            out += ["```bash"] + [line[2:] if line.startswith("  ") else line for line in lines[1:]] + ["```", ""]
        elif block.strip():
            out += [md(" ".join(block.split())), ""]
    return out


def _arguments_table(parser: argparse.ArgumentParser) -> list[str]:
    groups = {id(a): g for g in parser._mutually_exclusive_groups for a in g._group_actions}
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        notes = []
        if action.required:
            notes.append("required")
        group = groups.get(id(action))
        if group is not None:
            others = [", ".join(a.option_strings) for a in group._group_actions if a is not action]
            notes.append(("one of it and " if group.required else "not with ") + ", ".join(code(o) for o in others))
        if (action.option_strings and action.nargs != 0 and action.default not in (None, [], argparse.SUPPRESS)
                and "%(default)" not in (action.help or "")):
            notes.append(f"default {code(str(action.default))}")
        if action.option_strings and action.nargs == "?" and action.const is not None:
            notes.append(f"alone: {code(str(action.const))}")
        rows.append([_argument(action), cell(_help(action, parser)), "; ".join(notes)])
    if not rows:
        return []
    return table(["argument", "meaning", "notes"], rows)


def cli_page() -> str:
    from flotilla.cli import build_parser
    from flotilla.errors import EXIT_CODES

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    summaries = {choice.dest: choice.help for choice in sub._choices_actions}
    out = [
        "# The `flotilla` command",
        "",
        f"<!-- Generated from flotilla.cli by {REGENERATE}; do not edit by hand. -->",
        "",
        md(parser.description or ""),
        "",
        "```text",
        parser.format_usage().strip(),
        "```",
        "",
    ]
    out += _arguments_table(parser)
    out += ["Subcommands:", ""]
    out += table(["command", "what it does"], [[f"[{code(name)}](#{name})", cell(summaries[name])]
                                               for name in sub.choices])
    out += ["## Exit codes", "", "Every subcommand ends with one of these:", ""]
    out += table(["code", "meaning"], [[code(str(c)), cell(meaning)] for c, meaning in EXIT_CODES.items()])
    for name, p in sub.choices.items():
        out += [f"## {name}", "", md(p.description or summaries[name]), "", "```text", p.format_usage().strip(), "```",
                ""]
        out += _arguments_table(p)
        out += _examples(p.epilog or "")
    return "\n".join(out).rstrip() + "\n"


# ------------------------------------------------------------------ the HTTP APIs
def _apps():
    from flotilla.serve._chat import chat_api
    from flotilla.serve._openai import (ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                                        CompletionRequest, CompletionResponse, OpenAIError)
    from flotilla.serve._router import router_api
    from flotilla.serve._server import classifier_api, generator_api

    # The chat routes read the raw request and validate it with these models (flotilla.serve._chat),
    # and answer JSON or a stream: the page names the responses from the models.
    chat_bodies = {
        "/v1/chat/completions": (ChatCompletionRequest, ChatCompletionResponse, ChatCompletionChunk),
        "/v1/completions": (CompletionRequest, CompletionResponse, CompletionResponse),
    }
    routed = {path.removeprefix("/v1"): models for path, models in chat_bodies.items()}
    prefix = "{prefix}"
    return [
        ("Classifier", "serve_apps.classifier:app", "tabular models (`model.kind` `mlp` or `custom`)",
         classifier_api, {}, None, prefix),
        ("Generator", "serve_apps.generator:app", "byte-level language models (`model.kind: gpt`)",
         generator_api, {}, None, prefix),
        ("Chat", "serve_apps.chat:app", "fine-tuned pretrained language models (`model.kind: hf_causal_lm`)",
         chat_api, chat_bodies, OpenAIError, prefix),
        ("OpenAI router", "serve_apps.openai:app", "every chat app of the cluster at one base URL, `/v1` (started by "
         "the first `flotilla deploy` of a language model; `serve.openai_router`), routed by the body's `model`: "
         "the model's own answers and errors; an unknown `model` is a 404 with `code: model_not_found`",
         router_api, routed, OpenAIError, "/v1"),
    ]


def _ref_name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def _link(name: str) -> str:
    return f"[{name}](#{name.lower()})"


def _type(schema: dict, nested: bool = False) -> str:
    if "$ref" in schema:
        return _link(_ref_name(schema["$ref"]))
    if "const" in schema:
        return code(json.dumps(schema["const"]))
    if "enum" in schema:
        text = " or ".join(code(json.dumps(v)) for v in schema["enum"])
        return f"({text})" if nested and len(schema["enum"]) > 1 else text
    for key in ("anyOf", "oneOf"):
        if key in schema:
            text = " or ".join(_type(s, nested=True) for s in schema[key])
            return f"({text})" if nested else text
    kind = schema.get("type")
    if kind == "array":
        items = schema.get("items")
        return f"array of {_type(items, nested=True)}" if items else "array"
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        return f"object of {_type(schema['additionalProperties'], nested=True)}"
    return kind or "any"


CONSTRAINTS = {"minimum": "≥ {}", "exclusiveMinimum": "> {}", "maximum": "≤ {}", "exclusiveMaximum": "< {}",
               "minLength": "at least {} characters", "maxLength": "at most {} characters",
               "minItems": "at least {} item(s)", "maxItems": "at most {} item(s)"}


def _constraints(schema: dict) -> list[str]:
    found = [fmt.format(schema[key]) for key, fmt in CONSTRAINTS.items() if key in schema]
    for key in ("anyOf", "oneOf"):
        for branch in schema.get(key, []):
            if "$ref" not in branch and branch.get("type") not in ("array", "object"):
                found += _constraints(branch)
    return found


def _schema_table(name: str, schema: dict, in_requests: bool) -> list[str]:
    out = [f"### {name}", ""]
    if schema.get("description"):
        out += [md(" ".join(schema["description"].split())), ""]
    properties = schema.get("properties", {})
    if not properties:
        return out + [f"Type: {_type(schema)}.", ""]
    required = set(schema.get("required", []))
    rows = []
    for field, prop in properties.items():
        notes = ["required"] if field in required else []
        if "default" in prop and field not in required:
            notes.append(f"default {code(json.dumps(prop['default']))}")
        notes += _constraints(prop)
        rows.append([code(field), _type(prop), cell("; ".join(notes)), cell(prop.get("description", ""))])
    out += table(["field", "type", "notes", "meaning"], rows)
    if in_requests and schema.get("additionalProperties") is False:
        out += ["A field not listed here is refused (422).", ""]
    return out


def _refs(schema) -> set[str]:
    """The names of the schemas that `schema` refers to, directly."""
    if isinstance(schema, dict):
        found = {_ref_name(schema["$ref"])} if "$ref" in schema else set()
        return found.union(*(_refs(v) for v in schema.values()))
    if isinstance(schema, list):
        return set().union(*(_refs(v) for v in schema))
    return set()


class _Schemas:
    """The schemas one page shows, by name. A pydantic model that Flotilla's serving code defines
    is rendered from the model itself: FastAPI's OpenAPI document turns integer bounds into floats
    (2^63-1 becomes 9.223372036854776e+18) and drops `default: null`."""

    def __init__(self):
        from pydantic import BaseModel

        from flotilla.serve import _openai, _schemas

        self.models = {cls.__name__: cls for module in (_schemas, _openai) for cls in vars(module).values()
                       if isinstance(cls, type) and issubclass(cls, BaseModel) and cls.__module__ == module.__name__}
        self.by_name: dict[str, dict] = {}
        self.requests: set[str] = set()

    def add(self, name: str, schema: dict | None = None, request: bool = False) -> str:
        """Adds the schema `name` (from its pydantic model where there is one) and what it refers to;
        returns a link to it."""
        if name in self.models:
            schema = self.models[name].model_json_schema(ref_template="#/components/schemas/{model}")
            for sub_name, sub in schema.pop("$defs", {}).items():
                self._put(sub_name, sub)
        self._put(name, schema)
        if request:
            self._mark_request(name)
        return _link(name)

    def _put(self, name: str, schema: dict) -> None:
        if name in self.by_name and self.by_name[name] != schema:
            raise SystemExit(f"two different schemas are named {name}")
        self.by_name[name] = schema

    def _mark_request(self, name: str) -> None:
        if name not in self.requests:
            self.requests.add(name)
            for sub in _refs(self.by_name[name]):
                self._mark_request(sub)

    def tables(self) -> list[str]:
        out: list[str] = []
        for name in sorted(self.by_name):
            out += _schema_table(name, self.by_name[name], name in self.requests)
        return out


def http_page() -> str:
    from flotilla.serve._server import RUNTIME_HEADER, VERSION_HEADER
    from flotilla.spec import ServeSpec

    schemas = _Schemas()
    sticky = ServeSpec.model_fields["sticky_header"].default
    out = [
        "# HTTP APIs",
        "",
        f"<!-- Generated from the serving apps' OpenAPI schemas by {REGENERATE}; do not edit by hand. -->",
        "",
        "`flotilla deploy` (or `flotilla deploy-apps`, or `serve run serve_apps.<kind>:app`) serves each registered "
        "model at its own prefix, `{prefix}` below: `serve.route_prefix`, by default `/v1/models/<model>`, "
        "on `serve.host`:`serve.port` (default `127.0.0.1:8000`). The app is chosen by the model's kind.",
        "",
        f"- Every answer names the version that gave it in the `{VERSION_HEADER}` header, and what ran the model "
        f"(`torch`, `onnx`, `onnx-int8`, `onnx-int4`) in `{RUNTIME_HEADER}`.",
        f"- A request with a `{sticky}` header (`serve.sticky_header`) always reaches the same version of a split.",
        "- Bodies are JSON, sent with `Content-Type: application/json` (any other type, or none, is a 415); "
        "numbers must be finite.",
        "- An error answer lists at most 20 problems (and counts the rest), and stays under 16 KB.",
        "- `GET {prefix}/docs` serves the app's OpenAPI document as interactive docs.",
        "",
    ]
    for heading, import_path, serves, api, bodies, error_model, prefix in _apps():
        spec = api.openapi()
        title = spec["info"]["title"]
        out += [f"## {heading}", "",
                f"{md(title)}: {md(spec['info'].get('description', ''))} Serves {serves}; "
                f"`{import_path}`.", ""]
        rows, details = [], []
        for path, operations in spec["paths"].items():
            for method, op in operations.items():
                full = prefix + path
                rows.append([method.upper(), code(full), cell(op.get("summary", ""))])
                if method != "post":
                    continue
                details += [f"### {method.upper()} `{full}`", ""]
                request = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
                if path in bodies:  # the OpenAI routes: the body they publish, and what they answer
                    req, resp, chunk = bodies[path]
                    details.append(f"- Request body: {schemas.add(req.__name__, request=True)}")
                    details.append(f"- 200: {schemas.add(resp.__name__)}; with `stream: true`, server-sent events, "
                                   f"`data: ` and a {schemas.add(chunk.__name__)} each, then `data: [DONE]`")
                elif request is not None:
                    details.append(f"- Request body: {schemas.add(request['title'], request, request=True)}")
                    ok = op["responses"].get("200", {}).get("content", {}).get("application/json", {}).get("schema")
                    if ok:
                        for name in _refs(ok):
                            schemas.add(name, spec["components"]["schemas"][name])
                        details.append(f"- 200: {_type(ok)}")
                by_schema: dict[str, list[str]] = {}
                for status, response in op["responses"].items():
                    if status.startswith("2"):
                        continue
                    schema = response.get("content", {}).get("application/json", {}).get("schema", {})
                    for name in _refs(schema):
                        schemas.add(name, spec["components"]["schemas"][name])
                    by_schema.setdefault(_type(schema), []).append(status)
                for schema_type, statuses in by_schema.items():
                    details.append(f"- {', '.join(statuses)}: {schema_type}")
                if error_model is not None:
                    details.append(f"- an error: its HTTP status, and {schemas.add(error_model.__name__)} "
                                   "(OpenAI's shape)")
                details.append("")
        out += table(["method", "path", "what it does"], rows)
        out += details
    out += ["## Schemas", ""] + schemas.tables()
    return "\n".join(out).rstrip() + "\n"


# ------------------------------------------------------------------ main
def pages() -> dict[str, str]:
    return {"reference/cli.md": cli_page(), "reference/http.md": http_page()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a committed page is out of date")
    parser.add_argument("--out", type=Path, default=DOCS, help="the docs directory to write into (default: docs/)")
    args = parser.parse_args(argv)
    stale = []
    for rel, text in pages().items():
        path = args.out / rel
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(rel)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    if stale:
        print(f"out of date: {', '.join(stale)}; regenerate with: {REGENERATE}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
