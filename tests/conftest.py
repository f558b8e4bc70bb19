"""Test environment: Triton in interpreter mode on the CPU, Hugging Face offline, fresh seeds.

Every random test draws a fresh seed and prints it; set SPARSECAL_TEST_SEED to replay one.
"""
import os
import secrets

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402


@pytest.fixture
def seed(request):
    value = int(os.environ.get("SPARSECAL_TEST_SEED", secrets.randbelow(2**31)))
    print(f"\n[{request.node.name}] SPARSECAL_TEST_SEED={value}")
    return value
