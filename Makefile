# hearth — two commands for a newcomer:
#   make run    set up whatever is missing, then train the default job
#   make test   set up whatever is missing, then run every test
# Setup is idempotent: a second run installs nothing.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
VENV := .venv
PY := $(VENV)/bin/python
# What `make run` needs (torch) and, for the tests and benchmarks, the rest.
RUN_REQS := tests/requirements-run.txt
REQS := tests/requirements.txt
PY_STAMP := $(VENV)/.installed-run-$(shell cat $(RUN_REQS) | sha256sum | cut -c1-16)
PY_TEST_STAMP := $(VENV)/.installed-test-$(shell cat $(RUN_REQS) $(REQS) | sha256sum | cut -c1-16)
# Open MPI (the CPU collectives) and libclang (the mpi crate's bindings);
# the tests also want Chromium (renders `hearth report`) and npm (builds the
# JavaScript example tracker). A newcomer's `make run` installs only what it
# uses: Chromium and Debian's npm are ~400 packages.
APT_PACKAGES := libopenmpi-dev openmpi-bin libclang-dev
NEED_NPM :=
# The Python packages `build` installs while it compiles.
PY_GOAL := python-env
test setup: APT_PACKAGES += chromium openssl
test setup: NEED_NPM := 1
test setup test-isa bench bench-plugins bench-checkpoint bench-fsdp bench-llama gpu-bundle soak: PY_GOAL := python-test-env
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
HEARTH := target/debug/hearth
# Plugin crates are unit-tested natively (their .wasm is built for wasm32-wasip2).
HOST_TARGET = $(shell rustc -vV | sed -n 's/host: //p')

.PHONY: run test test-clock test-isa cpu-line setup system-packages wasm-target python-env python-test-env build plugins example-plugins bench bench-plugins bench-checkpoint bench-fsdp bench-llama gpu-bundle lint soak fuzz docs

run: build
	$(HEARTH) run examples/sort-digits.toml

# Each part is timed (tests/tools/timed.sh), and the run ends with the table
# of their times (tests/tools/suite_times.py); target/test-times keeps the
# logs, and the times so far when a part fails.
TIMES := target/test-times
TIMED := TIMES=$(CURDIR)/$(TIMES) $(CURDIR)/tests/tools/timed.sh
test: test-clock cpu-line build example-plugins
	@awk -v a=$$(cat $(TIMES)/started) -v b=$$EPOCHREALTIME 'BEGIN { printf "setup and build\t%.1f\t0\n", b - a }' >> $(TIMES)/parts.tsv
	$(TIMED) "compile the Rust tests" cargo test --no-run --quiet
	$(TIMED) "Rust tests" cargo test
	cd plugins && $(TIMED) "plugin crates' tests" cargo test --quiet --target $(HOST_TARGET)
	cd guest-sdk && $(TIMED) "guest SDK's tests" cargo test --quiet --target $(HOST_TARGET) --features http
	$(TIMED) pytest $(PY) -m pytest tests -q --timeout 1800 --junitxml=$(TIMES)/pytest.xml
	$(TIMED) "ISA levels" tests/isa/levels.sh --others baseline
	@$(PY) tests/tools/suite_times.py $(TIMES)

# Where `make test`'s clock starts: before setup and the build.
test-clock:
	@rm -rf $(TIMES) && mkdir -p $(TIMES) && echo $$EPOCHREALTIME > $(TIMES)/started

# The machine a test report comes from: its CPU and vector flags, one line.
cpu-line:
	@tests/isa/cpu.sh

# The numeric tests again under each CPU level libtorch, oneDNN and MKL can
# be pinned to here (baseline, AVX2, AVX-512 where present; `make test` runs
# those below this CPU's own last). LEVELS="baseline avx2" picks some.
test-isa: cpu-line build
	tests/isa/levels.sh $(LEVELS)

setup: system-packages wasm-target python-test-env

