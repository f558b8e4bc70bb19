"""Tests for sparsecal.capture.prompts: exact-length synthetic tasks and JSONL prompt files."""
import collections
import json
import re

import pytest

from sparsecal.capture.prompts import (
    MIN_LENGTH,
    TASKS,
    TEXT_TASKS,
    PromptSample,
    build_sample,
    build_task_prompts,
    load_prompts_file,
    sample_seed,
)
from sparsecal.capture.prompts.tasks import source_text
from sparsecal.formats.errors import UserError

LENGTHS = (512, 777, 1024)
BASE_SEED = 20240611


@pytest.fixture(scope="module")
def built(tok):
    return build_task_prompts(tok, TASKS, LENGTHS, 2, BASE_SEED)


def _by(samples, task):
    return [s for s in samples if s.task == task]


def _statements(text):
    """All ``VAR X = ...`` statements of a decoded vt prompt, in order."""
    return re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)\.", text)


# ----------------------------------------------------------------------------- shape, seeds
def test_sample_seed_is_stable_and_in_range():
    assert sample_seed(0, "vt", 512, 0) == sample_seed(0, "vt", 512, 0) == 1649844223
    seeds = {sample_seed(s, t, n, i)
             for s in (0, 1) for t in TASKS for n in LENGTHS for i in (0, 1)}
    assert len(seeds) == 2 * len(TASKS) * len(LENGTHS) * 2
    assert all(0 <= s < 2**31 for s in seeds)


def test_grid_order_lengths_and_fields(built):
    expected = [(t, n, i) for t in TASKS for n in LENGTHS for i in range(2)]
    assert [(s.task, s.length, s.index) for s in built] == expected
    for s in built:
        assert isinstance(s, PromptSample)
        assert len(s.input_ids) == s.length
        assert s.seed == sample_seed(BASE_SEED, s.task, s.length, s.index)
        assert all(isinstance(i, int) and 0 <= i < 49152 for i in s.input_ids)
        assert s.answer and all(isinstance(a, str) and a for a in s.answer)
        json.dumps(s.meta)  # JSON-able


def test_same_seed_gives_identical_samples(tok, built):
    again = build_task_prompts(tok, TASKS, LENGTHS, 2, BASE_SEED)
    assert again == built
    other = build_task_prompts(tok, ["niah_single"], [512], 1, BASE_SEED + 1)
    assert other[0].input_ids != built[0].input_ids


def test_sample_rebuilds_from_its_recorded_seed(tok, built):
    for s in built[1::3]:
        assert build_sample(tok, s.task, s.length, s.seed, s.index) == s


def test_distinct_samples_differ(built):
    for task in TASKS:
        for length in LENGTHS:
            a, b = [s for s in built if s.task == task and s.length == length]
            assert a.input_ids != b.input_ids
            assert a.answer != b.answer


@pytest.mark.parametrize("task", TASKS)
def test_random_seed_and_long_length(tok, task, seed):
    for length in (MIN_LENGTH[task], 8192):
        s = build_sample(tok, task, length, seed)
        assert len(s.input_ids) == length
        if task not in TEXT_TASKS:
            text = tok.decode(s.input_ids)
            assert all(a in text for a in s.answer)


# ----------------------------------------------------------------------------- answers
def test_niah_single_answer_is_the_asked_needle(tok, built):
    samples = _by(built, "niah_single")
    for s, other in zip(samples, samples[1:] + samples[:1]):
        text = tok.decode(s.input_ids)
        (number,) = s.answer
        assert re.fullmatch(r"\d{7}", number)
        assert text.count(number) == 1
        assert f"The special magic number for {s.meta['key']} is: {number}." in text
        assert text.endswith(f"The special magic number for {s.meta['key']} is:")
        assert other.answer[0] not in text  # the check can fail: a foreign number is absent


def test_niah_multikey_asks_one_of_several(tok, built):
    for s in _by(built, "niah_multikey"):
        text = tok.decode(s.input_ids)
        found = dict(re.findall(r"The special magic number for (\S+) is: (\d{7})\.", text))
        assert len(found) == s.meta["needles"] == 4
        assert found[s.meta["key"]] == s.answer[0]
        assert sorted(found.values()) == sorted(s.meta["numbers"])
        assert sum(n == s.answer[0] for n in found.values()) == 1
        assert s.meta["depths"] == sorted(s.meta["depths"])


def test_vt_chain_resolves_to_the_answer(tok, built):
    for s in _by(built, "vt"):
        text = tok.decode(s.input_ids)
        values = {}
        for name, rhs in _statements(text):  # resolve assignments in reading order
            values[name] = values[rhs[4:]] if rhs.startswith("VAR ") else rhs
        holding = sorted(n for n, v in values.items() if v == s.meta["value"])
        assert holding == sorted(s.answer)
        assert len(s.answer) == s.meta["hops"] + 1
        assert set(s.meta["decoy_names"]) <= set(values) - set(s.answer)
        for name in s.meta["decoy_names"]:
            assert values[name] == s.meta["decoy_value"] != s.meta["value"]
        assert all(name in text for name in s.answer)


def test_cwe_answer_is_the_most_common_words(tok, built):
    for s in _by(built, "cwe"):
        text = tok.decode(s.input_ids)
        counts = collections.Counter(re.findall(r"(?m)^\d+\. ([a-z]+)$", text))
        assert len(s.answer) == 10
        assert {w for w, _ in counts.most_common(10)} == set(s.answer)
        rest = [c for w, c in counts.items() if w not in s.answer]
        assert min(counts[w] for w in s.answer) >= 3 * max(rest)
        assert max(rest) <= 2


