# How tests are registered with CTest, so that a skipped test is reported as skipped and never as
# passed (docs/layout.md, "Tests"). Every test registered here follows one protocol:
#   - exit 77 when something was skipped and nothing failed (CTest's SKIP_RETURN_CODE: the test
#     shows as "Skipped", and `ctest` lists it under "The following tests did not run");
#   - write one line per skipped case to $LAUNCH_SKIP_FILE: KIND<TAB>CASE<TAB>REASON, KIND being
#     `setup` (a binary, package or data set that scripts/setup provides is missing), `env` (this
#     machine cannot run it: no CAP_NET_ADMIN, no GPU...) or `unmarked` (the skip did not say).
# scripts/skip_report reads those files: scripts/test fails on any skip that is not `env`.
# Included by the top CMakeLists.txt, and by tests/skips/'s throwaway projects that check this.

set(LAUNCH_SKIP_RETURN_CODE 77)
# The tests' skip files; scripts/test empties it before each run.
set(LAUNCH_SKIP_DIR ${CMAKE_BINARY_DIR}/Testing/skips)
# Python tests run under Debian's /usr/bin/python3 (which has torch).
find_program(SYSTEM_PYTHON NAMES python3 PATHS /usr/bin NO_DEFAULT_PATH)
find_path(DOCTEST_INCLUDE_DIR doctest/doctest.h)
set(LAUNCH_TESTING_DIR ${CMAKE_CURRENT_LIST_DIR})

# launch_test_skips(NAME): the skip protocol's half on CTest's side, for a test registered with
# add_test (a shell test calls it itself; add_doctest and add_py_test do).
function(launch_test_skips name)
  set_property(TEST ${name} PROPERTY SKIP_RETURN_CODE ${LAUNCH_SKIP_RETURN_CODE})
  set_property(TEST ${name} APPEND PROPERTY ENVIRONMENT
               "LAUNCH_SKIP_FILE=${LAUNCH_SKIP_DIR}/${name}.tsv")
endfunction()

# add_doctest(NAME SOURCES... LIBS ...): one doctest binary per module, registered with CTest.
# base/doctest_main.cc is its main(): base/test_skip.h's skips follow the protocol above.
function(add_doctest name)
  cmake_parse_arguments(T "" "" "SOURCES;LIBS" ${ARGN})
  add_executable(${name} ${LAUNCH_TESTING_DIR}/../base/doctest_main.cc ${T_SOURCES})
  # It defines DOCTEST_CONFIG_IMPLEMENT before doctest.h: batched after a test file, the
  # header's guard would leave doctest unimplemented.
  set_source_files_properties(${LAUNCH_TESTING_DIR}/../base/doctest_main.cc
                              TARGET_DIRECTORY ${name} PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)
  target_include_directories(${name} PRIVATE ${DOCTEST_INCLUDE_DIR} ${LAUNCH_TESTING_DIR}/..)
  target_link_libraries(${name} PRIVATE ${T_LIBS})
  add_test(NAME ${name} COMMAND ${name})
  launch_test_skips(${name})
endfunction()

# add_py_test(NAME FILE [TIMEOUT s]): registers one unittest file, run by tests/run_unittest.py
# (unittest -v plus the skip protocol above). The file's own folder and tests/ (harness.py) are on
# PYTHONPATH; the working directory is the repo. TIMEOUT only guards against a hang that escaped
# the test's own bounded waits: it is no speed check (CI runs two suites side by side on two
# cores, where a test takes several times what it takes alone), so the default of 600 s stays
# unless a file needs more.
function(add_py_test name file)
  cmake_parse_arguments(T "" "TIMEOUT" "" ${ARGN})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 600)
  endif()
  get_filename_component(abs ${file} ABSOLUTE BASE_DIR ${CMAKE_CURRENT_SOURCE_DIR})
  get_filename_component(dir ${abs} DIRECTORY)
  get_filename_component(module ${abs} NAME_WE)
  get_filename_component(repo ${LAUNCH_TESTING_DIR}/.. ABSOLUTE)
  add_test(NAME ${name}
           COMMAND ${SYSTEM_PYTHON} ${repo}/tests/run_unittest.py ${module}
           WORKING_DIRECTORY ${repo})
  set_tests_properties(${name} PROPERTIES TIMEOUT ${T_TIMEOUT}
                       ENVIRONMENT "LAUNCH_BIN_DIR=${CMAKE_BINARY_DIR}/bin;PYTHONPATH=${dir}:${repo}/tests;PYTHONDONTWRITEBYTECODE=1")
  launch_test_skips(${name})
endfunction()
