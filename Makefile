# Two commands do all set-up on a fresh machine:
#   make demo   create .venv, install, run the main job on the embedded synthetic data
#   make test   create .venv, install, run the whole test suite
# GPU machines: `make demo TF_EXTRA=gpu` installs tensorflow[and-cuda] instead of tensorflow-cpu.

PYTHON   ?= python3
VENV     ?= .venv
TF_EXTRA ?= cpu
BIN      := $(VENV)/bin
STAMP    := $(VENV)/.installed-$(TF_EXTRA)
DEMO     := runs/demo
SHAPES   := $(DEMO)/shapes
ANN      := $(SHAPES)/annotations

.PHONY: install test demo clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[$(TF_EXTRA),test]'
	touch $@

# pytest exits 5 when it collected no test: for this project that means the suite is broken.
test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests (exit 5): the suite is broken" >&2; fi; \
	exit $$rc

demo: $(STAMP)
	$(BIN)/captioning synth --output-dir $(SHAPES) --num-images 5000 --seed 0 --overwrite
	$(BIN)/captioning prepare --output-dir $(DEMO)/records --overwrite \
	    --split train=$(ANN)/captions_train.json:$(SHAPES)/images \
	    --split val=$(ANN)/captions_val.json:$(SHAPES)/images \
	    --split test=$(ANN)/captions_test.json:$(SHAPES)/images
	$(BIN)/captioning train --config experiments/shapes.yaml --model-dir $(DEMO)/model
	$(BIN)/captioning caption --model-dir $(DEMO)/model --top-k 3 --html $(DEMO)/gallery.html \
	    $$($(BIN)/python -c "import json; print(' '.join('$(SHAPES)/images/' + i['file_name'] for i in json.load(open('$(ANN)/captions_test.json'))['images'][:12]))")
	$(BIN)/captioning evaluate --model-dir $(DEMO)/model --split test --baseline --output $(DEMO)/metrics.json

clean:
	rm -rf $(DEMO)
