"""Shared fixtures: real tokenizers are loaded once per session (~1-2 s each)."""

import pytest

from hacpo.models.policy import PolicyConfig, build_policy
from hacpo.models.tokenizer import load_tokenizer

MATH_TEXTS = [
    "Tom has 3 apples. He buys 12 more and gives away 4. How many apples does he have?",
    "Step 1: 3 + 12 = 15.\nStep 2: 15 - 4 = 11.\nThe answer is 11.",
    "A train travels 60 km/h for 2.5 hours: 60 * 2.5 = 150 km. Answer: 150",
    "If x = 7, then 3x - 2 = 19 (since 21 - 2 = 19). The answer is $19$.",
]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here on one torch thread (tests/conftest.py)."""


@pytest.fixture(scope="session")
def qwen3():
    return load_tokenizer("qwen3")


@pytest.fixture(scope="session")
def llama32():
    return load_tokenizer("llama3.2")


@pytest.fixture(scope="session")
def qwen3_reduced():
    return load_tokenizer("qwen3", corpus=MATH_TEXTS)


@pytest.fixture(scope="module", params=["decoder", "llama", "qwen2"])
def policy(request):
    """One small policy of each model kind (built once per test module)."""
    if request.param == "decoder":
        return build_policy(PolicyConfig(name="d", kind="decoder", seed=1))
    return build_policy(PolicyConfig(name="h", kind="hf", arch=request.param, seed=1))
