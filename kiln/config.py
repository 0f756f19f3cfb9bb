"""Typed configuration: dataclass sections, TOML files, dotted overrides, loud errors.

Each component owns the dataclass of its own section (ModelConfig in kiln.models, OptimConfig in kiln.train.optim,
...); this module only assembles them, loads TOML, applies `--section.key=value` overrides and writes the
resolved config back. Help text is each field's trailing `# comment` in its dataclass source.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import math
import inspect
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path

from kiln.data import DataConfig
from kiln.data.documents import document_mask_refusal
from kiln.data.sft import chat_template_for
from kiln.errors import KilnError
from kiln.parallel import ParallelConfig
from kiln.parallel.strategy import strategy
from kiln.memory.levers import MemoryConfig
from kiln.memory.offload import parse_blocks
from kiln.memory.planner import PlanConfig
from kiln.models import PRESETS, ModelConfig
from kiln.models.lora import LoraConfig, check_run as check_lora
from kiln.models.values import refuse_replaced
from kiln.numerics import FaultsConfig, NumericsConfig
from kiln.perf.compile import compile_setting
from kiln.precision import PRECISIONS, mode as precision_mode
from kiln.train.checkpoint import CheckpointConfig
from kiln.train.logging import LogConfig
from kiln.train.loop import TrainConfig
from kiln.train.optim import OptimConfig
from kiln.train.precision import PrecisionConfig
from kiln.train.schedule import ScheduleConfig
from kiln.util import closest


class ConfigError(KilnError):
    pass


@dataclass
class Config:
    """The whole run's configuration, one typed field per section. Components receive only their own section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    numerics: NumericsConfig = field(default_factory=NumericsConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def to_dict(self) -> dict:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}


# Section name -> its dataclass, in Config's order: read from Config's fields, so there is one list.
SECTIONS: dict[str, type] = {f.name: typing.get_type_hints(Config)[f.name] for f in fields(Config)}
# Keys that moved, so an old config.toml or command line gets told where to.
MOVED = {"model.kernels": "train.kernels"}


def make_config(**sections) -> Config:
    """A Config instance; sections not given take their defaults."""
    return Config(**{name: sections[name] for name in SECTIONS if sections.get(name) is not None})


# ---------------------------------------------------------------- values and types


def _field_type(cls, name: str):
    return typing.get_type_hints(cls)[name]


def _allowed(tp) -> tuple[type, ...]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return tuple(t for arg in typing.get_args(tp) for t in _allowed(arg))
    if origin is not None:
        return (origin,)
    return (type(None),) if tp is type(None) else (tp,)


def _coerce(key: str, value, tp):
    """Check (TOML value) or convert (override string) `value` to the field's type."""
    allowed = _allowed(tp)
    if isinstance(value, str) and str not in allowed:
        value = _parse_string(key, value, allowed)
    if isinstance(value, bool) and bool not in allowed:
        raise ConfigError(f"{key} expects {_type_names(allowed)}, got the boolean {value}")
    if isinstance(value, int) and not isinstance(value, bool) and float in allowed and int not in allowed:
        value = float(value)
    if isinstance(value, list) and tuple in allowed:  # a TOML array
        value = tuple(value)
    if not isinstance(value, allowed):
        raise ConfigError(f"{key} expects {_type_names(allowed)}, got {value!r} ({type(value).__name__})")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}={value} is not a finite number; give a real value")
    return value


def _parse_string(key: str, text: str, allowed):
    if type(None) in allowed and text.lower() in ("none", "null"):
        return None
    if bool in allowed:
        if text.lower() in ("true", "1", "yes", "on"):
            return True
        if text.lower() in ("false", "0", "no", "off"):
            return False
    if int in allowed:
        try:
            return int(text.replace("_", ""))
        except ValueError:
            pass
    if float in allowed:
        try:
            return float(text)
        except ValueError:
            pass
    if tuple in allowed or list in allowed:
        try:
            return tuple(tomllib.loads(f"v = {text}")["v"])
        except (tomllib.TOMLDecodeError, TypeError):
            pass
    raise ConfigError(f"{key}={text!r} is not a valid {_type_names(allowed)}")


def _type_names(allowed) -> str:
    return " or ".join("none" if t is type(None) else t.__name__ for t in allowed)


# ---------------------------------------------------------------- loading


