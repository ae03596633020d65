"""Shared by every test: pytest rewrites the asserts of the helper modules too, so a failing
comparison inside a helper explains itself as one in a test does."""

import pytest

pytest.register_assert_rewrite("tests.helpers", "tests.proc_helpers")
