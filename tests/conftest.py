"""Suite-wide checks before collection.

The HF tests (test_hf*.py, test_model_hf.py, checkpoint export, fine-tuning) compare with
transformers and skip themselves (`importorskip`) when it is missing. The `dev` extra installs
it, so a missing transformers means a broken environment, not a reason to skip: the run fails at
once with one line, unless HYBRID2D_ALLOW_NO_TRANSFORMERS=1 says skipping is intended.
"""

import os

import pytest


def pytest_configure(config):
    if os.environ.get("HYBRID2D_ALLOW_NO_TRANSFORMERS") == "1":
        return
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise pytest.UsageError(
            f"transformers cannot be imported ({e}), so every HF test would be skipped: "
            'pip install -e ".[dev]" (or set HYBRID2D_ALLOW_NO_TRANSFORMERS=1 to skip them)'
        ) from None
