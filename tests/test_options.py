"""Options generated from the config classes (dtrt.cli.options): a flag's type, choices, default and help come from
the field it sets, and the defaults `docs/DESIGN.md` says are decided once are written once."""

import re
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Literal

import click
import pytest

from dtrt.cli import cli
from dtrt.cli.options import FILLED_IN, click_type, field_docs, option_from
from dtrt.errors import DtrtError
from dtrt.exporter.export_config import ExportConfig
from dtrt.runtime.spec import RunSpec
from dtrt.serve.config import ServeConfig
from dtrt.train.config import DataGenConfig, TrainConfig

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, kw_only=True)
class Config:
    mode: Literal["a", "b"] = "a"
    """How it runs."""
    count: int = 3
    """How many
    of them."""
    where: Path | None = None
    """A directory."""
    fast: bool = False
    """Faster."""
    undocumented: int | None = None


def params(*options) -> dict[str, click.Option]:
    @click.command()
    def command(**kw):
        pass

    for opt in options:
        command = opt(command)
    return {p.name: p for p in command.params}


def test_an_option_is_its_field():
    got = params(
        option_from(Config, "mode"),
        option_from(Config, "count", default=FILLED_IN, help="Default: the launch layer's."),
        option_from(Config, "where"),
        option_from(Config, "fast"),
        option_from(Config, "undocumented", "--other", replace_help=True, help="its own help"),
    )
    assert got["mode"].type.choices == ("a", "b") and got["mode"].default == "a" and got["mode"].help == "How it runs."
    assert got["count"].type is click.INT and got["count"].default is None
    assert got["count"].help == "How many of them. Default: the launch layer's."
    assert isinstance(got["where"].type, click.Path) and got["where"].opts == ["--where"]
    assert got["fast"].is_flag and got["fast"].default is False
    assert got["undocumented"].opts == ["--other"] and got["undocumented"].help == "its own help"
    assert field_docs(Config) == {"mode": "How it runs.", "count": "How many of them.", "where": "A directory.",
                                  "fast": "Faster."}  # fmt: skip


GENERATED = {
    "run": ("dtype", "backend", "threads", "device", "method", "builder", "arm", "budget", "topm", "node_topk",
            "cuda_graph", "lookup", "draft_vocab"),
}  # fmt: skip
GENERATED["serve"] = GENERATED["run"]


@pytest.mark.parametrize("command", ["run", "serve"])
def test_the_commands_take_run_spec_fields_from_run_spec(command):
    """Each flag that sets a RunSpec field has the field's choices, its default (or none: the launch layer's) and,
    unless the command says what it is for itself, its docstring as help."""
    spec, hints, docs = {f.name: f for f in fields(RunSpec)}, typing.get_type_hints(RunSpec), field_docs(RunSpec)
    got = {p.name: p for p in cli.commands[command].params}
    for name in GENERATED[command]:
        p, kind = got[name], click_type(hints[name])
        if isinstance(kind, click.Choice):
            assert tuple(p.type.choices) == tuple(kind.choices), name
        assert p.default in (None, spec[name].default), (name, p.default)
        if name != "draft_vocab":
            assert p.help.startswith(docs[name]), name


def test_export_flags_are_export_config():
    """Every field of ExportConfig is a flag of `dtrt export` with its choices, default and docstring, and the
    command hands them over as they are (--jobs: what the command picks where it is not given); the RunSpec fields it
    shares take RunSpec's defaults."""
    hints, docs = typing.get_type_hints(ExportConfig), field_docs(ExportConfig)
    got = {p.name: p for p in cli.commands["export"].params}
    for f in fields(ExportConfig):
        p, kind = got[f.name], click_type(hints[f.name])
        if isinstance(kind, click.Choice):
            assert tuple(p.type.choices) == tuple(kind.choices), f.name
        if f.name == "jobs":  # the command picks it where the flag is not given (dtrt.launch.memory.export_jobs)
            assert p.default is None and p.help.startswith(docs[f.name] + " [default: 2 on two"), p.help
        else:
            assert p.default == f.default and p.help == docs[f.name], f.name
    assert tuple(got["dtype"].type.choices) == ("fp32", "fp16", "bf16")  # what the exporter supports
    assert (ExportConfig.budget, ExportConfig.topm, ExportConfig.node_topk) == (
        RunSpec.budget, RunSpec.topm, RunSpec.node_topk
    )  # fmt: skip
    assert got["drafters"].type.convert("dflash, domino", None, None) == ("dflash", "domino")


