# tandem_warnings(target): the project's warning set, applied to every first-party target.
function(tandem_warnings target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter>)
endfunction()

# tandem_add_test(NAME name SOURCES ... LIBS ... LABELS ... [ISA_PATHS]): one GoogleTest
# executable, discovered test by test so ctest -L unit|e2e|gpu selects them.
#
# ISA_PATHS: the tests run again under each lesser instruction-set path of the CPU kernels, so a
# machine with AVX-512 still tests what an AVX2-only or baseline x86-64 host runs: ctest names
# them isa_avx2.<Suite.Test> and isa_portable.<Suite.Test> (select them with -R '^isa_') and sets
# TANDEM_CPU_ISA (tandem/cpu_isa; a process started with it caps oneDNN to match). On a CPU
# without the set, the cap changes nothing and the run repeats the native path.
function(tandem_add_test)
  cmake_parse_arguments(T "ISA_PATHS" "NAME" "SOURCES;LIBS;LABELS" ${ARGN})
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
endfunction()
