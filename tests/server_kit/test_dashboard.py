"""The shipped Grafana dashboard and Prometheus configuration against the metrics catalogue.

``deploy/grafana/fedsketch.json`` may query only series that FedSketch exports
(:func:`server_kit.watch.names.exported_names`): every metric name in every
panel's PromQL is checked against the catalogue, and the dashboard must cover
the figures an operator watches. ``deploy/prometheus.yml`` must parse and, where
promtool is installed, pass ``promtool check config``. No network.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from server_kit.watch.names import (
    AGGREGATOR_METRICS,
    PROCESS_METRICS,
    SERVER_METRICS,
    exported_names,
)

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "fedsketch.json"
PROMETHEUS = DEPLOY / "prometheus.yml"

FUNCTIONS = frozenset("""
    abs absent absent_over_time acos acosh asin asinh atan atanh avg_over_time ceil changes clamp clamp_max
    clamp_min cos cosh count_over_time day_of_month day_of_week day_of_year days_in_month deg delta deriv
    double_exponential_smoothing exp floor histogram_avg histogram_count histogram_fraction histogram_quantile
    histogram_stddev histogram_stdvar histogram_sum holt_winters hour idelta increase info irate label_join
    label_replace last_over_time ln log10 log2 mad_over_time max_over_time min_over_time minute month pi
    predict_linear present_over_time quantile_over_time rad rate resets round scalar sgn sin sinh sort
    sort_by_label sort_by_label_desc sort_desc sqrt stddev_over_time stdvar_over_time sum_over_time tan tanh
    time timestamp vector year start end
""".split())
AGGREGATIONS = frozenset("""
    sum min max avg group stddev stdvar count count_values bottomk topk quantile limitk limit_ratio
""".split())
KEYWORDS = frozenset("""
    by without on ignoring group_left group_right bool and or unless offset atan2 inf nan
""".split())

_STRINGS = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGES = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", re.IGNORECASE)
_VARIABLES = re.compile(r"\$\{[^}]*\}|\$\w+")
# a number or duration (0.9, 1e3, 0x1f, 5m, 1h30m) is one token, so its letters are not taken for a name
_TOKENS = re.compile(r"[0-9][0-9a-zA-Z_.]*|[a-zA-Z_:][a-zA-Z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: its identifiers less functions, keywords and labels."""
    text = _STRINGS.sub(" ", expr)
    text = _MATCHERS.sub(" ", text)
    text = _RANGES.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    text = _VARIABLES.sub(" ", text)
    names = set()
    for token in _TOKENS.findall(text):
        if token[0].isdigit() or token in FUNCTIONS:
            continue
        if token.lower() in AGGREGATIONS or token.lower() in KEYWORDS:
            continue
        names.add(token)
    return names


def query_panels(dashboard: dict) -> list[dict]:
    """Every panel that queries (rows are containers: the panels of a collapsed row count)."""
    found = []
    for panel in dashboard["panels"]:
        if panel.get("type") == "row":
            found.extend(panel.get("panels", []))
        else:
            found.append(panel)
    return found


def unknown_metrics(dashboard: dict) -> list[str]:
    """One line per metric a panel queries that FedSketch does not export."""
    exported = exported_names()
    return [f"panel {panel.get('title')!r} queries {name!r}, which is not in exported_names()"
            for panel in query_panels(dashboard)
            for target in panel.get("targets", [])
            for name in sorted(metric_names(target.get("expr", "")) - exported)]


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_the_parser_keeps_metrics_and_drops_functions_labels_strings_and_durations():
    expr = ('histogram_quantile(0.9, sum by (le) (rate(fedsketch_round_duration_seconds_bucket'
            '{job="fedsketch-server", reason=~"goal|cap"}[5m] offset 1h))) > bool 3e1 '
            'and on (instance) sum without (kind) (increase(fedsketch_messages_total[$__rate_interval]))')
    assert metric_names(expr) == {"fedsketch_round_duration_seconds_bucket", "fedsketch_messages_total"}


def test_a_made_up_metric_is_caught():
    bad = {"panels": [{"type": "timeseries", "title": "Typo", "targets": [
        {"expr": 'sum by (reason) (rate(fedsketch_messages_refused_total{reason="schema"}[5m]))'}]}]}
    assert unknown_metrics(bad) == [
        "panel 'Typo' queries 'fedsketch_messages_refused_total', which is not in exported_names()"]


def test_the_dashboard_is_importable(dashboard):
    assert dashboard["uid"] == "fedsketch"
    assert dashboard["title"] == "FedSketch fleet"
    assert dashboard["schemaVersion"] == 39
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    for panel in query_panels(dashboard):
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]


def test_every_panel_queries_only_exported_metrics(dashboard):
    panels = query_panels(dashboard)
    assert panels
    for panel in panels:
        assert panel.get("targets"), f"panel {panel.get('title')!r} has no query"
        for target in panel["targets"]:
            expr = target.get("expr", "")
            assert expr.strip(), f"panel {panel.get('title')!r} has an empty expr"
            assert "__name__" not in expr, f"panel {panel.get('title')!r}: a name in a matcher is not checked"
            assert metric_names(expr), f"panel {panel.get('title')!r} queries no metric: {expr}"
    for row in dashboard["panels"]:
        if row.get("type") == "row":
            assert not row.get("targets"), f"row {row.get('title')!r} has queries"
    assert unknown_metrics(dashboard) == []


def test_the_dashboard_covers_what_an_operator_watches(dashboard):
    process = {s.name: s for s in PROCESS_METRICS}
    wanted = {key: SERVER_METRICS[key] for key in (
        "run_phase", "round", "devices", "round_devices", "rounds_closed", "round_duration_seconds",
        "round_goal_seconds", "messages_rejected", "updates_refused", "message_bytes", "accuracy", "loss",
        "devices_throttled", "device_cpu_temperature_celsius")}
    wanted["aggregator receipts"] = AGGREGATOR_METRICS["receipts"]
    wanted["process_cpu_seconds"] = process["process_cpu_seconds"]
    wanted["process_resident_memory_bytes"] = process["process_resident_memory_bytes"]
    used = {name for panel in query_panels(dashboard) for target in panel["targets"]
            for name in metric_names(target["expr"])}
    missing = [key for key, spec in wanted.items() if not used & set(spec.exposed)]
    assert missing == [], f"no panel shows {missing}"


def test_the_dashboard_queries_parse_as_promql(dashboard, tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt install prometheus)")
    rules = [{"record": f"fedsketch:check_{i}",
              "expr": target["expr"].replace("$__rate_interval", "5m").replace("$__interval", "1m")}
             for i, target in enumerate(t for p in query_panels(dashboard) for t in p["targets"])]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    run = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr


def test_prometheus_scrapes_the_server_on_9464():
    config = yaml.safe_load(PROMETHEUS.read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) >= {"fedsketch-server", "fedsketch-aggregators"}
    server = [t for c in jobs["fedsketch-server"]["static_configs"] for t in c["targets"]]
    assert server == ["127.0.0.1:9464"]
    workers = {t for c in jobs["fedsketch-aggregators"]["static_configs"] for t in c["targets"]}
    assert {f"127.0.0.1:{port}" for port in range(9465, 9469)} <= workers


def test_promtool_accepts_the_prometheus_config():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt install prometheus)")
    run = subprocess.run([promtool, "check", "config", str(PROMETHEUS)], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
