"""Loading and saving the trainer's configuration: TOML files plus `section.field=value` overrides (see
grpo_kernels/train/config/__init__.py for the sections and the format)."""

from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from dataclasses import MISSING, fields

from ...files import write_atomic
from . import TrainConfig, section_classes
from .schema import field_types, parse_value
from .task import resolve_spec


def _lookup(section: str, name: str | None):
    """The annotation of `section.name` (name None: the top-level key `section`); ValueError listing valid names."""
    sections = section_classes()
    if name is None:
        if section == "seed":
            return int
        if section in sections:
            raise ValueError(f"{section} is a section: set its fields as {section}.field=value")
        raise ValueError(f"unknown section or key {section!r}; valid sections: {', '.join(sections)}; top-level: seed")
    if section not in sections:
        raise ValueError(f"unknown section {section!r}; valid sections: {', '.join(sections)}")
    types_ = field_types(sections[section])
    if name not in types_:
        raise ValueError(f"unknown field {section}.{name}; valid fields of [{section}]: {', '.join(types_)}")
    return types_[name]


def _read_toml(path) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ValueError(f"cannot read config {path}: {exc.strerror or exc}") from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"invalid TOML in config {path}: {exc}") from exc


def _override_items(overrides) -> list[tuple[str, object]]:
    """(key, value) pairs from "--section.field=value" strings or a dict (flat keys or {section: {field: value}})."""
    if overrides is None:
        return []
    if isinstance(overrides, dict):
        items = []
        for key, value in overrides.items():
            if key in section_classes() and isinstance(value, dict):
                items += [(f"{key}.{k}", v) for k, v in value.items()]
            else:
                items.append((key, value))
        return items
    items = []
    for text in overrides:
        key, sep, value = str(text).lstrip("-").partition("=")
        if not sep:
            raise ValueError(f"override {text!r} must look like section.field=value")
        items.append((key.strip(), value))
    return items


def load_config(path: str | Path | None = None, overrides: list[str] | dict | None = None) -> TrainConfig:
    """The defaults, updated by the TOML file at `path`, then by `overrides` (applied in order); validated."""
    top: dict = {}
    values: dict = {name: {} for name in section_classes()}
    if path is not None:
        for key, table in _read_toml(path).items():
            if key not in values:
                _lookup(key, None)  # ValueError unless a top-level key
                top[key] = table
            elif not isinstance(table, dict):
                raise ValueError(f"{key} in {path} must be a table ([{key}]), got {table!r}")
            else:
                for name, value in table.items():
                    _lookup(key, name)
                    values[key][name] = _resolved(key, name, value, Path(path).parent)
    for key, value in _override_items(overrides):
        section, dot, name = key.partition(".")
        tp = _lookup(section, name if dot else None)
        if isinstance(value, str):
            value = parse_value(key, tp, value)
        (values[section] if dot else top)[name if dot else section] = _resolved(section, name, value, Path.cwd())
    return TrainConfig(**top, **{name: cls(**values[name]) for name, cls in section_classes().items()})


def _resolved(section: str, name: str, value, base: Path):
    """task.reward_funcs with relative file paths made absolute against base (the config file's folder, or the
    working directory for an override), so that a saved config names the same files from anywhere."""
    if section == "task" and name == "reward_funcs" and isinstance(value, (list, tuple)):
        return [resolve_spec(v, base) if isinstance(v, str) else v for v in value]
    return value


def to_dict(config: TrainConfig) -> dict:
    """{"seed": ..., section: {field: value}} with every field (None included); tuples become lists."""
    out: dict = {"seed": config.seed}
    for name in section_classes():
        section, table = getattr(config, name), {}
        for key in field_types(type(section)):
            value = getattr(section, key)
            table[key] = list(value) if isinstance(value, tuple) else value
        out[name] = table
    return out


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # finite (validated); repr round-trips a float exactly
    if isinstance(value, str):
        return '"' + "".join(_ESCAPES.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 32 or ord(c) == 127 else c)
                             for c in value) + '"'  # fmt: skip
    return "[" + ", ".join(_toml_value(v) for v in value) + "]"


def _default(f):
    return f.default_factory() if f.default is MISSING else f.default


def save_config(config: TrainConfig, path: str | Path) -> None:
    """Write config as TOML (creating the parent directory); `load_config(path)` gives back an equal config.
    A None field is left out when its default is None and written as "none" otherwise."""
    data = to_dict(config)
    lines = [f"seed = {_toml_value(data.pop('seed'))}"]
    for name, table in data.items():
        defaults = {f.name: _default(f) for f in fields(section_classes()[name])}
        lines += ["", f"[{name}]"]
        for key, value in table.items():
            if value is None and defaults[key] is None:
                continue
            lines.append(f"{key} = {_toml_value('none' if value is None else value)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, "\n".join(lines) + "\n")


def field_docs(cls) -> dict[str, str]:
    """{field: its docstring} of a config dataclass, read from the source (the string literal under each field, as
    tyro and the API pages read them); LossConfig's fields are documented on LossOptions."""
    import ast
    import inspect

    from ...options import LossOptions
    from . import LossConfig

    source = LossOptions if cls is LossConfig else cls
    body = ast.parse(inspect.cleandoc("\n" + inspect.getsource(source))).body[0].body
    docs = {}
    for node, after in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):  # fmt: skip
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def describe(section: str | None = None) -> str:
    """Every option (or one section's) as `--section.field=TYPE (default: X)` and its docstring: what
    `grpo-kernels train --help-config [SECTION]` prints. ValueError listing the sections for an unknown one."""
    import textwrap

    from .schema import describe_type

    sections = section_classes()
    if section is not None and section not in sections:
        raise ValueError(f"unknown section {section!r}; valid sections: {', '.join(sections)}")
    out = ["--seed=<an int> (default: 0): the run's seed"] if section is None else []
    for name, cls in sections.items():
        if section not in (None, name):
            continue
        docs, defaults = field_docs(cls), {f.name: _default(f) for f in fields(cls)}
        out.append(f"\n[{name}]")
        for field_name, tp in field_types(cls).items():
            default = "none" if defaults[field_name] is None else _toml_value(defaults[field_name])
            out.append(f"  --{name}.{field_name}=<{describe_type(tp)}> (default: {default})")
            doc = docs.get(field_name, "")
            out += textwrap.wrap(doc, width=116, initial_indent="      ", subsequent_indent="      ") if doc else []
    return "\n".join(out).lstrip("\n") + "\n"
