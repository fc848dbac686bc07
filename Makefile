# `make up` runs the embedded default deployment; `make test` runs the test suite.
# Both set up their own environment first (scripts/bootstrap.sh; safe to repeat).
.PHONY: setup up test proto image image-cpu image-cuda

setup:
	@scripts/bootstrap.sh

up: setup
	.venv/bin/prfaas up

test: setup
	.venv/bin/python -m pytest -q

proto: setup
	.venv/bin/python scripts/gen_proto.py

# The container image (scripts/build_image.sh): base made with debootstrap, wheels downloaded here.
image: image-cpu

image-cpu: setup
	scripts/build_image.sh cpu

image-cuda: setup
	scripts/build_image.sh cuda
