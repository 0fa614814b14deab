"""A skipped test must not pass for a passed one. A throwaway CMake project registers tests that
skip on purpose through the same functions as the real suite (cmake/testing.cmake: add_py_test,
add_doctest, launch_test_skips with tests/skip.sh); CTest must report them as "Skipped" (a
failure with a skip as "Failed"), and scripts/skip_report, scripts/test's check, must fail on a
[setup] or unmarked skip and list an [env] one without failing."""

import os
import re
import shutil
import subprocess
import textwrap
import unittest

import harness

CMAKE = shutil.which("cmake")
NINJA = shutil.which("ninja")
SKIP_REPORT = os.path.join(harness.REPO, "scripts", "skip_report")

# Each dummy test file: what its cases do.
PY_TESTS = {
    "dummy_setup": """
        class T(unittest.TestCase):
            def test_runs(self):
                pass

            @unittest.skipUnless(False, harness.needs_setup("the dummy binary is not built"))
            def test_needs_a_binary(self):
                pass
    """,
    "dummy_env": """
        class T(unittest.TestCase):
            def test_needs_a_gpu(self):
                self.skipTest(harness.env_dependent("no GPU on this dummy machine"))
    """,
    "dummy_unmarked": """
        class T(unittest.TestCase):
            def test_says_nothing(self):
                self.skipTest("some reason of no kind")
    """,
    "dummy_fails": """
        class T(unittest.TestCase):
            def test_skips(self):
                self.skipTest(harness.env_dependent("skipped, but a sibling fails"))

            def test_fails(self):
                self.fail("on purpose")
    """,
    "dummy_passes": """
        class T(unittest.TestCase):
            def test_passes(self):
                pass
    """,
}

DOCTEST = """
    #include <doctest/doctest.h>

    #include "base/test_skip.h"

    TEST_CASE("RunsAndPasses") { CHECK(1 + 1 == 2); }

    TEST_CASE("NeedsAGpu") {
      launch::testing::SkipEnvDependent("no GPU on this dummy machine");
      return;
    }
"""


def ctest_statuses(output):
    """{test name: status word} from ctest's per-test lines ("1/5 Test #1: name ....   Passed")."""
    found = {}
    for m in re.finditer(r"Test\s+#\d+: (\S+) \.+\**\s*(Passed|Failed|\*\*\*Skipped|Skipped|"
                         r"Not Run|\*\*\*Failed|Exception)", output):
        found[m.group(1)] = m.group(2).strip("*")
    return found


@unittest.skipUnless(CMAKE and NINJA, harness.needs_setup("cmake and ninja are not installed"))
class SkipProtocolTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.src = harness.tmpdir()
        cls.build = os.path.join(cls.src, "build")
        lines = ["cmake_minimum_required(VERSION 3.16)", "project(dummy CXX)", "enable_testing()",
                 f"include({harness.REPO}/cmake/testing.cmake)"]
        for name, body in PY_TESTS.items():
            with open(os.path.join(cls.src, f"{name}.py"), "w") as f:
                f.write("import unittest\n\nimport harness\n\n" + textwrap.dedent(body))
            lines.append(f"add_py_test({name} {name}.py TIMEOUT 60)")
        with open(os.path.join(cls.src, "dummy_doctest.cc"), "w") as f:
            f.write(textwrap.dedent(DOCTEST))
        lines.append("add_doctest(dummy_doctest SOURCES dummy_doctest.cc)")
        lines.append(f"add_test(NAME dummy_shell COMMAND {harness.REPO}/tests/skip.sh setup "
                     "dummy_shell \"clang++ not installed\")")
        lines.append("launch_test_skips(dummy_shell)")
        with open(os.path.join(cls.src, "CMakeLists.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
        for cmd in ([CMAKE, "-S", cls.src, "-B", cls.build, "-G", "Ninja"],
                    [CMAKE, "--build", cls.build]):
            r = harness.run(cmd, timeout=240)
            assert r.returncode == 0, f"{cmd}: {r.stdout}\n{r.stderr}"

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.src, ignore_errors=True)

    def ctest(self, *args):
        shutil.rmtree(os.path.join(self.build, "Testing", "skips"), ignore_errors=True)
        return harness.run(["ctest", "--test-dir", self.build, *args], timeout=240)

    def skip_report(self):
        return harness.run([SKIP_REPORT, self.build], timeout=60)

    def test_ctest_reports_skips_as_skipped_and_skip_report_fails_on_setup_ones(self):
        r = self.ctest()
        statuses = ctest_statuses(r.stdout)
        self.assertEqual(statuses, {
            "dummy_setup": "Skipped", "dummy_env": "Skipped", "dummy_unmarked": "Skipped",
            "dummy_fails": "Failed", "dummy_passes": "Passed", "dummy_doctest": "Skipped",
            "dummy_shell": "Skipped"}, r.stdout)
        self.assertNotEqual(r.returncode, 0, r.stdout)  # dummy_fails
        report = self.skip_report()
        self.assertEqual(report.returncode, 1, report.stdout + report.stderr)
        out = report.stdout
        self.assertIn("[setup] dummy_setup: dummy_setup.T.test_needs_a_binary: "
                      "the dummy binary is not built", out)
        self.assertIn("[env] dummy_env: dummy_env.T.test_needs_a_gpu: no GPU on this dummy "
                      "machine", out)
        self.assertIn("[unmarked] dummy_unmarked: dummy_unmarked.T.test_says_nothing: some "
                      "reason of no kind", out)
        self.assertIn("[env] dummy_doctest: NeedsAGpu: no GPU on this dummy machine", out)
        self.assertIn("[setup] dummy_shell: dummy_shell: clang++ not installed", out)
        self.assertIn("FAILED: 3 skipped", out)

    def test_env_skips_alone_are_listed_and_pass(self):
        r = self.ctest("-R", "dummy_(env|passes|doctest)$")
        statuses = ctest_statuses(r.stdout)
        self.assertEqual(statuses, {"dummy_env": "Skipped", "dummy_passes": "Passed",
                                    "dummy_doctest": "Skipped"}, r.stdout)
        # CTest itself does not fail on a skip: scripts/skip_report is the check.
        self.assertEqual(r.returncode, 0, r.stdout)
        report = self.skip_report()
        self.assertEqual(report.returncode, 0, report.stdout + report.stderr)
        self.assertIn("skips: 2 test case(s) skipped", report.stdout)
        self.assertIn("[env] dummy_env: dummy_env.T.test_needs_a_gpu", report.stdout)
        self.assertNotIn("[setup]", report.stdout)

    def test_a_fixed_setup_leaves_no_stale_skip(self):
        # The skip files are rewritten by each test's own run: a test that stops skipping
        # (its binary built since) leaves nothing for skip_report, even without scripts/test's
        # clean-up of the folder.
        skips = os.path.join(self.build, "Testing", "skips")
        os.makedirs(skips, exist_ok=True)
        stale = os.path.join(skips, "dummy_passes.tsv")
        with open(stale, "w") as f:
            f.write("setup\tdummy_passes.T.test_passes\tstale\n")
        r = harness.run(["ctest", "--test-dir", self.build, "-R", "dummy_passes$"], timeout=60)
        self.assertEqual(r.returncode, 0, r.stdout)
        self.assertFalse(os.path.exists(stale))


if __name__ == "__main__":
    unittest.main()
