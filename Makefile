# Two commands on a fresh machine: `make demo` and `make test`; both set up .venv on first use.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
# torch is installed first and pinned: the CPU wheel on local disk. Any other spec pulls a CUDA build.
TORCH   ?= torch==2.13.0

.PHONY: demo test bench clean

$(STAMP): setup.cfg pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q '$(TORCH)'
	$(VPY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VPY) -m autosp.demo

test: $(STAMP)
	$(VPY) -m pytest

bench: $(STAMP)
	$(VPY) -m pip install -q -e '.[test,bench]'

clean:
	rm -rf $(VENV) build *.egg-info
