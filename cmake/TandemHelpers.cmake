# tandem_warnings(target): the project's warning set, applied to every first-party target.
function(tandem_warnings target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter>)
endfunction()

# tandem_add_test(NAME name SOURCES ... LIBS ... LABELS ... [ISA_PATHS] [AVX2_CPU]
#                 [AVX2_CPU_FILTER gtest-filter]): one GoogleTest executable, discovered test by
# test so ctest -L unit|e2e|gpu selects them.
#
# ISA_PATHS: the tests run again under each lesser instruction-set path of the CPU kernels, so a
# machine with AVX-512 still tests what an AVX2-only or baseline x86-64 host runs: ctest names
# them isa_avx2.<Suite.Test> and isa_portable.<Suite.Test> (select them with -R '^isa_') and sets
# TANDEM_CPU_ISA (tandem/cpu_isa; a process started with it caps oneDNN to match). On a CPU
# without the set, the cap changes nothing and the run repeats the native path.
#
# AVX2_CPU: where qemu-x86_64 is installed, the executable also runs whole (or its
# AVX2_CPU_FILTER) under qemu's AMD EPYC Rome model, whose CPUID has AVX2 and FMA and no AVX-512:
# what an AVX2-only host's dispatch, tandem's and oneDNN's own, sees rather than a cap. One ctest
# test, avx2_cpu.<name>, label "emulated", ~10x slower than native. qemu-user does not follow
# exec, so child processes run natively, on the forced AVX2 path (TANDEM_CPU_ISA=avx2);
# TANDEM_EXPECT_NATIVE_CPU_ISA=avx2 lets common_cpu_isa_test check that the model still hides
# AVX-512.
function(tandem_add_test)
  cmake_parse_arguments(T "ISA_PATHS;AVX2_CPU" "NAME;AVX2_CPU_FILTER" "SOURCES;LIBS;LABELS"
    ${ARGN})
  add_executable(${T_NAME} ${T_SOURCES})
  target_link_libraries(${T_NAME} PRIVATE ${T_LIBS} GTest::gtest GTest::gtest_main)
  tandem_warnings(${T_NAME})
  if(NOT T_LABELS)
    set(T_LABELS unit)
  endif()
  gtest_discover_tests(${T_NAME}
    PROPERTIES LABELS "${T_LABELS}"
    DISCOVERY_TIMEOUT 60)
  if(T_ISA_PATHS)
    foreach(isa avx2 portable)
      gtest_discover_tests(${T_NAME}
        TEST_PREFIX "isa_${isa}."
        PROPERTIES LABELS "${T_LABELS}" ENVIRONMENT "TANDEM_CPU_ISA=${isa}"
        DISCOVERY_TIMEOUT 60)
    endforeach()
  endif()
  # Debian's qemu-user (scripts/setup.sh) runs x86-64 executables on a CPU model of our
  # choosing; not in sanitizer builds (their shadow memory does not map under it).
  if(T_AVX2_CPU AND CMAKE_SYSTEM_PROCESSOR MATCHES "x86_64|AMD64" AND NOT TANDEM_SANITIZE
     AND NOT TANDEM_BUILD_FUZZERS)
    find_program(TANDEM_QEMU_X86_64 qemu-x86_64)
    if(TANDEM_QEMU_X86_64)
      set(filter)
      if(T_AVX2_CPU_FILTER)
        set(filter "--gtest_filter=${T_AVX2_CPU_FILTER}")
      endif()
      add_test(NAME avx2_cpu.${T_NAME}
        COMMAND ${TANDEM_QEMU_X86_64} -cpu EPYC-Rome $<TARGET_FILE:${T_NAME}> --gtest_brief=1
          ${filter})
      set_tests_properties(avx2_cpu.${T_NAME} PROPERTIES LABELS emulated TIMEOUT 1200
        ENVIRONMENT "TANDEM_CPU_ISA=avx2;TANDEM_EXPECT_NATIVE_CPU_ISA=avx2")
    endif()
  endif()
endfunction()
