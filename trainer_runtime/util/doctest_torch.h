#pragma once

// doctest for test files that include LibTorch: LibTorch pulls in glog, whose CHECK macros
// would shadow doctest's, so they are dropped and doctest comes after every torch header.
// Include this last.

#undef CHECK
#undef CHECK_EQ
#undef CHECK_NE
#undef CHECK_LT
#undef CHECK_LE
#undef CHECK_GT
#undef CHECK_GE
#include <doctest/doctest.h>
