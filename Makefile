# Two commands on a fresh machine: `make demo` and `make test`; both set up .venv on first use.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
# torch is installed first and pinned: the CPU wheel on local disk. Any other spec pulls a CUDA build.
TORCH   ?= torch==2.13.0

.PHONY: demo test bench gpu-check clean

$(STAMP): setup.cfg pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q '$(TORCH)'
	$(VPY) -m pip install -q -e '.[test,train]'
	touch $(STAMP)

# `autosp train` on 2 CPU ranks (torch.distributed.run), tiny preset, the stdlib's source as bytes
demo: $(STAMP)
	rm -rf runs/demo
	$(VPY) -m autosp train --model tiny --sp 2 --seq-len 512 --batch 4 --steps 200 --save-every 100 --out runs/demo

# the suite's modules on two pytest workers (a module's tests stay on one: its fixtures are shared): alone, one
# process left the second core idle a third of the time (1,355 s serial, 1,046 s on two, 2026-12-06)
TEST_WORKERS ?= 2
# autosp's bytecode first, once: where PYTHONDONTWRITEBYTECODE is set (this machine's shell sets it) every process
# the suite starts compiled autosp's sources again (0.3-0.7 s of CPU each, 2026-12-07)
test: $(STAMP)
	$(VPY) -m compileall -q autosp tests
	$(VPY) -m pytest -n $(TEST_WORKERS) --dist loadfile

# deepspeed builds from source: without build isolation, or its build env pulls a CUDA torch
bench: $(STAMP)
	$(VPY) -m pip install -q --no-build-isolation deepspeed matplotlib tqdm
	$(VPY) bench/memory.py
	$(VPY) bench/sp_vs_ulysses.py

# on a GPU machine: kernels against torch and SDPA's FLASH / cuDNN; logs into $(OUT)
OUT ?= bench/out
gpu-check:
	bash bench/gpu_check.sh $(OUT)

clean:
	rm -rf $(VENV) build *.egg-info
