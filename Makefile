# `make up` runs the embedded default deployment; `make test` runs the test suite (docs/testing.md).
# Both set up their own environment first (scripts/bootstrap.sh; safe to repeat).
.PHONY: setup up test test-image coverage lint bench docs proto image image-cpu image-cuda

setup:
	@scripts/bootstrap.sh

up: setup
	.venv/bin/prfaas up

test: setup
	.venv/bin/python -m pytest -q

# The container image built and run (tests/e2e/test_container_image.py): minutes on a fresh machine.
test-image: setup
	.venv/bin/python -m pytest -q -m image tests/e2e/test_container_image.py

# `make test` under coverage.py, the services' own processes included; prints line coverage of
# services/ (docs/testing.md has the figures). Slower than `make test` by the tracing.
coverage: setup
	rm -f .coverage .coverage.*
	COVERAGE_FILE=$(CURDIR)/.coverage .venv/bin/coverage run -m pytest -q; \
	  status=$$?; COVERAGE_FILE=$(CURDIR)/.coverage .venv/bin/coverage combine -q; \
	  COVERAGE_FILE=$(CURDIR)/.coverage .venv/bin/coverage report --sort=cover | tail -40; exit $$status

# The code's shape and rules: import contracts (.importlinter), ruff, mypy where it is strict,
# hadolint on the Containerfiles.
lint: setup
	.venv/bin/lint-imports --no-cache
	.venv/bin/ruff check services tests bench scripts
	.venv/bin/mypy services/scheduling services/kv_transport services/planner services/config \
		services/worker_api/types.py services/kv_connector/params.py services/kv_connector/snapshot.py
	.venv/bin/hadolint deploy/container/Containerfile deploy/container/Containerfile.cuda

# Every benchmark that finishes within minutes, one after another (bench/run_all.py, about 20 minutes on
# a 2-core host): the table of their headlines in bench/results/<time>.md (and .json), each figure beside
# the previous run's. Arguments through BENCH, e.g. `make bench BENCH="--only chaos,sim_vs_real"` for
# the long ones, which run only by name.
bench: setup
	.venv/bin/python bench/run_all.py $(BENCH)

# Generated documentation: the configuration reference and the architecture's layer diagram.
docs: setup
	.venv/bin/python scripts/gen_config_reference.py
	.venv/bin/python scripts/gen_architecture.py

proto: setup
	.venv/bin/python scripts/gen_proto.py

# The container image (scripts/build_image.sh): base made with debootstrap, wheels downloaded here.
image: image-cpu

image-cpu: setup
	scripts/build_image.sh cpu

image-cuda: setup
	scripts/build_image.sh cuda
