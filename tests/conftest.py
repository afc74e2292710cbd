"""Shared fixtures; the helpers tests import are in helpers.py."""
from __future__ import annotations

import pytest
import torch

# datasets' logger binds its handler to the sys.stderr of its first use: importing it here binds the
# session's, not the captured stream of the first test that reads a dataset (closed when that test
# ends, so the next one's log record would print a logging error's traceback into its output)
import datasets  # noqa: E402,F401


@pytest.fixture
def cuda_only():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


@pytest.fixture(autouse=True, scope="session")
def compiled_kernels_never_fall_back():
    """A compiled kernel built more than dynamo's recompile_limit times in one process runs its
    library ops from then on, silently (megatrain/kernel_build.py); the test process, which trains
    many models, raises instead, so that a test of a kernel cannot pass on the library's ops."""
    import torch._dynamo.config as dynamo
    with dynamo.patch(fail_on_recompile_limit_hit=True):
        yield


def pytest_collection_modifyitems(config, items):
    """The tests marked `slow` first, each file's own order kept (a stable sort): `make test`'s two
    workers (pytest-xdist) then end on the quick tests, not on one worker's minutes-long workflow run
    while the other waits."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
