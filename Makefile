# gluon-fl: `make help` lists the targets.
SHELL := /bin/bash
PY_SYS ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Where datasets live (libsvm/a5a, cifar10-jpeg/...). A data/ folder in the checkout, or a
# shared data folder beside it, is used when present; set GLUON_DATA_DIR to point elsewhere.
GLUON_DATA_DIR ?= $(firstword $(wildcard data ../shared/data) data)
export GLUON_DATA_DIR
# Offline experiment tracking unless asked otherwise.
WANDB_MODE ?= offline
export WANDB_MODE
# Local sweeps run this many jobs at once; LAUNCHER=slurm sends them to a cluster.
JOBS ?= 2
LAUNCHER ?= local

.PHONY: help install test test-slow bench logreg fig2 fig2-logreg fig2-cnn fig2-plot tune-fig2 \
        fig3 fig4 fig5 fig6 fig7 fig8 clean

help:  ## list the targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	test -x $(PY) || $(PY_SYS) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)  ## create .venv and install the project with its pinned dependencies

test: $(STAMP)  ## run the test suite (fast tests; a few minutes on 2 cores)
	$(PY) -m pytest -q

test-slow: $(STAMP)  ## run the slow end-to-end tests too
	$(PY) -m pytest -q -m slow

bench: $(STAMP)  ## throughput benchmark of every method on a5a (steps/s, where the time goes)
	$(PY) -m scripts.bench_logreg

logreg: $(STAMP)  ## one a5a run of Algorithm 1 (RandK 1%), into results/runs/example
	$(PY) -m experiments.logreg method=alg1 compressor=randk compressor.density=0.01 \
	  method.q=0.1 method.B=4 method.beta=0.99 method.lr=0.01 steps=10000 seed=0 \
	  hydra.run.dir=results/runs/example

clean:  ## remove raw run directories (keeps the committed summaries)
	rm -rf results/runs results/sweeps outputs multirun