def test_text_answer_is_the_continuation(tok, built):
    source = source_text()
    for s in _by(built, "text"):
        text = tok.decode(s.input_ids)
        after = (source + source)[s.meta["offset"]:]
        assert s.meta["source"] == "pydoc_data.topics"
        assert after.startswith(text)
        (continuation,) = s.answer
        assert continuation == " ".join(after[len(text):].split()[:20])
        assert len(continuation.split()) == 20


def test_special_prefix_is_kept(tok):
    class WithBos:
        """The real tokenizer, plus a BOS (id 1) whenever special tokens are requested."""

        def __call__(self, text, add_special_tokens=True, **kw):
            out = tok(text, add_special_tokens=False, **kw)
            if add_special_tokens:
                out["input_ids"] = [1] + list(out["input_ids"])
            return out

        def decode(self, ids):
            return tok.decode(ids)

        def __len__(self):
            return len(tok)

    for task in ("niah_single", "text"):
        s = build_sample(WithBos(), task, 300, 7)
        assert s.input_ids[0] == 1 and len(s.input_ids) == 300


# ----------------------------------------------------------------------------- task errors
def test_unknown_task(tok):
    with pytest.raises(UserError, match=r"Unknown task 'nope'\. Available: .*niah_single"):
        build_sample(tok, "nope", 512, 0)
    with pytest.raises(UserError, match="Unknown task 'nope'"):
        build_task_prompts(tok, ["vt", "nope"], [512], 1, 0)


@pytest.mark.parametrize("task", TASKS)
def test_too_short_length_names_the_minimum(tok, task):
    low = MIN_LENGTH[task]
    with pytest.raises(UserError) as info:
        build_sample(tok, task, low - 1, 0)
    message = str(info.value)
    assert f"'{task}'" in message and f"at least {low} tokens" in message and "\n" not in message
    assert len(build_sample(tok, task, low, 0).input_ids) == low


# ----------------------------------------------------------------------------- JSONL files
def _write(tmp_path, lines, name="prompts.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_jsonl_reads_text_and_ids(tok, tmp_path):
    path = _write(tmp_path, [
        json.dumps({"text": "The capital of France is", "answer": "Paris"}),
        "",
        "   ",
        json.dumps({"input_ids": [1, 2, 3], "answer": ["a", "b"], "task": "mine"}),
        json.dumps({"text": "plain"}),
    ])
    first, second, third = load_prompts_file(path, tok)
    assert first.input_ids == tok("The capital of France is")["input_ids"]
    assert (first.task, first.index, first.seed, first.answer) == ("file", 1, -1, ["Paris"])
    assert first.length == len(first.input_ids)
    assert (second.input_ids, second.task, second.index) == ([1, 2, 3], "mine", 4)
    assert second.answer == ["a", "b"]
    assert (third.index, third.answer) == (5, [])
    json.dumps(third.meta)


BAD_LINES = [
    ("{not json", 'line 2: not valid JSON'),
    ("[1, 2]", "line 2: expected a JSON object, found an array"),
    ('{"answer": "x"}', 'line 2: found neither of "text" and "input_ids"'),
    ('{"text": "a", "input_ids": [1]}', 'line 2: found both of "text" and "input_ids"'),
    ('{"input_ids": []}', 'line 2: "input_ids" must be a non-empty list'),
    ('{"input_ids": [1, -2]}', 'line 2: "input_ids" must be a non-empty list'),
    ('{"input_ids": [1, 2.5]}', 'line 2: "input_ids" must be a non-empty list'),
    ('{"input_ids": [true]}', 'line 2: "input_ids" must be a non-empty list'),
    ('{"input_ids": "1 2"}', 'line 2: "input_ids" must be a non-empty list'),
    ('{"input_ids": [1, 49152]}', "line 2: token id 49152 is out of range"),
    ('{"text": ""}', 'line 2: "text" must be a non-empty string'),
    ('{"text": 5}', 'line 2: "text" must be a non-empty string'),
    ('{"text": "a", "answer": 3}', 'line 2: "answer" must be a string or a list of strings'),
    ('{"text": "a", "task": ["x"]}', 'line 2: "task" must be a non-empty string'),
]


@pytest.mark.parametrize("bad,expected", BAD_LINES)
def test_jsonl_bad_line_names_file_and_line(tok, tmp_path, bad, expected):
    path = _write(tmp_path, ['{"text": "fine"}', bad, '{"text": "also fine"}'])
    with pytest.raises(UserError) as info:
        load_prompts_file(path, tok)
    message = str(info.value)
    assert message.startswith(f"{path} {expected}")
    assert "\n" not in message


def test_jsonl_invalid_json_message(tok, tmp_path):
    path = _write(tmp_path, ['{"text": "a"}', "", "oops"])
    with pytest.raises(UserError, match=r'line 3: not valid JSON \(Expecting value\)\. Each line '
                                        r'must be one JSON object with "text" or "input_ids"\.'):
        load_prompts_file(path, tok)


def test_jsonl_missing_and_empty_files(tok, tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_prompts_file(tmp_path / "absent.jsonl", tok)
    with pytest.raises(UserError, match="no prompts"):
        load_prompts_file(_write(tmp_path, ["", "  ", ""], "blank.jsonl"), tok)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(UserError, match="empty.jsonl: the file has no prompts"):
        load_prompts_file(tmp_path / "empty.jsonl", tok)
