"""The metric names a PromQL expression selects, and the series names a Prometheus registry exports: enough of
PromQL to check a dashboard's and a rules file's queries against what dyn's processes actually serve."""

from __future__ import annotations

import re
from collections.abc import Iterable

from prometheus_client import CollectorRegistry

_TOKEN = re.compile(
    r"""
    "(?:\\.|[^"\\])*" | '(?:\\.|[^'\\])*' | `[^`]*`      # strings
    | \{(?:"(?:\\.|[^"\\])*"|[^}"])*\}                  # label matchers (label names, values)
    | \[[^\]]*\]                                        # range and subquery windows
    | \d+(?:\.\d+)?(?:[eE][+-]?\d+)?[a-z]*              # numbers and durations (5m, 1e9)
    | [A-Za-z_:][A-Za-z0-9_:]*                          # identifiers
    | \S                                                # operators, parentheses, commas
    """,
    re.VERBOSE,
)
_AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk"}
_AGGREGATIONS |= {"quantile", "limitk", "limit_ratio"}
_GROUPINGS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_KEYWORDS = {"bool", "and", "or", "unless", "offset", "atan2", "inf", "nan", "start", "end"}


def metric_names(expr: str) -> set[str]:
    """Every metric name `expr` selects: identifiers that are not functions, aggregations, keywords, or the
    label lists of `by (...)`/`on (...)` and the like."""
    tokens = _TOKEN.findall(expr)
    names, i = set(), 0
    while i < len(tokens):
        token, following = tokens[i], tokens[i + 1] if i + 1 < len(tokens) else ""
        if token in _GROUPINGS:
            i = _after_parentheses(tokens, i + 1) if following == "(" else i + 1
            continue
        if _is_identifier(token) and following != "(" and token not in _AGGREGATIONS | _KEYWORDS:
            names.add(token)
        i += 1
    return names


def _is_identifier(token: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z_:][A-Za-z0-9_:]*", token))


def _after_parentheses(tokens: list[str], start: int) -> int:
    """The index after the `)` that closes the `(` at `start`."""
    depth = 0
    for i in range(start, len(tokens)):
        depth += {"(": 1, ")": -1}.get(tokens[i], 0)
        if depth == 0:
            return i + 1
    raise ValueError(f"unbalanced parentheses in {' '.join(tokens)}")


_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "summary": ("", "_sum", "_count"),
    "info": ("_info",),
}


def exported_series(registries: Iterable[CollectorRegistry]) -> set[str]:
    """The sample names the registries' families expose (`x_total` of counter `x`, `_bucket/_sum/_count` of a
    histogram), read from their metadata, so a family that has no sample yet counts too."""
    names = set()
    for registry in registries:
        for family in registry.collect():
            names |= {family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",))}
    return names