def _set(cfg: Config, section: str, key: str, value, origin: str) -> None:
    sections = SECTIONS
    if section not in sections:
        hint = closest(section, sections)
        raise ConfigError(
            f"unknown config section {section!r} ({origin})" + (f"; did you mean {hint!r}?" if hint else "")
            + f" Sections: {', '.join(sections)}"
        )
    cls = sections[section]
    names = [f.name for f in fields(cls)]
    if f"{section}.{key}" in MOVED:
        raise ConfigError(f"{section}.{key} ({origin}) is now {MOVED[f'{section}.{key}']}: a model's shape knows "
                          f"nothing of how it is run; rename the key")
    if key not in names:
        hint = closest(key, names)
        raise ConfigError(
            f"unknown config key {section}.{key} ({origin})"
            + (f"; did you mean {section}.{hint}?" if hint else f"; valid keys: {', '.join(names)}")
        )
    setattr(getattr(cfg, section), key, _coerce(f"{section}.{key}", value, _field_type(cls, key)))


def parse_override(text: str) -> tuple[str, str, str]:
    """'--optim.lr=3e-4' or 'optim.lr=3e-4' -> ('optim', 'lr', '3e-4')."""
    m = re.fullmatch(r"(?:--)?([A-Za-z_]\w*)\.([A-Za-z_]\w*)=(.*)", text)
    if not m:
        raise ConfigError(f"cannot read override {text!r}; write it as --section.key=value (e.g. --optim.lr=3e-4)")
    return m.group(1), m.group(2), m.group(3)


def load_config(path: str | Path | None = None, overrides: typing.Iterable[str] = ()) -> Config:
    """Defaults, then the TOML file, then the overrides; every section's own checks run at the end."""
    cfg = Config()
    if path is not None:
        path = Path(path)
        if path.is_dir():
            raise ConfigError(f"config file {path} is a directory; give a TOML file (or --resume {path} for a run)")
        if not path.is_file():
            hint = "; overrides are written --section.key=value" if "=" in str(path) else ""
            raise ConfigError(f"config file {path} does not exist{hint}")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path} is not valid TOML: {e}") from None
        except UnicodeDecodeError as e:  # binary bytes: a damaged file, or not a config at all
            raise ConfigError(f"{path} is not a TOML text file (byte {e.start} is not UTF-8: damaged, or not a "
                              f"config); give a TOML config file") from None
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(f"{path}: top-level key {section!r} must be a [section] table")
            for key, value in table.items():
                _set(cfg, section, key, value, str(path))
    given = {}  # model keys set on the command line: an explicit sentinel must not be replaced silently
    for text in overrides:
        section, key, value = parse_override(text)
        _set(cfg, section, key, value, "command line")
        if section == "model":
            given[key] = getattr(cfg.model, key)
        if (section, key) == ("precision", "mode"):  # a mode given now: what decided the recorded one is stale
            cfg.precision.decided_by = ""
    validate(cfg)
    try:
        refuse_replaced(cfg.model, given, PRESETS)
    except KilnError as e:
        raise ConfigError(e.message, **e.fields()) from e
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return cfg


def validate(cfg: Config) -> None:
    """Every section's own checks, then the rules that involve two sections (each message names the fix)."""
    try:
        for name in SECTIONS:
            check = getattr(getattr(cfg, name), "validate", None)
            if check is not None:
                check()
        _cross_checks(cfg)
    except ConfigError:
        raise
    except KilnError as e:  # a section's own check: the same key, value and fix, as a ConfigError
        raise ConfigError(e.message, **e.fields()) from e
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _cross_checks(cfg: Config) -> None:
    model = cfg.model.resolve()
    if cfg.data.records == "chat" and not cfg.model.init:  # else the run takes model.init's tokenizer and template
        chat_template_for(cfg.data)
    if cfg.data.seq_len > model.max_seq_len:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} exceeds model.max_seq_len={model.max_seq_len}; lower "
                          f"data.seq_len or raise model.max_seq_len")
    if cfg.train.kernels == "triton" and model.dropout > 0:
        raise ConfigError(f"train.kernels=triton runs attention in FlashAttention, which has no dropout, and "
                          f"model.dropout={model.dropout}; set --model.dropout=0, or --train.kernels=auto (keeps "
                          f"torch attention when there is dropout)")
    if cfg.train.kernels == "triton" and cfg.memory.chunked_loss:
        raise ConfigError("train.kernels=triton already fuses the LM head and cross-entropy (the logits never exist "
                          "at once); memory.chunked_loss would replace it: drop --memory.chunked_loss, or use "
                          "--train.kernels=torch")
    refused = document_mask_refusal(cfg.data, cfg.train.kernels, cfg.parallel.pp)
    if refused:
        raise ConfigError(refused[0], key="data.document_mask", value=cfg.data.document_mask, fix=refused[1])
    if cfg.parallel.tp > 1 and cfg.memory.chunked_loss:
        raise ConfigError(f"parallel.tp={cfg.parallel.tp} computes the loss on logits split over the vocabulary (1/tp "
                          f"of them per rank); memory.chunked_loss would need the whole head on each rank: drop "
                          f"--memory.chunked_loss")
    if cfg.lora.on and cfg.optim.name == "muon":  # found before the data (build_optimizer would, after it)
        raise ConfigError(f"optim.name=muon orthogonalises the hidden matrices, and lora.rank={cfg.lora.rank} freezes "
                          f"them and trains adapters only, which go to AdamW: use --optim.name=adamw with lora")
    if cfg.faults.any and compile_setting(cfg.train.compile) == "true":
        raise ConfigError("faults.* hook the eager model's modules, which torch.compile bypasses; set "
                          "--train.compile=false to inject faults")
    parse_blocks(cfg.memory.offload_blocks, model.n_layer)
    fp8 = cfg.precision.mode in PRECISIONS and precision_mode(cfg.precision.mode).fp8  # auto is never fp8
    check_lora(cfg.lora, tp=cfg.parallel.tp, pp=cfg.parallel.pp, fp8=fp8)
    data = strategy(cfg.parallel.strategy)
    refused = data.refusal(optim_offload=cfg.optim.offload, precision=cfg.precision.mode, optimizer=cfg.optim.name,
                           tp=cfg.parallel.tp)  # muon with tp too: the planner asks the same table
    if refused:
        raise ConfigError(refused)
    if data.reduces and cfg.plan.memory:
        raise ConfigError("plan.memory plans one device; with parallel.strategy set, choose the levers yourself "
                          "(kiln plan predicts one rank of DDP only so far)")
    if cfg.plan.memory and cfg.plan.global_batch_tokens % cfg.data.seq_len:
        raise ConfigError(f"plan.global_batch_tokens={cfg.plan.global_batch_tokens} is not a multiple of "
                          f"data.seq_len={cfg.data.seq_len}")


