# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Where PYTHONDONTWRITEBYTECODE is set (this project's machines set it), every process would compile what it imports
# anew (torch's and diloco's modules: 5 CPU-s for the first, 0.2 for diloco's alone) and each pytest worker would
# rewrite every test module's asserts anew; the targets let Python keep its bytecode (__pycache__/, ignored by git).
KEEP_BYTECODE := PYTHONDONTWRITEBYTECODE=

.PHONY: demo test test-slow test-gpu typecheck install clean

# uv installs what pip would (the same pins, the same versions) in seconds rather than a minute: 6 s against 57 s
# into a new venv on this project's 2-core machine, its cache empty (docs/BENCHMARKS.md). It leaves bytecode to
# the first import, which the targets below let Python keep. uv does not read pip's configuration: the wheel
# directories pip is told to look in (this project's machines keep torch's CPU build in one) are passed on.
FIND_LINKS := $(sort $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null) $(PIP_FIND_LINKS))
UV_INSTALL  = $(BIN)/uv pip install --quiet --python $(BIN)/python $(FIND_LINKS:%=--find-links %) -c constraints.txt

$(STAMP): pyproject.toml constraints.txt Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet uv
	$(UV_INSTALL) -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(KEEP_BYTECODE) $(BIN)/diloco demo

# Four workers on two cores (pytest-xdist; every test keeps to its own ports, directories and namespaces). Many tests
# wait on real processes, deadlines and links: three workers left the cores 8% idle, four leave 2% (`vmstat 10`).
# On an idle machine that was within the spread from run to run; beside another busy process four take a larger
# share of the cores: 9:40 against 11:03 (docs/BENCHMARKS.md). TEST_WORKERS=0 runs them one after another.
TEST_WORKERS ?= 4
test: $(STAMP)
	$(KEEP_BYTECODE) $(BIN)/python -m pytest -q --durations=15 -n $(TEST_WORKERS) --dist worksteal

test-slow: $(STAMP)
	$(KEEP_BYTECODE) $(BIN)/python -m pytest -q -m slow

# On a machine with a CUDA GPU (and a CUDA build of torch: install it in .venv first, see docs/USAGE.md).
test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q -m gpu

typecheck: $(STAMP)
	$(UV_INSTALL) -e '.[dev]'
	bash .ci/typecheck

clean:
	rm -rf $(VENV) build *.egg-info
