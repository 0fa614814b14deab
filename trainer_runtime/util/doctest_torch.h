#pragma once

// doctest for the test files of trainer_runtime_test: LibTorch's logging header defines glog's
// CHECK macros, which would shadow doctest's (a failed check would abort the binary rather than
// fail the case). Include this last in every file of that binary, with or without LibTorch: in
// a unity build (LAUNCH_UNITY_BUILD) doctest.h may have been read earlier in the translation
// unit, before a later file's LibTorch headers redefined CHECK, and its include guard would
// then leave glog's; so doctest's names are defined again here, after it.

#include <doctest/doctest.h>

#undef CHECK
#undef CHECK_EQ
#undef CHECK_NE
#undef CHECK_LT
#undef CHECK_LE
#undef CHECK_GT
#undef CHECK_GE
#define CHECK(...) DOCTEST_CHECK(__VA_ARGS__)
#define CHECK_EQ(...) DOCTEST_CHECK_EQ(__VA_ARGS__)
#define CHECK_NE(...) DOCTEST_CHECK_NE(__VA_ARGS__)
#define CHECK_LT(...) DOCTEST_CHECK_LT(__VA_ARGS__)
#define CHECK_LE(...) DOCTEST_CHECK_LE(__VA_ARGS__)
#define CHECK_GT(...) DOCTEST_CHECK_GT(__VA_ARGS__)
#define CHECK_GE(...) DOCTEST_CHECK_GE(__VA_ARGS__)
