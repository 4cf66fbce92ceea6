"""GPU tests (-m gpu): the launchers' memoised plans are forgotten around each test, as in
tests/unit/kernels (a test may patch a planning function)."""

import pytest


@pytest.fixture(autouse=True)
def fresh_plans():
    from kernels.triton.launch import clear_plans

    clear_plans()
    yield
    clear_plans()