@pytest.mark.parametrize(
    ("command", "cls", "flags"),
    [
        ("train-drafter", TrainConfig, {"time_limit_s": "--time-limit"}),
        ("drafter-data", DataGenConfig, {"chat": "--chat"}),
    ],
)
def test_training_flags_are_their_configs(command, cls, flags):
    """`dtrt train-drafter` and `dtrt drafter-data` take every field of their config with its default, choices
    and docstring; the flag names are the fields' unless the command says otherwise."""
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    got = {p.name: p for p in cli.commands[command].params}
    for f in fields(cls):
        p, kind = got[f.name], click_type(hints[f.name])
        if isinstance(kind, click.Choice):
            assert tuple(p.type.choices) == tuple(kind.choices), f.name
        assert p.default == f.default and p.help == docs[f.name], f.name
        assert p.opts[0] == flags.get(f.name, "--" + f.name.replace("_", "-")), f.name
    assert got["chat"].secondary_opts == ["--no-chat"] if command == "drafter-data" else True


def test_serve_flags_are_serve_config():
    """`dtrt serve`'s guards (queue, timeouts, key, limits) are ServeConfig's fields, with their defaults and help."""
    docs, got = field_docs(ServeConfig), {p.name: p for p in cli.commands["serve"].params}
    for f in fields(ServeConfig):
        if f.name in ("model_name", "defaults", "truncate"):  # the command fills these in; --truncate is run's too
            continue
        p = got[f.name]
        assert p.default == f.default and p.help == docs[f.name], f.name
        assert p.opts[0] == "--" + f.name.replace("_", "-"), f.name
    assert got["api_key"].envvar == "DTRT_API_KEY"


def test_no_command_declares_a_flag_twice():
    for name, command in cli.commands.items():
        opts = [o for p in command.params for o in (*p.opts, *p.secondary_opts)]
        assert len(opts) == len(set(opts)), (name, sorted(o for o in opts if opts.count(o) > 1))


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        ({"dtype": "int4"}, "--dtype int4: export supports fp32, fp16, bf16"),
        ({"drafters": ("eagle",)}, "--drafters 'eagle': use some of dflash, domino"),
        ({"quant": "int4", "quant_block": 48}, "--quant-block 48"),
        ({"drafter_quant": "int8", "dtype": "bf16"}, "--drafter-quant int8 quantizes fp32 weights"),
        ({"max_context": 1}, "--max-context must be >= 2"),
    ],
)
def test_export_config_checks_its_values_once(kw, msg):
    with pytest.raises(DtrtError, match=re.escape(msg)):
        ExportConfig(**kw)
    assert ExportConfig(quant="int4").quant_spec.block == 32 and ExportConfig().quant_spec is None


def test_each_run_spec_default_is_written_once():
    """topm 64, node_topk 8, budget 16, arm dominotree: in RunSpec, nowhere else in dtrt/ (the CLI, the launch layer,
    the exporter and the loop read RunSpec's)."""
    typed = r"(\s*:\s*[\w |]+)?\s*=\s*"  # `name = `, `name: int = `, `name=`
    pattern = re.compile(
        rf"""\btopm{typed}64\b|\bnode_topk{typed}8\b|\bbudget{typed}16\b|\barm{typed}"dominotree"|"""
        r"""--topm"[^)\n]*default=64|--node-topk"[^)\n]*default=8"""
    )
    hits = [
        f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
        for path in sorted((ROOT / "dtrt").rglob("*.py"))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert [h for h in hits if not h.startswith("dtrt/runtime/spec.py")] == [], hits
    assert len(hits) == 4, hits
