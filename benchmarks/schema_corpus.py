"""A corpus of JSON schemas for structured output: the tests constrain the demo model with
every one of them (each output must validate), and `kvray bench grammar` times their
compilation.

Shapes users send: flat records, nested objects, enums and consts, arrays with bounds,
anyOf / oneOf unions, integers and numbers with ranges, string lengths and patterns,
`$defs` references, nullable fields. Strings, arrays and the digits of numbers (`multipleOf`)
are bounded so that even a small model's greedy output ends within a few dozen tokens.
"""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]


def _obj(properties: dict[str, Any], required: list[str] | None = None, **extra: Any) -> Schema:
    """An object schema; every property required unless `required` says otherwise."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
        **extra,
    }


_NAME = {"type": "string", "minLength": 1, "maxLength": 12}
_SHORT = {"type": "string", "maxLength": 16}
_AGE = {"type": "integer", "minimum": 0, "maximum": 120}
_FLAG = {"type": "boolean"}
_COLOR = {"enum": ["red", "green", "blue"]}

SCHEMAS: dict[str, Schema] = {
    "person": _obj({"name": _NAME, "age": _AGE}),
    "flag": _obj({"ok": _FLAG}),
    "color": _obj({"color": _COLOR}),
    "const_version": _obj({"version": {"const": 2}, "name": _NAME}),
    "score_range": _obj({"score": {"type": "integer", "minimum": 1, "maximum": 5}}),
    "negative_range": _obj({"delta": {"type": "integer", "minimum": -50, "maximum": -10}}),
    "exclusive_range": _obj(
        {"level": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}}
    ),
    "probability": _obj({"p": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.01}}),
    "temperature": _obj(
        {"celsius": {"type": "number", "minimum": -40, "maximum": 60, "multipleOf": 0.5}}
    ),
    "tags": _obj({"tags": {"type": "array", "items": _SHORT, "minItems": 1, "maxItems": 3}}),
    "fixed_pair": _obj({"pair": {"type": "array", "items": _AGE, "minItems": 2, "maxItems": 2}}),
    "empty_or_short_list": _obj(
        {
            "ids": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "maxItems": 2,
            }
        }
    ),
    "tuple": _obj(
        {
            "point": {
                "type": "array",
                "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 99}, _COLOR],
                "items": False,
                "minItems": 2,
            }
        }
    ),
    "nested_address": _obj(
        {
            "name": _NAME,
            "address": _obj({"city": _NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
        }
    ),
    "deep_nesting": _obj({"a": _obj({"b": _obj({"c": _obj({"d": _FLAG})})})}),
    "array_of_objects": _obj(
        {
            "items": {
                "type": "array",
                "items": _obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}$"}, "qty": _AGE}),
                "minItems": 1,
                "maxItems": 2,
            }
        }
    ),
    "matrix": _obj(
        {
            "rows": {
                "type": "array",
                "items": {"type": "array", "items": {"enum": [0, 1]}, "minItems": 2, "maxItems": 2},
                "minItems": 2,
                "maxItems": 2,
            }
        }
    ),
    "any_of_scalar": _obj(
        {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, _FLAG]}}
    ),
    "any_of_objects": _obj(
        {
            "shape": {
                "anyOf": [
                    _obj(
                        {
                            "kind": {"const": "circle"},
                            "r": {"type": "integer", "minimum": 1, "maximum": 9},
                        }
                    ),
                    _obj(
                        {
                            "kind": {"const": "square"},
                            "side": {"type": "integer", "minimum": 1, "maximum": 9},
                        }
                    ),
                ]
            }
        }
    ),
    "one_of": _obj(
        {
            "id": {
                "oneOf": [
                    {"type": "integer", "minimum": 0, "maximum": 999},
                    {"type": "string", "pattern": "^id-[a-z]{2}$"},
                ]
            }
        }
    ),
    "nullable": _obj({"nickname": {"anyOf": [_NAME, {"type": "null"}]}}),
    "type_list": _obj({"count": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}}),
    "optional_fields": _obj({"name": _NAME, "email": _SHORT, "age": _AGE}, required=["name"]),
    "no_required": _obj({"x": _FLAG, "y": _FLAG}, required=[]),
    "pattern_date": _obj(
        {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}
    ),
    "pattern_hex": _obj({"rgb": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}),
    "string_lengths": _obj({"code": {"type": "string", "minLength": 3, "maxLength": 3}}),
    "enum_mixed": _obj({"answer": {"enum": ["yes", "no", 0, 1, None]}}),
    "enum_array": _obj(
        {
            "days": {
                "type": "array",
                "items": {"enum": ["mon", "tue", "wed", "thu", "fri"]},
                "minItems": 1,
                "maxItems": 3,
            }
        }
    ),
    "defs_ref": {
        "$defs": {
            "item": _obj({"name": _NAME, "price": {"type": "integer", "minimum": 1, "maximum": 99}})
        },
        **_obj({"first": {"$ref": "#/$defs/item"}, "second": {"$ref": "#/$defs/item"}}),
    },
    "order": _obj(
        {
            "order_id": {"type": "integer", "minimum": 1, "maximum": 9999},
            "status": {"enum": ["pending", "shipped", "delivered"]},
            "lines": {
                "type": "array",
                "items": _obj(
                    {
                        "sku": {"type": "string", "pattern": "^[a-z]{2}[0-9]$"},
                        "n": {"type": "integer", "minimum": 1, "maximum": 9},
                    }
                ),
                "minItems": 1,
                "maxItems": 2,
            },
            "gift": _FLAG,
        }
    ),
    "event": _obj(
        {
            "title": _NAME,
            "when": _obj(
                {
                    "day": {"type": "integer", "minimum": 1, "maximum": 31},
                    "month": {"type": "integer", "minimum": 1, "maximum": 12},
                }
            ),
            "priority": {"enum": ["low", "high"]},
        }
    ),
    "weather_call": _obj(
        {
            "name": {"const": "get_weather"},
            "arguments": _obj({"city": _NAME, "unit": {"enum": ["c", "f"]}}),
        }
    ),
    "sentiment": _obj(
        {
            "label": {"enum": ["positive", "negative", "neutral"]},
            "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
        }
    ),
    "key_values": {
        "type": "object",
        "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9},
        "maxProperties": 2,
    },
    "plain_string": {"type": "string", "maxLength": 10},
    "plain_integer": {"type": "integer", "minimum": 10, "maximum": 20},
    "plain_enum_array": {"type": "array", "items": _COLOR, "minItems": 1, "maxItems": 2},
}


# For throughput benchmarks: a JSON array whose EOS stays masked for 100,000 items of
# bounded objects, so a constrained request runs to its max_tokens like an `ignore_eos` one
# while its masks walk through keys, integers, strings and enums.
ENDLESS: Schema = {
    "type": "array",
    "minItems": 100_000,
    "items": _obj(
        {
            "id": {"type": "integer", "minimum": 0, "maximum": 9999},
            "name": {"type": "string", "maxLength": 16},
            "tags": {"type": "array", "items": _COLOR, "maxItems": 3},
            "ok": _FLAG,
        }
    ),
}
