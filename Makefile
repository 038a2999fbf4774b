.PHONY: setup test test-fast lint build

setup:
	bash scripts/setup.sh

test: setup
	.venv/bin/python -m pytest
	.venv/bin/python -m pytest -m integration

test-fast: setup
	.venv/bin/python -m pytest

lint: setup
	.venv/bin/ruff check trt_builder tests benchmarks
	.venv/bin/ruff format --check trt_builder tests benchmarks
	.venv/bin/mypy trt_builder

build: setup
	.venv/bin/trt-builder build --dtype int8
