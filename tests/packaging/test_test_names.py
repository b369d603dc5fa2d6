"""pytest imports test modules by their basename (no __init__.py in tests/): two files with
one name in different folders stop the whole run at collection."""

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).parents[1]


def test_every_test_module_has_a_name_of_its_own():
    names = Counter(path.name for path in TESTS.rglob("*.py") if path.name != "conftest.py")
    assert [name for name, count in names.items() if count > 1] == []
