# The two set-up commands of the README. Both create .venv on a fresh machine.
PY ?= python3
VENV := .venv
ACT := . $(VENV)/bin/activate &&

$(VENV)/.installed: requirements.txt pyproject.toml
	$(PY) -m venv $(VENV)
	$(ACT) pip install -q --upgrade pip && pip install -q -r requirements.txt -e .
	touch $@

.PHONY: setup demo test
setup: $(VENV)/.installed

# baselines against FBT models on CPU: the comparisons of docs/evidence.md that held in every seed of
# their study (the others: one line with the study's numbers); the studies' grids: make demo DEMO_ARGS=--full
demo: setup
	$(ACT) python tools/demo.py $(DEMO_ARGS)

# the suite: the tests that mostly wait (a real three-node Slurm, the hang watchdog) run beside the
# rest (tools/run_tests.py); their output follows the rest's
test: setup
	$(ACT) python tools/run_tests.py

# ---- serving with vLLM (docs/serving.md): a second environment, .venv-serve, with vLLM's CPU build
# and transformers within vLLM's range (<5.20); .venv keeps the newest transformers.
SERVE_VENV := .venv-serve
.PHONY: serve-setup test-serve
serve-setup: $(SERVE_VENV)/.installed
$(SERVE_VENV)/.installed: requirements.txt requirements-serve.txt pyproject.toml
	$(PY) -m venv $(SERVE_VENV)
	. $(SERVE_VENV)/bin/activate && pip install -q --upgrade pip && pip install -q -r requirements.txt -r requirements-serve.txt -e . \
		&& pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

test-serve: serve-setup
	. $(SERVE_VENV)/bin/activate && FBT_REQUIRE_VLLM=1 python -m pytest -q tests/test_serving.py

# ---- Python 3.12 + the newest megatron-core (requirements-mcore-latest.txt; .ci/run's second
# stage). Its own venv: the registry's CUDA build of torch, about 5 GB, run on CPU; pip's cache
# (~/.cache/pip, or PIP_CACHE_DIR) keeps the downloaded wheels for the next clean clone. The tests:
# one of each kind the issue lists, chosen for what differs on 0.19 (compat.py, platform.py):
# the megatron-core release layer and the CPU call sites; the command line's model fields (read from the
# dataclass: recipe/model_fields.py is 0.16's); the model (one layer = megatron's GPTModel,
# the reference architecture, k passes = the recurrence and its gradients); the training step with an
# exact resume (tokenizer, datasets, checkpoint save/load, results queue); the entry point at PP 2 x
# DP 2 (k passes as virtual pipeline chunks, overlapped gradient sync with the distributed optimizer)
# equal to one process, resumed at another layout; the export's logits and its bit-exact round trip.
# Measured 2026-12-01: 21 passed, 250 s of CPU, 596 s wall on 2 cores shared with other work
# (load 40-50); building the venv: 611 s wall, 161 s of CPU (load 10).
PY312 ?= python3.12
VENV312 := .venv-mcore-latest
MCORE_LATEST_TESTS := tests/test_compat.py tests/test_wide_layouts.py::test_gradient_norm_is_the_float64_norm_at_full_size tests/test_platform.py::test_cuda_call_sites_run_on_cpu tests/test_tokenizer.py \
	tests/test_model_table.py::test_another_megatron_core_reads_the_dataclass \
	"tests/test_architecture.py::test_single_pass_matches_reference[paper]" tests/test_architecture.py::test_k1_equals_megatron_gptmodel \
	"tests/test_multipass.py::test_parallel_passes_equal_sequential_recurrence[residual-1]" \
	"tests/test_multipass.py::test_three_pass_gradients_match_reference_autograd[False]" \
	tests/test_train.py::test_resumed_run_logs_the_same_losses_bitwise \
	"tests/test_parallel.py::test_entry_point_logs_the_same_losses_at_every_layout[pp2_dp2_overlap]" \
	"tests/test_parallel.py::test_checkpoint_resumes_at_another_layout[pp2_dp2_overlap-single]" \
	tests/test_convert.py::test_export_loads_offline_and_computes_megatrons_logits \
	tests/test_convert.py::test_export_import_export_is_bit_exact \
	tests/test_device_contracts.py::test_the_simulated_device_refuses_what_nccl_and_cuda_refuse \
	tests/test_device_contracts.py::test_the_te_double_follows_transformer_engines_per_call_rules \
	"tests/test_device_contracts.py::test_k_passes_through_transformer_engine_train_as_one_cpu_process[tp2_sp]" \
	"tests/test_device_contracts.py::test_k_passes_through_transformer_engine_train_as_one_cpu_process[pp2]" \
	"tests/test_device_contracts.py::test_fp8_k_passes_at_the_default_recipe_keep_their_scales[recompute_passes_pp2]"

$(VENV312)/.installed: requirements-mcore-latest.txt requirements-gpu.txt pyproject.toml
	$(PY312) -m venv $(VENV312)
	$(VENV312)/bin/pip install -q --upgrade pip && $(VENV312)/bin/pip install -q -r requirements-mcore-latest.txt -e .
	touch $@

.PHONY: test-mcore-latest
test-mcore-latest: $(VENV312)/.installed
	$(VENV312)/bin/python -m pytest -q $(MCORE_LATEST_TESTS)

# ---- The project's GPU image (packaging/container/Dockerfile, docs/gpu.md): the wheels it adds to NGC
# PyTorch (requirements-gpu.txt) for Python 3.12 on x86-64, resolved against the image's pip constraints
# (NGC_CONSTRAINT: its /etc/pip/constraint.txt), never its torch, Transformer Engine, Apex, triton or
# nvidia-*. Downloads from PyPI. wheelhouse-check installs it offline into fresh Python 3.12 venvs:
# alone (torch a stand-in at the image's version), and on stand-ins of the image under NGC_CONSTRAINT.
WHEELHOUSE ?= wheelhouse
NGC_CONSTRAINT ?= packaging/container/ngc-pytorch-26.06-constraint.txt
.PHONY: wheelhouse wheelhouse-check
wheelhouse:
	$(PY) tools/wheelhouse.py --output $(WHEELHOUSE) --constraint $(NGC_CONSTRAINT)

wheelhouse-check:
	$(PY) tools/wheelhouse.py --output $(WHEELHOUSE) --constraint $(NGC_CONSTRAINT) --check

# The image itself, built by a container engine (podman; ENGINE=docker): `image` on NGC's PyTorch
# (BASE_IMAGE), `image-cpu` on a CPU stand-in for it built here (packaging/container/ngc-standin), also
# imported by enroot into IMAGE_SQSH for pyxis (tools/container_image.py; docs/gpu.md#the-container).
BASE_IMAGE ?= nvcr.io/nvidia/pytorch:26.06-py3
ENGINE ?= podman
IMAGE_SQSH ?= .image-build/fbt-megatron+26.06-cpu.sqsh
.PHONY: image image-cpu
image:
	$(PY) tools/container_image.py --base $(BASE_IMAGE) --engine $(ENGINE)

image-cpu:
	$(PY) tools/container_image.py --base cpu --engine $(ENGINE) --sqsh $(IMAGE_SQSH)
