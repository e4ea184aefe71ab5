"""``bench.source_fingerprint``: the hash a benchmark's figures carry of
the sources that ran them, so that the two sides of an A/B are told apart
(benchmarks/README.md, "Audit: before/after figures")."""

from __future__ import annotations

import shutil

import torch

from radixserve.bench import source_fingerprint

fingerprint = source_fingerprint.__wrapped__  # uncached: the trees below change between calls


def _tree(root):
    (root / "pkg" / "configs").mkdir(parents=True)
    (root / "pkg" / "__pycache__").mkdir()
    (root / "pkg" / "model.py").write_text("x = 1\n")
    (root / "pkg" / "kernel.c").write_text("int f(void) { return 1; }\n")
    (root / "pkg" / "configs" / "table.json").write_text('{"1": {"block_n": 4}}\n')
    return root / "pkg"


def test_two_copies_of_a_tree_share_a_fingerprint_and_any_source_change_shows(tmp_path):
    a = _tree(tmp_path / "a")
    b = tmp_path / "b" / "pkg"
    shutil.copytree(a, b)
    base = fingerprint(a)
    assert len(base) == 12 and int(base, 16) >= 0
    assert fingerprint(b) == base  # where the tree lies does not matter
    (b / "model.py").write_text("x = 2\n")
    assert fingerprint(b) != base
    (b / "model.py").write_text("x = 1\n")
    (b / "configs" / "table.json").write_text('{"1": {"block_n": 8}}\n')  # a tuned table changes the figures too
    assert fingerprint(b) != base
    (b / "configs" / "table.json").write_text('{"1": {"block_n": 4}}\n')
    (b / "kernel.c").rename(b / "kernel2.c")  # a file's name counts, not only its bytes
    assert fingerprint(b) != base


def test_what_is_not_source_leaves_it(tmp_path):
    a = _tree(tmp_path)
    base = fingerprint(a)
    (a / "__pycache__" / "model.cpython-312.pyc").write_bytes(b"\0\1")
    (a / "__pycache__" / "stale.py").write_text("y = 3\n")
    (a / "notes.txt").write_text("a results file beside the code\n")
    assert fingerprint(a) == base


def test_one_batch_records_the_packages_fingerprint():
    from radixserve.bench.one_batch import environment

    env = environment(torch.device("cpu"))
    assert env["source"] == source_fingerprint() == fingerprint()
