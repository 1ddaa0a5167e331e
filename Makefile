# Two commands do all set-up on a fresh machine:
#   make demo   create .venv, install, run the main job on the embedded synthetic data
#   make test   create .venv, install, run the whole test suite
# GPU machines: `make demo TF_EXTRA=gpu` adds tensorflow[and-cuda] (CUDA and cuDNN from pip) to TensorFlow.

PYTHON   ?= python3
VENV     ?= .venv
TF_EXTRA ?= cpu
BIN      := $(VENV)/bin
STAMP    := $(VENV)/.installed-$(TF_EXTRA)
DEMO     := runs/demo
SHAPES   := $(DEMO)/shapes
ANN      := $(SHAPES)/annotations

BENCH    := runs/benchmarks

.PHONY: install test test-fast demo benchmarks clean

install: $(STAMP)

# One TensorFlow in the venv (see setup.cfg): a .venv made before keras-hub came in holds tensorflow-cpu, and
# installing `tensorflow` next to it would give two distributions writing the one `tensorflow` package. So when
# tensorflow-cpu is there, it goes first, with any `tensorflow` beside it (removing one of two would delete files
# the other still lists), and the install below puts `tensorflow` back. The stamp names the extra installed
# last: switching TF_EXTRA re-runs the install (cpu after gpu leaves the CUDA wheels in place, unused without a GPU).
$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	if $(BIN)/python -m pip show --quiet tensorflow-cpu >/dev/null 2>&1; then \
	    $(BIN)/python -m pip uninstall --quiet --quiet --yes tensorflow-cpu tensorflow; fi
	$(BIN)/python -m pip install --quiet -e '.[$(TF_EXTRA),test]'
	rm -f $(VENV)/.installed-*
	touch $@

# The suite runs in TEST_WORKERS processes (pytest-xdist, a test file per process at a time, handed out in
# collection order, heaviest file first: tests/conftest.py's FILE_SECONDS). `auto` is tests/conftest.py's
# pytest_xdist_auto_num_workers: one a core, one more when the slow tests run, and no more than the memory holds
# at 3 GiB a worker. Much of the slow tests' time is subprocesses, TensorFlow imports, JVM start-ups and servers
# waiting on each other, so on 2 cores three workers keep the cores busier than two (2026-11-24: 589 s against 622 s, 930 tests; 2026-11-26: 741 s against 799 s,
# 1,267 tests; 2026-11-28: two workers had done 27% of 1,559 tests after 9 minutes, three 36%), though two spend
# 4% less CPU. The quick loop computes: there a third worker only makes the two cores' work dearer (2026-11-28, fresh
# clone, 1,296 tests: 135 s and 226 CPU s with three, 133 s and 203 CPU s with two, before its schedule's fix).
# `make test TEST_WORKERS=0` runs it in one process.
TEST_WORKERS ?= auto

# The project's bytecode, written once before the suite (an editable install compiles nothing, and with
# PYTHONDONTWRITEBYTECODE set every one of the suite's ~90 Python processes would compile what it imports again;
# 0.11 CPU s a process importing every module): 0.3 s, and 0.07 s when nothing changed.
# And pytest's rewritten test modules (tests/rewrite_cache.py): 2.3 CPU s once, instead of 7-8 s in every worker.
# pytest itself then runs with bytecode writing allowed, so that it keeps the plugins' rewritten modules too.
COMPILE = $(BIN)/python -m compileall -q -j 0 captioning data_prep tests > /dev/null && $(BIN)/python tests/rewrite_cache.py
PYTEST  = env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest

# pytest exits 5 when it collected no test: for this project that means the suite is broken.
test: $(STAMP)
	$(COMPILE)
	$(PYTEST) -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests (exit 5): the suite is broken" >&2; fi; \
	exit $$rc

define prepare_shapes
	$(BIN)/captioning synth --output-dir $(SHAPES) --num-images 5000 --seed 0 --overwrite
	$(BIN)/captioning prepare --output-dir $(DEMO)/records --overwrite \
	    --split train=$(ANN)/captions_train.json:$(SHAPES)/images \
	    --split val=$(ANN)/captions_val.json:$(SHAPES)/images \
	    --split test=$(ANN)/captions_test.json:$(SHAPES)/images