# APT_PACKAGES, and Node.js/npm if the tests need them and npm is absent.
system-packages:
	@missing=$$(for p in $(APT_PACKAGES); do \
		dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'install ok installed' || echo $$p; done; \
		[ -z "$(NEED_NPM)" ] || command -v npm >/dev/null || echo nodejs npm); \
	if [ -n "$$missing" ]; then \
		echo "setup: installing" $$missing; \
		$(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

wasm-target:
	@rustup target list --installed | grep -qx wasm32-wasip2 || rustup target add wasm32-wasip2

# The venv with torch, whose libtorch hearth links; .venv/libtorch points
# at the wheel's torch/ folder (see .cargo/config.toml).
python-env: $(PY_STAMP)
$(PY_STAMP): $(RUN_REQS)
	@echo "setup: installing torch into $(VENV)"
	[ -x $(PY) ] || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r $(RUN_REQS)
	ln -sfn "$$($(PY) -c 'import os, torch; print(os.path.dirname(torch.__file__))')" $(VENV)/libtorch
	rm -f $(VENV)/.installed-run-*
	touch $@

# ... and the test oracles, the peer benchmarks and componentize-py.
python-test-env: $(PY_TEST_STAMP)
$(PY_TEST_STAMP): $(PY_STAMP) $(REQS)
	@echo "setup: installing the tests' Python packages into $(VENV)"
	$(PY) -m pip install -q --disable-pip-version-check -r $(REQS)
	rm -f $(VENV)/.installed-test-*
	touch $@

# On a fresh machine torch's download (minutes, mostly network) overlaps the
# compiling of the plugins and of every crate that does not need libtorch
# (`--keep-going` builds all but torch-sys and what depends on it); then the
# rest. pip's output goes to $(PIP_LOG), shown if it fails.
PIP_LOG := target/python-env.log
build: system-packages wasm-target
	@mkdir -p target
	@$(MAKE) --no-print-directory $(PY_GOAL) > $(PIP_LOG) 2>&1 & pip=$$!; \
	$(MAKE) --no-print-directory plugins || { kill $$pip; exit 1; }; \
	[ -e $(VENV)/libtorch ] || cargo build --keep-going --quiet 2>/dev/null || true; \
	wait $$pip || { cat $(PIP_LOG); echo "setup: installing the Python packages failed"; exit 1; }
	@grep -v "Nothing to be done" $(PIP_LOG) || true
	@# A copied or moved checkout keeps a link into the old one's venv.
	@case "$$(readlink $(VENV)/libtorch)" in "$(CURDIR)/$(VENV)/"*) ;; *) \
		echo "setup: pointing $(VENV)/libtorch at this checkout's torch"; \
		ln -sfn "$$($(PY) -c 'import os, torch; print(os.path.dirname(torch.__file__))')" $(VENV)/libtorch;; esac
	cargo build

