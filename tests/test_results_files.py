"""The measured results kept in the repository (``benchmarks/results``) name
no absolute path of the machine that produced them: a checkout, an output
folder, a package folder or a home directory. Benchmarks print what they
were given, and a device's paths mean nothing to a reader (and leak where
the runs were made); scrub them before committing."""

from __future__ import annotations

import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
# a path rooted in one of a machine's own top folders, not a URL's or a route's
MACHINE_PATH = re.compile(r"(?<![\w.:/])/(?:root|home|work|tmp|opt|usr|var|mnt|srv|scratch)/[\w.\-/]*")


def test_results_name_no_machine_paths():
    assert RESULTS.is_dir()
    found = {}
    for path in sorted(RESULTS.rglob("*")):
        if path.is_file():
            hits = MACHINE_PATH.findall(path.read_text(errors="replace"))
            if hits:
                found[path.name] = sorted(set(hits))[:3]
    assert not found, f"absolute machine paths in benchmarks/results: {found}"


def test_the_pattern_finds_paths_and_leaves_routes_alone():
    assert MACHINE_PATH.findall('"log": "/tmp/o/new/logs/w2.log"') == ["/tmp/o/new/logs/w2.log"]
    assert MACHINE_PATH.findall("PYTHONPATH=/opt/torch/.venv/lib") == ["/opt/torch/.venv/lib"]
    assert not MACHINE_PATH.findall("POST /generate, http://host/tmp/x, docs/tmp/y, ./work/z")
