# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test test-slow test-gpu typecheck install clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/diloco demo

# Three workers on two cores: most tests wait on real processes, deadlines and links (pytest-xdist; every test
# keeps to its own ports, directories and namespaces). TEST_WORKERS=0 runs them one after another.
TEST_WORKERS ?= 3
# The suite starts about 200 Python processes. Where PYTHONDONTWRITEBYTECODE is set (this project's machines set
# it), each of them would compile diloco's sources anew (0.2 CPU-s a process) and each pytest worker would rewrite
# every test module's asserts anew: the tests let Python keep its bytecode (in __pycache__/, which git ignores).
KEEP_BYTECODE := PYTHONDONTWRITEBYTECODE=
test: $(STAMP)
	$(KEEP_BYTECODE) $(BIN)/python -m pytest -q --durations=15 -n $(TEST_WORKERS) --dist worksteal

test-slow: $(STAMP)
	$(KEEP_BYTECODE) $(BIN)/python -m pytest -q -m slow

# On a machine with a CUDA GPU (and a CUDA build of torch: install it in .venv first, see docs/USAGE.md).
test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q -m gpu

typecheck: $(STAMP)
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev]'
	bash .ci/typecheck

clean:
	rm -rf $(VENV) build *.egg-info
