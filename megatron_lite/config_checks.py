"""Validation as tables: a config's checks listed field by field, in the order they run, and walked by one
function.

    RULES = (
        ("weight_decay", (Check(lambda v: v >= 0, "{name} must be >= 0, got {value}"),)),
        (("adam_beta1", "adam_beta2"), (Check(lambda v: 0 <= v < 1, "{name} must be in [0, 1), got {value}"),)),
        ("bucket_size", (Check(lambda v: v is None or is_int(v), "{name} must be an int, got {value!r}", TypeError),
                         Check(lambda v: v is None or v > 0, "{name} must be positive, got {value}"))),
        (None, (Check(lambda c: not (c.fp16 and c.bf16), "fp16 and bf16 are mutually exclusive"),)),
    )
    check_fields(config, RULES)       # raises the first check that does not hold

An entry names a field, whose checks get its value, or several (each gets all the checks in turn), or
None: rules across fields, whose checks get the whole config. The message is str.format'ed with `name` (the
field), `value`, `flag` (the field spelled as a command-line flag, for argparse namespaces) and `config`.
The configs of distributed/, optimizer/ and training/ use it; it imports nothing of the project
(models/gpt.py, which imports torch only, walks its own table the same way). A message that spells a constant
with an f-string doubles the braces it leaves to format: f"{{name}} must be one of {sorted(CHOICES)}, got {{value}}".
"""

from typing import Any, Callable, NamedTuple, Sequence, Tuple, Union


class Check(NamedTuple):
    """One rule and what breaking it raises."""

    holds: Callable[[Any], bool]
    """Called with the field's value (or with the config, for a rule across fields); False raises."""

    message: str
    """str.format'ed with name, value, flag and config."""

    error: type = ValueError
    """ValueError for a bad value, TypeError for a value of the wrong type."""


Rules = Sequence[Tuple[Union[None, str, Tuple[str, ...]], Sequence[Check]]]


def is_int(value) -> bool:
    """An int that is not a bool (True is an int to Python, not a count to a config)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_fields(config, rules: Rules) -> None:
    """Run `rules` in order on `config`'s attributes; raise the first check that does not hold."""
    for names, checks in rules:
        for name in (names,) if names is None or isinstance(names, str) else names:
            value = config if name is None else getattr(config, name)
            for check in checks:
                if not check.holds(value):
                    flag = None if name is None else "--" + name.replace("_", "-")
                    raise check.error(check.message.format(name=name, value=value, flag=flag, config=config))
