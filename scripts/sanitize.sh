#!/usr/bin/env bash
# AddressSanitizer + UndefinedBehaviorSanitizer build of the test suite (clang, CUDA off, benches
# off, undefined behaviour fatal) in build-asan, then ctest on it with the checked-in suppressions
# of tests/sanitizers/. Exits non-zero when a test fails, i.e. on any sanitizer report.
#
#   scripts/sanitize.sh [ctest args]     default: -L 'unit|e2e' -E "$default_exclude" (below)
#
# What is built (SANITIZE_TARGETS, default below; "all" = every target) decides what runs: ctest
# sees the GoogleTest cases of the executables that were built (gtest_discover_tests) and a
# placeholder "<target>_NOT_BUILT" for the others, which the default arguments leave out, as
# they leave out the script tests (clients.*, security.*, metrics.*, chat_template_fixtures_fresh:
# they drive binaries this subset does not build) and the 8192-token perplexity goldens (a
# 14M-parameter model's forward over 8K tokens under ASan takes minutes, and adds no code path
# over the 32-token goldens), and the engine suites that run stories260k: its SentencePiece
# tokenizer needs RTLD_DEEPBIND, which ASan refuses, and without it libsentencepiece's bundled
# protobuf fails its version check in any process that also holds gRPC's libprotobuf (see
# gpu_worker/tokenizer/sp_processor.cc). The Gutenberg-14m (byte-level BPE) engine suites run.
# The default subset is every CPU-side test executable but the multi-host ones and the
# gateway's e2e suite: the libraries where requests, KV memory and model files are handled
# (kv_store, cpu_attention and its node and gRPC service, the model / tokenizer / CPU backend /
# engine of the worker, placement, metrics, the chat-template engine and the gateway's request
# and response mapping). multihost needs root and network namespaces, and
# generation_service_test and the binaries suites run stories260k (below) in real processes.
#
# Env: SANITIZE_BUILD_DIR (default <repo>/build-asan), JOBS (default nproc), NICE (default 19),
# SANITIZE_TARGETS (targets to build).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$root/scripts/compiler_cache.sh"
build=${SANITIZE_BUILD_DIR:-$root/build-asan}
jobs=${JOBS:-$(nproc)}
nice_level=${NICE:-19}

if [ ! -f "$build/CMakeCache.txt" ]; then
  # -O1 -g1: ASan's recommended optimisation, line tables for symbolized reports; NDEBUG is not
  # defined, so the code's own assertions run too.
  CC=clang CXX=clang++ cmake -S "$root" -B "$build" -G Ninja \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1" \
    "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O1 -g1" -DTANDEM_ENABLE_CUDA=OFF -DTANDEM_BUILD_BENCH=OFF \
    -DTANDEM_SANITIZE=ON "${compiler_launcher[@]}"
fi
default_targets="common_byte_size_test kv_store_test cpu_attention_kernel_test
  cpu_attention_paged_test cpu_attention_shm_test cpu_attention_shm_handler_test
  cpu_attention_service_test cpu_attention_paged_node_test cpu_attention_lease_test metrics_test
  backend_cpu_test
  gpu_model_test gpu_model_rope_test gpu_worker_rope_reference_test gpu_worker_geometry_test
  gpu_worker_random_model_test tokenizer_test placement_planner_test node_loss_test
  gpu_worker_engine_test chat_template_engine_test chat_template_fixtures_test
  gateway_openai_test"
targets=()
if [ "${SANITIZE_TARGETS:-}" != all ]; then
  for t in ${SANITIZE_TARGETS:-$default_targets}; do targets+=(--target "$t"); done
fi
nice -n "$nice_level" cmake --build "$build" -j "$jobs" "${targets[@]}"

supp=$root/tests/sanitizers
# Child processes the tests start (the real binaries) inherit these.
export ASAN_OPTIONS="detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1:check_initialization_order=1:suppressions=$supp/asan.supp${ASAN_EXTRA:+:$ASAN_EXTRA}"
export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:suppressions=$supp/ubsan.supp"
cd "$build"
default_exclude='_NOT_BUILT$|^(clients|security|metrics)\.|^chat_template_fixtures_fresh$|PerplexityAt8192'
default_exclude+='|^(Stories260k|EngineRequests|PageSelectionEngine|SchedulerTest|SchedulerOptionsTest'
default_exclude+='|EngineLogprobs|EosChatTest|ExactEngine)\.'
# The device-prefill engine cases serve stories260k (all of DevicePrefill.*); its runner-level
# case (DevicePrefillRunner.*) and WindowWiden run.
default_exclude+='|^DevicePrefill\.'
# So do the prompt-settle engine cases (PromptSettleRing, the window's part, runs) and the
# prefix cache's engine cases (PrefixCacheIndex, the index, runs).
default_exclude+='|^PromptSettle\.|^EnginePrefixCache\.'
# And the prompt-text bound's stories260k case (its gutenberg-14m case runs), and the scheduler's
# parameterised engine cases (prefill breaks, decode gaps), which serve stories260k as
# SchedulerTest does (their runner-level part, PassBreaksTest, runs).
default_exclude+='|PromptBoundTest\..*stories260k|/SchedulerBreaksTest\.|/SchedulerDecodeGapTest\.'
if [ $# -eq 0 ]; then set -- -L 'unit|e2e' -E "$default_exclude"; fi
nice -n "$nice_level" ctest --output-on-failure --timeout 900 -j "$jobs" "$@"
