"""Each mutation of tests/mutations.py still applies: its line is in its file exactly once, and
the tests that guard it exist. (The mutation check itself runs by hand, for minutes; a mutation
whose line moved would otherwise be found stale only then.)"""

from __future__ import annotations

import re

import pytest

from tests.mutations import MUTATIONS, REPO


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.name)
def test_the_mutation_applies_and_its_tests_exist(mutation):
    text = (REPO / mutation.file).read_text()
    assert text.count(mutation.old) == 1, f"{mutation.name}: {mutation.old!r} is in {mutation.file} " \
                                          f"{text.count(mutation.old)} times: update the mutation"
    for test in mutation.tests:
        path, _, name = test.partition("::")
        function = re.sub(r"\[.*\]$", "", name)
        assert re.search(rf"^def {re.escape(function)}\(", (REPO / path).read_text(), re.M), test
