# make quickstart   install, fetch the sample corpus, build tokenizer + dataset, train, sample
# make test         install and run the whole test suite (what CI runs)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# On a machine without torch the CPU build is installed, pinned; GPU/HPU systems bring their own
# torch (the venv sees the system's packages).
TORCH_PIN ?= torch==2.13.0
export DS_ACCELERATOR ?= cpu

.PHONY: install quickstart test lint clean

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[test]"
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
		--output $(QS)/tokenizer

$(QS)/works_text_document.idx: $(QS)/tokenizer.model
	$(PY) tools/preprocess_data.py --input $(QS)/shakespeare_works.jsonl \
		--output-prefix $(QS)/works --json-keys text --tokenizer-type sentencepiece \
		--tokenizer-model $< --append-eod --workers 2

quickstart: install $(QS)/works_text_document.idx
	$(PY) pretrain.py recipes/quickstart.yaml

test: install
	$(PY) -m ruff check .
	$(PY) -m pytest -q --durations=25 tests

clean:
	rm -rf $(VENV) data runs
