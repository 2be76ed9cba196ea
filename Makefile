# pdmoe build. `make` builds build/pdmoe; `make test` builds and runs the Criterion suite;
# `make SAN=1 test` does the same under AddressSanitizer + UBSan in build-san/.
CC      ?= cc
PKGS    := jansson ompi-c libevent libevent_pthreads ucx libpcre2-32
SAN     ?= 0

ifeq ($(SAN),1)
BUILD   := build-san
SANFLAGS := -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
OPT     := -O1 -g
else
BUILD   := build
SANFLAGS :=
OPT     := -O2 -g
endif

PKG_CFLAGS := $(shell pkg-config --cflags $(PKGS))
PKG_LIBS   := $(shell pkg-config --libs $(PKGS))
CFLAGS  := -std=gnu11 $(OPT) -march=x86-64-v2 -Wall -Wextra -Werror -Wshadow -Wno-unused-parameter \
           -pthread -Isrc -I. -I$(BUILD)/gen $(PKG_CFLAGS) $(SANFLAGS) $(EXTRA_CFLAGS)
LDLIBS  := $(PKG_LIBS) -lm -pthread $(SANFLAGS)
# oneDNN (libdnnl-dev, OpenMP build): the benchmarks' same-run anchor (bench/onednn.c), linked into
# the CLI (which holds the benchmarks) and the tests, never into libpdmoe.a, the engine.
ANCHOR_LIBS := -ldnnl -lgomp