# The built-in plugins (plugins/*) for wasm32-wasip2, installed as
# target/plugins/<name>/{plugin.toml,<component>} where hearth finds them.
# A crate installs its plugin.toml, or one plugin per manifests/*.toml (the
# schedules crate: one component under a name per schedule).
plugins: wasm-target
	cd plugins && cargo build --release --quiet
	@rm -rf target/plugins
	@for manifest in plugins/*/plugin.toml plugins/*/manifests/*.toml; do \
		[ -f $$manifest ] || continue; \
		crate=$$(echo $$manifest | cut -d/ -f2); \
		name=$$(sed -n 's/^name *= *"\(.*\)"/\1/p' $$manifest); \
		component=$$(sed -n 's/^component *= *"\(.*\)"/\1/p' $$manifest); \
		mkdir -p target/plugins/$$name; \
		cp $$manifest target/plugins/$$name/plugin.toml; \
		cp target/plugins-build/wasm32-wasip2/release/hearth_plugin_$${crate//-/_}.wasm target/plugins/$$name/$$component; \
	done

# Third-party trackers in other languages (examples/trackers), built against
# the same WIT into target/example-plugins/<name>/: Python with
# componentize-py (from the venv), JavaScript with componentize-js (npm).
EXAMPLES := target/example-plugins
JS_EXAMPLE := examples/trackers/js
example-plugins: python-test-env $(EXAMPLES)/python-tracker/python-tracker.wasm $(EXAMPLES)/js-tracker/js-tracker.wasm

# Its WIT: world.wit, hearth's package, and WASI 0.2's packages as the
# host's wasmtime-wasi-http ships them (its wit/deps, found by cargo).
PY_WIT := target/example-wit/python
$(EXAMPLES)/python-tracker/python-tracker.wasm: examples/trackers/python/app.py examples/trackers/python/world.wit examples/trackers/python/plugin.toml wit/plugin.wit Cargo.lock $(PY_TEST_STAMP)
	rm -rf $(PY_WIT) && mkdir -p $(PY_WIT)/deps $(@D)
	cp examples/trackers/python/world.wit $(PY_WIT)/
	cp -r wit $(PY_WIT)/deps/hearth-plugin
	manifest=$$(cargo metadata --format-version 1 --locked | $(PY) -c "import json, sys; print(next(p['manifest_path'] for p in json.load(sys.stdin)['packages'] if p['name'] == 'wasmtime-wasi-http'))") && \
		cp $$(dirname $$manifest)/wit/deps/*.wit $(PY_WIT)/deps/
	cd examples/trackers/python && ../../../$(VENV)/bin/componentize-py -d ../../../$(PY_WIT) -w python-tracker componentize app -o ../../../$@
	cp examples/trackers/python/plugin.toml $(@D)/

# `npm install --no-save` installs what package-lock.json pins without
# rewriting it; npm 11's `npm ci` refuses this lock (it wants entries for
# other platforms' optional binaries that npm itself did not record).
# package.json names preview2-shim (an optional peer of componentize-js)
# so that npm does not prune it as extraneous.
$(JS_EXAMPLE)/node_modules/.package-lock.json: $(JS_EXAMPLE)/package-lock.json
	cd $(JS_EXAMPLE) && npm install --no-save --no-audit --no-fund --loglevel=error

$(EXAMPLES)/js-tracker/js-tracker.wasm: $(JS_EXAMPLE)/tracker.js $(JS_EXAMPLE)/world.wit $(JS_EXAMPLE)/build.mjs $(JS_EXAMPLE)/plugin.toml wit/plugin.wit $(JS_EXAMPLE)/node_modules/.package-lock.json
	node $(JS_EXAMPLE)/build.mjs $@
	cp $(JS_EXAMPLE)/plugin.toml $(@D)/

# Every measure of hearth against its peer in one run, one table (not a
# test): tiny GPT tokens/s on 1 and 2 processes, a whole tiny process's time
# and memory, plugin cost, save_state vs dd, async save. The table and the
# machine go to BENCHMARKS.md. ROUNDS=N rounds (7: on the 2-core VM, 3
# rounds of the GPT rows once gave 1.02x where 7 gave 1.17x).
bench: build
	cargo build --release -p hearth-bench --bin save_state
	cargo build -p hearth-bench --bin bare_tch_gpt
	$(PY) examples/bench/table.py $(or $(ROUNDS),5)

# The traced Llama and Qwen2 against Accelerate eager and compiled, float32
# and bf16, 1 and 2 processes: BENCHMARKS.md's bench-llama section (also
# written by `make bench`).
bench-llama: build
	$(PY) examples/bench/table.py --llama $(or $(ROUNDS),5)

# What a GPU machine with torch but no Rust needs, in .gpu/: there run
# tests/gpu/checklist.sh OUT (docs/src/gpu-checklist.md; the GPU benchmark is
# its `bench` step, examples/bench/gpu_gpt_vs_accelerate.py).
gpu-bundle: python-test-env
	tests/gpu/bundle.sh

# Sharded data parallel: SHARD_GRAD_OP vs NO_SHARD vs PyTorch FSDP (gloo) on
# 2 processes, and peak RSS of a ~100M-parameter GPT on 4, DDP vs sharded;
# then a user's 103M traced Llama under FULL_SHARD against DDP (memory on 2
# and 4 processes, tokens/s on 2), written to BENCHMARKS.md.
bench-fsdp: build
	$(PY) examples/bench/fsdp_vs_torch.py 3 2
	$(PY) examples/bench/traced_llama_fsdp.py 3
	$(PY) examples/bench/traced_llama_lora.py 3

# What a scheduler + tracker plugins cost per step, end to end and per call.
bench-plugins: build
	$(PY) examples/bench/plugin_overhead.py 5

# save_state/load_state of a ~1 GB model + AdamW state against Accelerate's.
bench-checkpoint: build
	cargo build --release -p hearth-bench --bin save_state
	$(PY) examples/bench/save_state_vs_accelerate.py 2

lint: setup
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -- -D warnings
	cargo clippy --workspace --all-targets --no-default-features -- -D warnings
	RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --quiet
	for ws in plugins tests/plugins; do (cd $$ws && cargo fmt --all --check && cargo clippy --release -- -D warnings); done
	cd guest-sdk && cargo fmt --check && cargo clippy --target wasm32-wasip2 --features http -- -D warnings
	cd examples/library && cargo fmt --check

# Reliability runs, not part of `make test` (issue 18). `make soak`:
# SIGKILL `hearth run` 20 times in each of three scenarios (rotation, a large
# async save, two MPI ranks) and check every visible checkpoint is complete.
# `make soak SOAK_HOURS=1`: instead, two ranks train for that long, saving
# every 50 steps with trackers and a hook, and fail if memory, file
# descriptors, threads or disk use grow by more than 5 % (issue 43).
soak: build
	$(if $(SOAK_HOURS),SOAK_HOURS=$(SOAK_HOURS) $(PY) tests/soak/long_soak.py,$(PY) tests/soak/kill_soak.py $(or $(KILLS),20))

# `make fuzz`: every cargo-fuzz target (fuzz/fuzz_targets) for FUZZ_SECONDS
# each (default 600), on a nightly toolchain; prints executions and crashes.
fuzz: build
	fuzz/run.sh $(or $(FUZZ_SECONDS),600)

# `make docs`: the book (docs/, mdBook) into target/book. mdBook is pinned;
# cargo installs it (a few minutes, once) when it is missing or another
# version. No feature is needed to build a book, so none is compiled in
# (watch, serve and search are the defaults). Not part of `make test`.
MDBOOK_VERSION := 0.5.4
MDBOOK := $(or $(CARGO_HOME),$(HOME)/.cargo)/bin/mdbook
docs:
	@[ "$$($(MDBOOK) --version 2>/dev/null)" = "mdbook v$(MDBOOK_VERSION)" ] || \
		cargo install mdbook --locked --version $(MDBOOK_VERSION) --no-default-features
	$(MDBOOK) build docs
