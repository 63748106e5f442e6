"""The metric names a PromQL expression reads, and the names a Prometheus `/metrics` exposes, so
that a dashboard's queries can be checked against what the fleet exports (the Grafana dashboard,
deploy/grafana/dashboards/kvfleet.json).

The tokenizer is small, not a PromQL parser: it drops strings, label matchers `{...}`, ranges
and subqueries `[...]`, Grafana's `$variables`, and the label lists of `by`, `without`, `on`,
`ignoring`, `group_left` and `group_right`; of the identifiers left, one followed by `(` is a
function or an aggregation, the operators' keywords are keywords, and every other one is a metric
name."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

# Series Prometheus writes itself for every target it scrapes: not the fleet's to export.
PROMETHEUS_OWN = frozenset({"up", "scrape_duration_seconds", "scrape_samples_scraped",
                            "scrape_samples_post_metric_relabeling", "scrape_series_added"})
KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "bool",
                      "and", "or", "unless", "offset", "Inf", "NaN", "inf", "nan"})
_STRINGS = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_TOKENS = re.compile(r"(?P<var>\$\{[^}]*\}|\$\w+)"
                     r"|(?P<num>(?:0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)"
                     r"(?:ms|[smhdwy])*)"
                     r"|(?P<id>[A-Za-z_:][A-Za-z0-9_:]*)(?P<call>\s*\()?"
                     r"|(?P<other>\S)")
_NAME = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """The metric names `expr` selects."""
    text = _STRINGS.sub('""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = _GROUPING.sub(" ", text)
    names = set()
    for token in _TOKENS.finditer(text):
        name = token["id"]
        if name and not token["call"] and name not in KEYWORDS:
            names.add(name)
    return names


def exported_names(exposition: str) -> set[str]:
    """The series names a `/metrics` text (Prometheus 0.0.4 or OpenMetrics) lets a query select:
    every sample's name, and from each `# TYPE` line what that type exposes: a histogram's
    `_bucket`, `_sum` and `_count` (never its bare name), a counter's `_total`, a summary's
    quantiles, `_sum` and `_count`, any other type's name. A family with labels and no series yet
    (no adapter loaded, no handoff made) is exported by its `# TYPE` line."""
    names = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            if kind in ("histogram", "gaugehistogram"):
                names |= {name + "_bucket", name + "_sum", name + "_count"}
            elif kind == "summary":
                names |= {name, name + "_sum", name + "_count"}
            elif kind == "counter":
                names.add(name if name.endswith("_total") else name + "_total")
            else:
                names.add(name)
        elif line and not line.startswith("#"):
            names.add(_NAME.match(line)[0])
    return names


def dashboard_queries(dashboard: dict) -> Iterator[tuple[str, str]]:
    """(where, expression) of every query of a Grafana dashboard: its panels' targets (rows'
    nested panels included) and its query variables."""
    def panels(items: Iterable[dict]) -> Iterator[dict]:
        for panel in items:
            yield panel
            yield from panels(panel.get("panels") or [])

    for panel in panels(dashboard.get("panels") or []):
        for target in panel.get("targets") or []:
            if target.get("expr"):
                yield f"panel {panel.get('title')!r} query {target.get('refId')}", target["expr"]
    for variable in (dashboard.get("templating") or {}).get("list") or []:
        query = variable.get("query")
        query = query.get("query") if isinstance(query, dict) else query
        if variable.get("type") == "query" and query:
            inner = re.fullmatch(r"\s*label_values\((.*),\s*\w+\)\s*", query)
            yield f"variable {variable.get('name')!r}", inner[1] if inner else query


def dashboard_gaps(dashboard: dict, exported: set[str]) -> list[str]:
    """One line per query naming a metric that neither the fleet exports nor Prometheus writes:
    where it is, the expression and the missing names."""
    gaps = []
    for where, expr in dashboard_queries(dashboard):
        missing = metric_names(expr) - exported - PROMETHEUS_OWN
        if missing:
            gaps.append(f"{where}: {expr!r} names {', '.join(sorted(missing))}, "
                        "which no /metrics exports")
    return gaps
