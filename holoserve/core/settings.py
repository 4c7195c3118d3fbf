"""The one parser for settings given as text (`--set FIELD=VALUE`, HOLOSERVE_* environment variables).

Strict: a value that is not exactly of the field's type is refused, never coerced. "ture" is not a
boolean, "1.7" is not an integer, "nan" is not a usable number.
"""
from __future__ import annotations

import math
import types
import typing
from typing import Any

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


def field_types(cls: type) -> dict[str, Any]:
    """A dataclass's field types, resolved (the modules use `from __future__ import annotations`)."""
    return typing.get_type_hints(cls)


def parse_setting(raw: str, typ: Any) -> Any:
    """`raw` as a value of type `typ` (bool, int, float, str, or X | None); ValueError says what is expected."""
    text = raw.strip()
    args = typing.get_args(typ)
    if typing.get_origin(typ) in (typing.Union, types.UnionType) and type(None) in args:
        if text.lower() == "none":
            return None
        (typ,) = [a for a in args if a is not type(None)]
    if typ is bool:
        low = text.lower()
        if low in TRUE:
            return True
        if low in FALSE:
            return False
        raise ValueError(f"expected a boolean ({'/'.join(TRUE)} or {'/'.join(FALSE)})")
    if typ is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError("expected an integer") from None
    if typ is float:
        try:
            value = float(text)
        except ValueError:
            raise ValueError("expected a number") from None
        if not math.isfinite(value):
            raise ValueError("expected a finite number")
        return value
    if typ is str:
        return raw
    raise ValueError(f"settings of type {typ} cannot be given as text")