# Every .c under src/ except the command-line front is library code.
LIB_SRC := $(shell find src -name '*.c' ! -path 'src/cli/*' | sort)
BENCH_SRC ?= $(shell find bench -name '*.c' | sort)
CLI_SRC := $(shell find src/cli -name '*.c' | sort) $(BENCH_SRC)
TEST_SRC := $(shell find tests -name '*.c' ! -path 'tests/fuzz/*' ! -path 'tests/oracle/*' ! -path 'tests/preload/*' | sort)
# hardware/local-*.json are machine measurements (pdmoe calibrate --out), read from disk, never compiled in
EMBED   := $(sort $(filter-out hardware/local-%,$(wildcard models/*.json models/*.txt hardware/*.json validation/*.json)))

LIB_OBJ := $(LIB_SRC:%.c=$(BUILD)/%.o) $(BUILD)/gen/embedded.o
CLI_OBJ := $(CLI_SRC:%.c=$(BUILD)/%.o)
TEST_OBJ := $(TEST_SRC:%.c=$(BUILD)/%.o)

.PHONY: all test test-cluster bench clean
all: $(BUILD)/pdmoe

$(BUILD)/libpdmoe.a: $(LIB_OBJ)
	@rm -f $@
	ar rcs $@ $^

$(BUILD)/pdmoe: $(CLI_OBJ) $(BUILD)/libpdmoe.a
	$(CC) $(CFLAGS) -o $@ $^ $(LDLIBS) $(ANCHOR_LIBS)

# Each test runs inside tests/criterion_wrap.c's wrappers: an assertion in its fixtures' .fini and,
# under the sanitizers, a leak fail the test; a test that skips still runs its .fini.
$(BUILD)/pdmoe-tests: $(TEST_OBJ) $(BUILD)/bench/onednn.o $(BUILD)/bench/kernels.o $(BUILD)/bench/ceilings.o $(BUILD)/bench/bound.o \
                     $(BUILD)/bench/step.o $(BUILD)/bench/report.o \
                     $(BUILD)/libpdmoe.a | $(BUILD)/libclockshift.so $(BUILD)/libnothreads.so $(BUILD)/libnoport.so \
                     $(BUILD)/libexitstatus.so $(BUILD)/libtimewarp.so
	$(CC) $(CFLAGS) -Wl,--wrap=criterion_internal_test_main,--wrap=criterion_skip_test -o $@ $^ $(LDLIBS) $(ANCHOR_LIBS) \
	    $(shell pkg-config --libs criterion)

# LD_PRELOAD shims the tests start servers under (tests/preload/), without sanitizers in either
# build: a preloaded library comes before ASan's runtime, which it must not need.
$(BUILD)/lib%.so: tests/preload/%.c
	@mkdir -p $(dir $@)
	$(CC) -std=gnu11 -O2 -Wall -Wextra -Werror -fPIC -shared -o $@ $< -ldl

# The engine's logits for the float64 oracle of DeepSeek's official forward (tests/oracle/run.sh).
$(BUILD)/oracle-dump: $(BUILD)/tests/oracle/dump.o $(BUILD)/libpdmoe.a
	$(CC) $(CFLAGS) -o $@ $^ $(LDLIBS)

# Preset models and hardware files are compiled in, so `pdmoe plan` works from any directory.
$(BUILD)/gen/embedded.c: tools/embed.sh $(EMBED)
	@mkdir -p $(dir $@)
	sh tools/embed.sh $(EMBED) > $@

# The version and the commit built, rewritten only when they change (so main.o is rebuilt then).
PDMOE_VERSION := 0.5
$(BUILD)/gen/version.h: FORCE
	@mkdir -p $(dir $@)
	@printf '#define PDMOE_VERSION "%s"\n#define PDMOE_COMMIT "%s"\n' $(PDMOE_VERSION) \
	    "$$(git describe --always --dirty 2>/dev/null || echo unknown)" > $@.tmp
	@cmp -s $@.tmp $@ && rm $@.tmp || mv $@.tmp $@
$(BUILD)/src/cli/main.o: $(BUILD)/gen/version.h
.PHONY: FORCE
FORCE:

$(BUILD)/gen/embedded.o: $(BUILD)/gen/embedded.c
	$(CC) $(CFLAGS) -c -o $@ $<

$(BUILD)/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -MMD -MP -c -o $@ $<

# The default model (v4-flash-mini, ~7 s to generate): the tests that need it run on it, so
# `make test` on a fresh clone runs every test rather than skipping them.
MINI := models/mini/model.safetensors
# Written again when the generator or the preset changes, so a checkout never tests a stale model.
$(MINI): src/engine/genmodel.c src/plan/inventory.c models/v4-flash-mini.json | $(BUILD)/pdmoe
	./$(BUILD)/pdmoe gen-model --preset v4-flash-mini --out models/mini

# Tests run from the top of the tree (they read models/ and write to a temporary directory).
# Under sanitizers, tests/lsan.supp names the leaks of libraries pdmoe does not own (Criterion's runner).
# On a failure the failing tests and their whole messages (up to 80 lines each: a fault test's
# servers' logs; 8 lines cut them off, and with them why a CI run failed) are printed again at the
# end (from the TAP report), where a log's tail shows them.
# The test binary, pdmoe and the model are built on every core first (a plain `make test` would
# compile them one file at a time: about 70 s of CI's README stage, 150 s of its SAN stage).
# Tests run one more at a time than there are cores (TEST_JOBS): much of a test is waiting (for
# servers to start, timeouts to pass, children to exit), so on 2 cores two at a time kept the CPU
# busy 139-143% of 200% and three 166% (the suite under the sanitizers: 684 s at -j2, 599 s at
# -j3; the plain suite 323 s, 270 s).
NPROC := $(shell nproc 2>/dev/null || echo 1)
TEST_JOBS ?= $(shell echo $$(($(NPROC) + 1)))
test:
	$(MAKE) -j$(NPROC) $(BUILD)/pdmoe-tests $(BUILD)/pdmoe $(MINI)
	LSAN_OPTIONS=suppressions=$(CURDIR)/tests/lsan.supp PDMOE_BIN=$(BUILD)/pdmoe \
	    ./$(BUILD)/pdmoe-tests -j$(TEST_JOBS) --tap=$(BUILD)/tests.tap $(TEST_ARGS) || \
	    { echo "== failed:"; awk '/^not ok/ {p = 1; n = 0} p && n++ < 80 {print} /^  \.\.\.$$/ {p = 0}' $(BUILD)/tests.tap; exit 1; }

# Several hosts: network namespaces of this machine as hosts (root and iproute2; tests/cluster/).
# The seed's cluster shape across four hosts under one `pdmoe up --hosts`, then the KV hand-off
# over a shaped link against the performance model.
test-cluster: $(BUILD)/pdmoe $(MINI)
	bash tests/cluster/run.sh
	bash tests/cluster/shaped_link.sh

bench: $(BUILD)/pdmoe
	./$(BUILD)/pdmoe bench plan

clean:
	rm -rf build build-san

-include $(shell find $(BUILD) build-fuzz -name '*.d' 2>/dev/null)

# libFuzzer harnesses: every tests/fuzz/fuzz_NAME.c is a target linked against the whole library,
# built with clang in build-fuzz/ (instrumented for coverage, AddressSanitizer and UBSan); its seeds
# live in tests/fuzz/seeds/NAME/ (the repo's corpus) and what it finds goes to build-fuzz/corpus/NAME.
# `make fuzz FUZZ_SECONDS=30` runs each target for that long; a crash, leak or timeout fails.
FUZZ_SECONDS ?= 20
FUZZ_TIMEOUT ?= 10
FUZZ_NAMES := $(patsubst tests/fuzz/fuzz_%.c,%,$(wildcard tests/fuzz/fuzz_*.c))
FUZZ_BINS  := $(FUZZ_NAMES:%=build-fuzz/fuzz_%)
FUZZ_CFLAGS := -std=gnu11 -g -O1 -march=x86-64-v2 -Isrc -I. -Ibuild-fuzz/gen $(PKG_CFLAGS) -pthread \
               -fsanitize=address,undefined -fno-sanitize-recover=undefined -Wno-unused-command-line-argument
FUZZ_LIB_OBJ := $(LIB_SRC:%.c=build-fuzz/%.o) build-fuzz/gen/embedded.o

fuzz: $(FUZZ_BINS)
	@set -e; for t in $(FUZZ_NAMES); do \
	  echo "== fuzz $$t for $(FUZZ_SECONDS) s"; mkdir -p build-fuzz/corpus/$$t tests/fuzz/seeds/$$t; \
	  ./build-fuzz/fuzz_$$t -max_total_time=$(FUZZ_SECONDS) -timeout=$(FUZZ_TIMEOUT) -max_len=8192 \
	      -print_final_stats=0 build-fuzz/corpus/$$t tests/fuzz/seeds/$$t; done
fuzz-build: $(FUZZ_BINS)

build-fuzz/gen/embedded.c: tools/embed.sh $(EMBED)
	@mkdir -p $(dir $@)
	sh tools/embed.sh $(EMBED) > $@

build-fuzz/%.o: %.c
	@mkdir -p $(dir $@)
	clang $(FUZZ_CFLAGS) -fsanitize=fuzzer-no-link -MMD -MP -c -o $@ $<

build-fuzz/libpdmoe.a: $(FUZZ_LIB_OBJ)
	@rm -f $@
	ar rcs $@ $^

build-fuzz/fuzz_%: tests/fuzz/fuzz_%.c build-fuzz/libpdmoe.a
	clang $(FUZZ_CFLAGS) -fsanitize=fuzzer -o $@ $< build-fuzz/libpdmoe.a $(PKG_LIBS) -lm
.PHONY: fuzz fuzz-build
