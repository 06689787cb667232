# make quickstart   install, fetch the sample corpus, build tokenizer + dataset, train, sample
# make test         install and run the whole test suite (what CI runs), then its torch- and
#                   DeepSpeed-facing part on the oldest releases setup.py admits (floor-test)
# make lint         ruff over the whole repository (part of make test)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# On a machine without torch the CPU build is installed, pinned; GPU/HPU systems bring their own
# torch (the venv sees the system's packages).
TORCH_PIN ?= torch==2.13.0
export DS_ACCELERATOR ?= cpu

.PHONY: install quickstart test floor-install floor-test lint clean

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[test]"
	@# The package's bytecode, once: an editable install compiles none, and an environment that
	@# sets PYTHONDONTWRITEBYTECODE has every process (every rank) compile it again.
	$(PY) -m compileall -q megatron_lite tools bench tests pretrain.py > /dev/null
	@# DeepSpeed's CPU communication op, built now rather than inside the first run (or test).
	[ "$(DS_ACCELERATOR)" != cpu ] || $(PY) -c "from megatron_lite.distributed.cpu_extensions import build; build()" \
		|| echo "warning: DeepSpeed's CPU communication op did not build; the first run builds it"
	touch $@

install: $(VENV)/.installed

QS := data/quickstart
# Each step is a file target: a second `make quickstart` reuses the corpus, tokenizer and dataset.
$(QS)/shakespeare_works.jsonl: | install
	$(PY) tools/fetch_sample_corpus.py --output $@

$(QS)/tokenizer.model: $(QS)/shakespeare_works.jsonl
	$(PY) tools/train_tokenizer.py --input $< --type sentencepiece --vocab-size 2048 \
		--output $(QS)/tokenizer --overwrite

$(QS)/works_text_document.idx: $(QS)/tokenizer.model
	$(PY) tools/preprocess_data.py --input $(QS)/shakespeare_works.jsonl \
		--output-prefix $(QS)/works --json-keys text --tokenizer-type sentencepiece \
		--tokenizer-model $< --append-eod --workers 2 --overwrite

quickstart: install $(QS)/works_text_document.idx
	$(PY) pretrain.py recipes/quickstart.yaml

# The floor: the oldest torch, DeepSpeed, transformers, ... that setup.py admits
# (tests/floor/requirements.py reads them from setup.py), in an environment of their own.
# torch's floor exists on PyPI only as the CUDA build: its triton refuses to import without a
# GPU, and nothing here needs it. DeepSpeed builds from its sdist against that torch. The CUDA
# build with its libraries takes about 5 GB: pip's cache would double that on a small disk.
FLOOR_VENV ?= .venv-floor
FLOOR_PY := $(FLOOR_VENV)/bin/python

$(FLOOR_VENV)/.installed: setup.py tests/floor/requirements.py | install
	rm -rf $(FLOOR_VENV)
	$(PYTHON) -m venv $(FLOOR_VENV)
	$(PY) tests/floor/requirements.py > $(FLOOR_VENV)/floor.txt
	$(FLOOR_PY) -m pip install -q wheel setuptools "$$(grep '^numpy==' $(FLOOR_VENV)/floor.txt)"
	$(FLOOR_PY) -m pip install -q --no-cache-dir -c $(FLOOR_VENV)/floor.txt torch
	$(FLOOR_PY) -m pip install -q --no-cache-dir --no-build-isolation -c $(FLOOR_VENV)/floor.txt -e . "pytest>=8.2" \
		"pytest-xdist>=3.6" "pytest-timeout>=2.3" psutil
	$(FLOOR_PY) -m pip uninstall -q -y triton
	@# (No NVMe ops: no floor test offloads to NVMe.)
	[ "$(DS_ACCELERATOR)" != cpu ] || $(FLOOR_PY) -c "from megatron_lite.distributed.cpu_extensions import build; build(nvme=False)"
	touch $@

floor-install: $(FLOOR_VENV)/.installed

# The torch- and DeepSpeed-facing tests (tests/floor/tests.txt: every layout family end to end,
# the models against transformers, save, resume and resharding) on the floor releases. (The
# floor DeepSpeed's configuration classes warn on every access under today's pydantic.)
floor-test: $(FLOOR_VENV)/.installed
	$(FLOOR_PY) -m pytest -q -n 2 --dist loadfile -p no:cacheprovider -W ignore::DeprecationWarning \
		@tests/floor/tests.txt

test: lint
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=25 tests
	$(MAKE) floor-test

lint: install
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) $(FLOOR_VENV) data runs
