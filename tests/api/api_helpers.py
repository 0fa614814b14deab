"""What the tests of the public API share: reading the parameter files their check programs
write (raw float32, in parameter order) and comparing them."""

import array
import math


def floats(path):
    """The float32 values of a file written by a check program's WriteParams."""
    a = array.array("f")
    with open(path, "rb") as f:
        a.frombytes(f.read())
    return list(a)


def rel_diff(a, b):
    """||a - b|| / ||b|| (||b|| taken as 1 when it is 0)."""
    assert len(a) == len(b), (len(a), len(b))
    num = math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b)))
    den = math.sqrt(sum(y * y for y in b)) or 1.0
    return num / den
