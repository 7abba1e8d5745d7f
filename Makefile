# The two commands a newcomer needs:
#   make run    start PostgreSQL + RabbitMQ (installing them if missing) and all five services
#   make test   the whole test suite against real PostgreSQL and RabbitMQ (started here)
SHELL := /bin/bash
.DEFAULT_GOAL := help
CARGO ?= cargo
ENV := source scripts/infra-env.sh &&
# Debug builds (tests, make run) have the fail points compiled in (inert unless
# FAILPOINTS is set), so crash tests can abort them at named boundaries; every
# target builds them the same way so target/debug never flips between the two.
# Release images (deploy/Dockerfile) are built without them.
FAILPOINTS_FEATURES := --features order-api/failpoints,outbox-relay/failpoints,inventory-consumer/failpoints,ledger-consumer/failpoints,loyalty-consumer/failpoints,ops/failpoints

.PHONY: help up down migrate build run demo drift test lint bench bench-backlog bench-api bench-relay bench-consumers bench-e2e soak

help:
	@echo "make run      start PostgreSQL, RabbitMQ and the five services (Ctrl-C stops the services; make down stops PostgreSQL and RabbitMQ)"
	@echo "make test     run the whole test suite (starts what it needs)"
	@echo "make demo     run the seed 003 story against a running system (make run)"
	@echo "make drift    compare the four databases; exit 1 on any drift (DRIFT_GRACE=0: also orders changed in the last minute; DRIFT_TENANT=demo: one tenant)"
	@echo "make up       install where missing and start PostgreSQL + RabbitMQ, create the databases"
	@echo "make down     stop what 'make up' started"
	@echo "make migrate  apply every database's migrations"
	@echo "make build    the debug binaries with their fail points (what the tests start)"
	@echo "make lint     rustfmt check + clippy -D warnings + hadolint (deploy/Dockerfile)"
	@echo "make bench    benchmarks: every stage against its raw limit (BENCHMARKS.md)"
	@echo "make bench-backlog  long: a 1,000,000-event backlog drain (claim latency, dead tuples)"
	@echo "make bench-api / bench-relay / bench-consumers / bench-e2e  one phase of make bench alone (quick loops)"
	@echo "make soak     long kill -9 soak with broker and database restarts (SOAK_* env), then the invariant checker"

up:
	scripts/infra-up.sh

down:
	scripts/infra-down.sh

build:
	$(CARGO) build --workspace --bins $(FAILPOINTS_FEATURES)

migrate: up build
	$(ENV) . scripts/service-env.sh && for svc in order-api inventory-consumer ledger-consumer loyalty-consumer; do \
		target/debug/$$svc migrate || exit 1; \
	done

run: up build
	scripts/run.sh

# At the services' ports as make run starts them (<PREFIX>__HTTP__PORT, else
# the defaults: demo_urls in scripts/service-env.sh).
demo: build
	$(ENV) . scripts/service-env.sh && demo_urls && set -a && { [ -f .run/credentials.env ] && . .run/credentials.env || true; } && set +a && target/debug/demo

# Orders changed within DRIFT_GRACE seconds are skipped as in flight (0: every order).
DRIFT_GRACE ?= 60
# DRIFT_TENANT: one tenant only (the tests plant drift on purpose under their
# own tenants of the local cluster: after `make test`, name yours: demo for
# requests made with the demo key, or the tenant the story prints).
DRIFT_TENANT ?=
drift: build
	$(ENV) target/debug/drift-check --grace-seconds $(DRIFT_GRACE) $(if $(DRIFT_TENANT),--tenant $(DRIFT_TENANT))

test: up
	scripts/no-stray-services.sh
	scripts/check-deploy.sh
	$(CARGO) build --workspace --all-targets $(FAILPOINTS_FEATURES)
	$(ENV) $(CARGO) test --workspace --no-fail-fast $(FAILPOINTS_FEATURES)

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	# Again with the fail points compiled in (their code is cfg'd out above).
	$(CARGO) clippy --workspace --all-targets $(FAILPOINTS_FEATURES) -- -D warnings
	scripts/check-deploy.sh lint

# Release binaries in their own target directory (never the debug binaries
# the tests run); the bench starts them from there (SERVICE_BIN_DIR). Only
# the binaries it runs: the ops tools' would add ~20 s to a cold build.
BENCH_TARGET := target/bench
BENCH_BIN := $(BENCH_TARGET)/bench-release
BENCH_PACKAGES := bench order-api outbox-relay inventory-consumer ledger-consumer loyalty-consumer
BENCH_BUILD := CARGO_TARGET_DIR=$(BENCH_TARGET) $(CARGO) build --profile bench-release --bins \
	$(addprefix -p ,$(BENCH_PACKAGES))

# make bench: every phase (`bench suite`); bench-backlog: the 1,000,000-event
# drain; bench-api / bench-relay / bench-consumers / bench-e2e: one phase alone,
# the quick loops (bench-e2e paces at BENCH_E2E_RATE orders/s, default 50).
BENCH_TARGETS := bench bench-backlog bench-api bench-relay bench-consumers bench-e2e
# Refused beside a `make run`, as make test is (scripts/no-stray-services.sh):
# its relay has no tenant filter and would claim the bench's outbox rows.
$(BENCH_TARGETS): up
	scripts/no-stray-services.sh
	$(BENCH_BUILD)
	$(ENV) for svc in order-api inventory-consumer ledger-consumer loyalty-consumer; do \
		$(BENCH_BIN)/$$svc migrate || exit 1; \
	done
	$(ENV) SERVICE_BIN_DIR=$(BENCH_BIN) $(BENCH_BIN)/bench $(if $(filter bench,$@),suite,$(patsubst bench-%,%,$@))

# The long soak (issue 7): kill -9 chaos + one RabbitMQ and one PostgreSQL
# restart under load, then the invariant checker. Knobs (environment):
# SOAK_ORDERS (5000), SOAK_SECONDS (minimum chaos duration, 0),
# SOAK_KILL_INTERVAL_MS (2000), SOAK_CONCURRENCY (16), SOAK_INFRA_RESTARTS (1),
# SOAK_BACKLOG_ORDERS (16667 = 50,000 events). Report: target/soak-report.txt.
# Refused beside a `make run`, as make test is (its relay would claim the
# soak's outbox rows).
soak: up
	scripts/no-stray-services.sh
	$(CARGO) build --workspace --all-targets $(FAILPOINTS_FEATURES)
	$(ENV) SOAK_LONG=1 $(CARGO) test -p system-tests --test soak -- --nocapture --test-threads=1 soak_with_kill_9 backlog_drains
	@cat target/soak-report.txt
