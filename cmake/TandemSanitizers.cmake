# Sanitizer and fuzzing builds (issue 14 item 4). Both options are OFF by default and then change
# nothing. Each needs its own build directory configured with clang (CC=clang CXX=clang++):
#
#   TANDEM_SANITIZE=ON        every first-party and test target is built with AddressSanitizer +
#                             UndefinedBehaviorSanitizer; undefined behaviour is fatal
#                             (-fno-sanitize-recover), so a test that hits it fails.
#                             scripts/sanitize.sh configures build-asan and runs ctest there with
#                             the options and suppressions of tests/sanitizers/.
#   TANDEM_BUILD_FUZZERS=ON   as above, plus libFuzzer coverage instrumentation
#                             (-fsanitize=fuzzer-no-link) and the targets of tests/fuzz/.
#                             scripts/fuzz.sh builds build-fuzz and runs them.
#
# The flags go on the whole directory tree (add_compile_options), so system libraries (gRPC,
# protobuf, absl, oneDNN) stay uninstrumented: ASan still checks every access made by our code,
# and the odr / container-overflow reports that mixing can cause are handled in
# tests/sanitizers/asan.supp and the ASAN_OPTIONS of scripts/sanitize.sh, not by turning checks
# off here.
option(TANDEM_SANITIZE "Build with AddressSanitizer + UndefinedBehaviorSanitizer (clang)" OFF)
option(TANDEM_BUILD_FUZZERS "Build the libFuzzer targets of tests/fuzz (clang; implies sanitizers)"
  OFF)

if(TANDEM_SANITIZE OR TANDEM_BUILD_FUZZERS)
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    message(FATAL_ERROR "TANDEM_SANITIZE / TANDEM_BUILD_FUZZERS need clang "
      "(configure with CC=clang CXX=clang++); found ${CMAKE_CXX_COMPILER_ID}")
  endif()
  if(TANDEM_ENABLE_CUDA)
    message(FATAL_ERROR "TANDEM_SANITIZE / TANDEM_BUILD_FUZZERS need -DTANDEM_ENABLE_CUDA=OFF")
  endif()
  set(tandem_sanitizer_flags
    -fsanitize=address,undefined
    # UB aborts the process (the test fails) instead of printing and carrying on.
    -fno-sanitize-recover=undefined
    -fno-omit-frame-pointer)
  if(TANDEM_BUILD_FUZZERS)
    list(APPEND tandem_sanitizer_flags -fsanitize=fuzzer-no-link)
  endif()
  # C and C++ only: the flags must not reach a CUDA compiler.
  add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:${tandem_sanitizer_flags}>")
  add_link_options(-fsanitize=address,undefined)
endif()

# tandem_add_fuzzer(NAME name SOURCES ... LIBS ... CORPUS dir): one libFuzzer executable
# (LLVMFuzzerTestOneInput in SOURCES) and a ctest `fuzz.<name>.corpus` (label fuzz) that replays
# every input of its checked-in seed corpus, so a fixed crash stays fixed in the sanitizer build.
function(tandem_add_fuzzer)
  cmake_parse_arguments(F "" "NAME;CORPUS" "SOURCES;LIBS" ${ARGN})
  add_executable(${F_NAME} ${F_SOURCES})
  target_link_libraries(${F_NAME} PRIVATE ${F_LIBS})
  target_link_options(${F_NAME} PRIVATE -fsanitize=fuzzer)
  tandem_warnings(${F_NAME})
  add_test(NAME fuzz.${F_NAME}.corpus
    COMMAND ${F_NAME} -rss_limit_mb=2048 -malloc_limit_mb=512 -runs=0 ${F_CORPUS})
  set_tests_properties(fuzz.${F_NAME}.corpus PROPERTIES LABELS fuzz TIMEOUT 120)
endfunction()
