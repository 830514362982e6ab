# kvserve: `make serve` (set up + run the server), `make test` (set up + run every test).
MAKEFLAGS += --no-print-directory
BUILD ?= build
ASAN_BUILD ?= build-asan
JOBS ?= $(shell nproc)
MODEL ?=
HOST ?= 127.0.0.1
PORT ?= 8000
ARGS ?=

.PHONY: all deps test-deps build serve test test-asan fuzz bench clean

all: build

deps:
	@scripts/install-deps.sh

test-deps:
	@scripts/install-deps.sh --test

build: deps
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
	@cmake --build $(BUILD) -j$(JOBS)

serve: build
	$(BUILD)/kvserve serve --host $(HOST) --port $(PORT) $(if $(MODEL),--model $(MODEL)) $(ARGS)

test: test-deps
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVSERVE_TESTS_REQUIRED=ON >/dev/null
	@cmake --build $(BUILD) -j$(JOBS)
	cd $(BUILD) && ctest --output-on-failure -j$(JOBS)

test-asan: test-deps
	@cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DKVSERVE_SANITIZE=ON -DKVSERVE_TESTS_REQUIRED=ON >/dev/null
	@cmake --build $(ASAN_BUILD) -j$(JOBS)
	cd $(ASAN_BUILD) && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
	  ctest --output-on-failure -j$(JOBS) -LE 'slow|fuzz'

# libFuzzer targets (tests/fuzz), each FUZZ_SECONDS (default 600); new corpus entries stay in
# $(FUZZ_BUILD)/corpus, crashes in $(FUZZ_BUILD)/artifacts (docs/testing.md)
FUZZ_BUILD ?= build-fuzz
FUZZ_SECONDS ?= 600
FUZZ_TARGETS ?= request_json gguf tokenizer_json jinja sse
fuzz: test-deps
	@JOBS=$(JOBS) tests/fuzz/run.sh build $(FUZZ_BUILD)
	@for t in $(FUZZ_TARGETS); do tests/fuzz/run.sh run $(FUZZ_BUILD) $$t $(FUZZ_SECONDS) || exit 1; done

bench: build
	bench/run.sh

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) $(FUZZ_BUILD)
