"""Click options generated from a config class's field: its type, its choices (a `Literal`), its default and its help
(the docstring under the field) are written once, in the class; a flag states only what the command line adds (its
name, a default the launch layer fills in, a note on that default). vLLM's EngineArgs -> argparse, over click."""

import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from pathlib import Path

import click

FILLED_IN = object()  # `default=FILLED_IN`: the flag has no default; None reaches the launch layer, which fills it


@functools.cache
def field_docs(cls) -> dict[str, str]:
    """Each field's docstring (the string literal right under it in the class body), whitespace folded."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for field, doc in zip(body, body[1:]):
        if (
            isinstance(field, ast.AnnAssign)
            and isinstance(field.target, ast.Name)
            and isinstance(doc, ast.Expr)
            and isinstance(doc.value, ast.Constant)
            and isinstance(doc.value.value, str)
        ):
            docs[field.target.id] = " ".join(doc.value.value.split())
    return docs


class CommaList(click.ParamType):
    """`a,b` as the tuple ("a", "b"): a `tuple[str, ...]` field on the command line."""

    name = "list"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        items = tuple(s.strip() for s in value.split(",") if s.strip())
        if not items:
            self.fail(f"{value!r}: give a comma-separated list", param, ctx)
        return items


def click_type(annotation):
    """The click type of a field's annotation: a Literal's values as a Choice, `X | None` as X, `tuple[str, ...]`
    as a comma list."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (annotation,) = [a for a in args if a is not type(None)]
        args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Literal:
        return click.Choice(args)
    if typing.get_origin(annotation) is tuple and args == (str, ...):
        return CommaList()
    if annotation is Path:
        return click.Path()
    if annotation in (int, float, str, bool):
        return annotation
    raise TypeError(f"no click type for {annotation!r}")


def option_from(cls, name: str, *decls: str, default=None, help: str | None = None, **kw):
    """A click option for field `name` of dataclass `cls`, passed to the command as `name` (decls default to
    `--name-with-dashes`). Its default is the
    field's unless `default=FILLED_IN`; `help` is added after the field's docstring, unless `kw` says
    `replace_help=True`."""
    field = {f.name: f for f in dataclasses.fields(cls)}[name]
    kind = click_type(typing.get_type_hints(cls)[name])
    decls = (*(decls or (f"--{name.replace('_', '-')}",)), name)  # the command's argument is the field's name
    doc = field_docs(cls).get(name, "")
    text = help if kw.pop("replace_help", False) else " ".join(t for t in (doc, help) if t)
    if default is FILLED_IN:
        value, show = None, False
    else:
        value = field.default if default is None else default
        show = value is not None and kind is not bool
    if kind is bool:
        if default is FILLED_IN:  # `--x/--no-x`: neither given is None, which the launch layer fills in
            return click.option(*decls, default=None, help=text, **kw)
        return click.option(*decls, is_flag=True, default=bool(value), help=text, **kw)
    return click.option(*decls, type=kind, default=value, show_default=show, help=text, **kw)


def options_from(cls, *, skip: tuple[str, ...] = (), decls: dict[str, tuple[str, ...]] | None = None):
    """A decorator adding an option per field of `cls` (in the class's order, `skip` left out; `decls`: a field's
    own flag names, e.g. `--x/--no-x` for a bool that defaults to True)."""
    decls = decls or {}
    options = [option_from(cls, f.name, *decls.get(f.name, ())) for f in dataclasses.fields(cls) if f.name not in skip]

    def apply(command):
        for option in reversed(options):
            command = option(command)
        return command

    return apply
