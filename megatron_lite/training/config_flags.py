"""Command-line flags generated from config dataclasses: the field's type and default make the flag, its
attribute docstring is the help, and the config's own ValueError comes back with field names rewritten
as the flags that set them. Used by pretrain_gpt.py's arguments and by examples/train_ddp_cpu.py.
"""

import ast
import dataclasses
import inspect
import re
import textwrap
import typing
from typing import Dict, Optional


def field_docs(config_cls) -> Dict[str, str]:
    """The attribute docstrings of a dataclass (the string literal under each field), one line each."""
    body = ast.parse(textwrap.dedent(inspect.getsource(config_cls))).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")  # argparse's attribute name: Megatron's args.<name>


def add_config_arguments(group, config_cls, flags: Dict[str, str], defaults: Optional[dict] = None,
                         **extra: dict):
    """One argparse flag per entry of `flags` (field -> flag), typed after the field, with the field's
    docstring as help. `defaults` overrides the dataclass defaults; `extra[field]` adds argparse kwargs."""
    docs, hints = field_docs(config_cls), typing.get_type_hints(config_cls)
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    for name, flag in flags.items():
        kind = hints[name]
        kind = next((a for a in typing.get_args(kind) if a is not type(None)), kind)  # Optional[X] -> X
        default = (defaults or {}).get(name, fields[name].default)
        default = None if default is dataclasses.MISSING else default
        kwargs = dict(action="store_true") if kind is bool else dict(type=kind, default=default)
        kwargs["help"] = docs.get(name, "").replace("%", "%%")
        group.add_argument(flag, **{**kwargs, **extra.get(name, {})})


def config_from_args(config_cls, flags: Dict[str, str], args, **fields):
    """Build `config_cls` from the parsed flags (fields whose flag this parser lacks keep their default)."""
    values = {name: getattr(args, _dest(flag)) for name, flag in flags.items() if hasattr(args, _dest(flag))}
    return config_cls(**{**values, **fields})


def rewrite_field_names(text: str, flags: Dict[str, str]) -> str:
    """`text` with every field name of `flags` (field -> flag) replaced by its flag, with the config class
    before it ('OptimizerConfig.weight_decay' -> '--weight-decay') and '=True' after it dropped. A quoted
    name is a value or a dict key ("optimizer_kwargs must not hold 'lr'"), not the field: left as it is."""
    names = "|".join(sorted(flags, key=len, reverse=True))
    return re.sub(rf"(?<![-\w'])(?:[A-Z]\w*Config\.)?({names})(?![-\w'])(=True\b)?", lambda m: flags[m.group(1)],
                  text)