def checked(cfg: Config) -> Config:
    """A copy of cfg (sections replaced in code, e.g. a planner's Choice.on) through the checks a loaded config
    passes; a ConfigError names the key and the fix."""
    out = copy.deepcopy(cfg)
    validate(out)
    return out


def apply_overrides(cfg: Config, overrides: dict[str, object]) -> Config:
    """A copy of cfg with {"section.key": value} set through the same coercion and checks as the command line."""
    out = copy.deepcopy(cfg)
    for key, value in overrides.items():
        section, _, name = key.partition(".")
        _set(out, section, name, value, "override")
    validate(out)
    return out


# ---------------------------------------------------------------- writing and help


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} to TOML")


def to_toml(cfg: Config) -> str:
    lines = []
    for name, table in cfg.to_dict().items():
        lines.append(f"[{name}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in table.items() if value is not None
                  and not _is_tables(value)]
        lines.append("")
        for key, value in table.items():  # arrays of tables ([[data.mix]]) after their section's plain keys
            if _is_tables(value):
                for entry in value:
                    lines += [f"[[{name}.{key}]]", *(f"{k} = {_toml_value(v)}" for k, v in entry.items()), ""]
    return "\n".join(lines)


def _is_tables(value) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, dict) for v in value)


@functools.cache  # inspect.getsource parses the module: 13 sections cost ~0.15 s each time the parser is built
def field_help(cls) -> dict[str, str]:
    """{field: description} from the `# comment` after each field in the dataclass source, continued by the
    comment-only lines right below it (joined: a long comment is one description, never its first line alone);
    a field whose help is computed (from the table its code dispatches on) gives it as metadata={"help": ...}."""
    helps = {f.name: f.metadata["help"] for f in fields(cls) if "help" in f.metadata}
    computed = set(helps)
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return helps
    last = None  # the field whose comment the next comment-only line continues
    for line in source.splitlines():
        m = re.match(r"\s+(\w+)\s*:\s*[^=#]+=.*?#\s*(.+)$", line)
        more = re.match(r"\s+#\s*(.+)$", line)
        if m:
            last = m.group(1)
            helps.setdefault(last, m.group(2).strip())
        elif more and last is not None and last not in computed:
            helps[last] += " " + more.group(1).strip()
        else:
            last = None
    return helps


def describe() -> str:
    """Every key with its default and a one-line description, for `kiln train --help`."""
    out = []
    for name, cls in SECTIONS.items():
        out.append(f"[{name}]")
        helps = field_help(cls)
        default = cls()
        for f in fields(cls):
            value = getattr(default, f.name)
            shown = "(preset)" if value in (0, "", None) and name == "model" and f.name != "dropout" else _show(value)
            out.append(f"  --{name}.{f.name}={shown}  {helps.get(f.name, '')}".rstrip())
    return "\n".join(out)


def _show(value) -> str:
    return _toml_value(value).strip('"') if value is not None else "none"