endef

# The quick loop: every test but the slow end-to-end ones (signals, kills, servers, clusters, other processes,
# exports and LiteRT conversions, training or evaluation runs through a command or Trainer.run that cost over about
# 1.5 CPU s, and waits of seconds, such as TensorFlow's allocator's before it refuses); at most half of `make demo`'s
# wall time (docs/reliability.md).
test-fast: $(STAMP)
	$(COMPILE)
	$(PYTEST) -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m 'not slow' $(PYTEST_ARGS)

demo: $(STAMP)
	$(prepare_shapes)
	$(BIN)/captioning train --config experiments/shapes.yaml --model-dir $(DEMO)/model
	$(BIN)/captioning caption --model-dir $(DEMO)/model --top-k 3 --html $(DEMO)/gallery.html \
	    $$($(BIN)/python -c "import json; print(' '.join('$(SHAPES)/images/' + i['file_name'] for i in json.load(open('$(ANN)/captions_test.json'))['images'][:12]))")
	$(BIN)/captioning evaluate --model-dir $(DEMO)/model --split test --baseline --output $(DEMO)/metrics.json

# Every benchmark of benchmarks/RESULTS.md in one run (24 minutes on 2 cores on 2026-11-25; time to quality
# is 8 minutes of it), JSON into runs/benchmarks/. Run it alone on the machine: the figures are ratios measured side
# by side, and a second busy process moves them. `benchmark train` runs the shapes configs, so the demo's
# records are made first if missing. `make benchmarks QUICK=1` leaves out time to quality.
SCST_CONFIGS := shapes_scst shapes_attention_scst shapes_transformer_scst
DECODERS     := show_and_tell attention updown transformer
COCO_PHOTOS  := --photos --set model.encoder_weights=none

benchmarks: $(STAMP) $(DEMO)/records/manifest.json
	$(BIN)/captioning benchmark input --service 1 --json $(BENCH)/input.json
	$(BIN)/captioning benchmark train --config experiments/shapes.yaml --compare train.steps_per_execution=10 \
	    --steps 200 --warmup 30 --json $(BENCH)/train.json
	$(BIN)/captioning benchmark train --config experiments/shapes_attention.yaml \
	    --compare train.steps_per_execution=10 --steps 200 --warmup 30 --json $(BENCH)/train_attention.json
	$(BIN)/captioning benchmark train --config experiments/show_and_tell_coco.yaml $(COCO_PHOTOS) \
	    --compare data.captions_per_image=grouped --compare train.split_padding=true --steps 10 --warmup 3 \
	    --json $(BENCH)/train_grouped.json
	for c in $(SCST_CONFIGS); do $(BIN)/captioning benchmark train --config experiments/$$c.yaml \
	    --compare train.objective=xe --steps 60 --warmup 15 --json $(BENCH)/train_$$c.json || exit 1; done
	$(BIN)/captioning benchmark train --config experiments/show_and_tell_coco_scst.yaml $(COCO_PHOTOS) \
	    --set data.cache=features --set data.random_crop=false --set data.random_flip=false \
	    --compare train.objective=xe --steps 10 --warmup 3 --json $(BENCH)/train_coco_scst.json
	for d in $(DECODERS); do $(BIN)/captioning benchmark decode --set model.decoder=$$d \
	    --json $(BENCH)/decode_$$d.json || exit 1; done
	$(BIN)/captioning benchmark prepare --json $(BENCH)/prepare.json
	test -n "$(QUICK)" || $(BIN)/captioning benchmark quality --config experiments/shapes.yaml \
	    --compare model.dropout=0.2 --compare train.steps=8000 --json $(BENCH)/quality.json

$(DEMO)/records/manifest.json: | $(STAMP)
	$(prepare_shapes)

clean:
	rm -rf $(DEMO)
