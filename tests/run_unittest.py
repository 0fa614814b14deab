"""Runs one unittest module as CTest's command for it (cmake/testing.cmake's add_py_test), so that
a skip cannot pass for a success: what `python3 -m unittest -v MODULE` prints, then a summary,
then the exit status CTest reads: 1 when a case failed or none ran (nor was skipped), 77 (SKIP_RETURN_CODE) when a
case was skipped, 0 when every case ran and passed. Each skipped case is written to
$LAUNCH_SKIP_FILE with its kind (harness.needs_setup / harness.env_dependent), for
scripts/skip_report.

Usage: run_unittest.py MODULE"""

import os
import sys
import time
import unittest

import harness

SKIP_RETURN_CODE = 77


class TimedResult(unittest.TextTestResult):
    """unittest's verbose result, each case's wall time kept: the summary lists the slowest, so
    that whoever trims CI's time sees where a module's time goes without re-running it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.times = []
        self._started = 0.0

    def startTest(self, test):
        self._started = time.monotonic()
        super().startTest(test)

    def stopTest(self, test):
        self.times.append((time.monotonic() - self._started, test.id()))
        super().stopTest(test)


def main(argv):
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    module = argv[1]
    skip_file = os.environ.get("LAUNCH_SKIP_FILE")
    if skip_file:
        # A skip file left by an earlier run must not outlive this one.
        try:
            os.unlink(skip_file)
        except FileNotFoundError:
            pass
    suite = unittest.defaultTestLoader.loadTestsFromName(module)
    result = unittest.TextTestRunner(verbosity=2, stream=sys.stderr,
                                     resultclass=TimedResult).run(suite)
    sys.stderr.flush()
    if len(result.times) > 1:
        print(f"run_unittest: {module}: slowest cases (wall s):")
        for seconds, case in sorted(result.times, reverse=True)[:8]:
            print(f"  {seconds:7.1f}  {case}")
    skipped = [(case.id(), reason) for case, reason in result.skipped]
    if skipped:
        print(f"run_unittest: {module}: {len(skipped)} of {result.testsRun} skipped:")
        lines = []
        for case, reason in skipped:
            kind, text = harness.skip_kind(reason)
            print(f"  [{kind}] {case}: {text}")
            lines.append(f"{kind}\t{case}\t{' '.join(text.split())}\n")
        if skip_file:
            os.makedirs(os.path.dirname(skip_file), exist_ok=True)
            with open(skip_file, "w") as f:
                f.writelines(lines)
    sys.stdout.flush()
    if not result.wasSuccessful():
        return 1
    if result.testsRun == 0 and not skipped:
        print(f"run_unittest: {module}: no test ran")
        return 1
    return SKIP_RETURN_CODE if skipped else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
