"""The CLI as a user with one extra (or none) meets it, in subprocesses where importing torch, triton or jax fails:
`--help` imports no framework; `export` and `verify` of the numpy port run with numpy and ml_dtypes alone on every
case of the ci suite; a command whose extra is missing prints one line naming it (exit 3), never a traceback;
output paths are checked before any work; provenance records a commit only for a checkout of this project.
(From a built wheel, in fresh environments: `.ci/wheel`.)"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Run `parity.cli.main(argv)` with imports of `blocked` failing as if the packages were not installed.
_DRIVER = textwrap.dedent("""
    import importlib.abc, json, sys
    blocked = set(json.loads(sys.argv[1]))

    class Missing(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in blocked:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    sys.meta_path.insert(0, Missing())
    from parity import cli
    rc = cli.main(json.loads(sys.argv[2]))
    heavy = sorted(m for m in ("torch", "triton", "jax", "triton_impl", "pallas_impl") if m in sys.modules)
    print("MODULES " + json.dumps(heavy), file=sys.stderr)
    sys.exit(rc)
""")
FRAMEWORKS = ["torch", "triton", "jax", "jaxlib"]


def _cli(argv, blocked=FRAMEWORKS, cwd=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(blocked), json.dumps(argv)], cwd=cwd or ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    lines = res.stderr.splitlines()
    modules = json.loads(lines[-1].removeprefix("MODULES ")) if lines and lines[-1].startswith("MODULES ") else None
    return res, modules, "\n".join(line for line in lines if not line.startswith("MODULES "))


def test_help_imports_no_framework():
    for argv in (["--help"], ["check", "--help"], ["verify", "--help"], ["export", "--help"], ["example", "--list"]):
        res, modules, err = _cli(argv, blocked=[])  # installed, yet not imported
        assert res.returncode == 0, err
        assert modules == [], (argv, modules)


def test_a_numpy_port_exports_and_verifies_every_ci_case_without_torch_triton_or_jax(tmp_path):
    golden = tmp_path / "golden"
    res, modules, err = _cli(["export", str(golden), "--suite", "ci", "--quiet"])
    assert res.returncode == 0 and modules == [], err
    manifest = json.loads((golden / "manifest.json").read_text())
    assert manifest["generator"]["source"] == "checkout"
    res, modules, err = _cli(["verify", str(golden), "--impl", "parity.examples.numpy_port:port", "--quiet",
                              "--json", str(tmp_path / "v.json")])
    assert res.returncode == 0 and modules == [], err + res.stdout
    n = sum(len(c["ops"]) for c in manifest["cases"])
    assert f"{n}/{n} ok" in res.stdout
    # a copy of the example, as a porter starts one, by path
    res, _, err = _cli(["example", "numpy_port"])
    (tmp_path / "my_port.py").write_text(res.stdout)
    res, modules, err = _cli(["verify", str(golden), "--impl", f"{tmp_path / 'my_port.py'}:port", "--quiet"])
    assert res.returncode == 0 and modules == [], err


@pytest.mark.parametrize("argv, blocked, extra", [
    (["check", "-k", "upstream_vector", "--quiet"], ["torch", "triton"], "parity"),
    (["check", "-k", "upstream_vector", "--quiet"], ["jax", "jaxlib"], "parity"),
    (["demo", "--framework", "torch"], ["torch", "triton"], "parity"),
    (["export", "EXPORT_DIR", "--suite", "ci", "-k", "upstream_vector"], ["ml_dtypes", *FRAMEWORKS], "golden"),
])
def test_a_missing_extra_is_one_line_naming_it(tmp_path, argv, blocked, extra):
    argv = [str(tmp_path / "g") if a == "EXPORT_DIR" else a for a in argv]
    res, _, err = _cli(argv, blocked=blocked)
    assert res.returncode == 3, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f'pip install "mla-lse-merge[{extra}]"' in err and "is not installed" in err


def test_output_paths_are_checked_before_any_work(tmp_path):
    from parity import cli

    a_file = tmp_path / "file"
    a_file.write_text("")
    for argv, match in [(["check", "--json", "/nonexistent/report.json"], "does not exist"),
                        (["check", "--json", str(tmp_path)], "is a folder"),
                        (["verify", str(tmp_path), "--impl", "reference", "--json", "/nonexistent/v.json"],
                         "does not exist"),
                        (["export", str(a_file)], "is not a folder"),
                        (["export", str(a_file / "sub")], "cannot create the folder")]:
        res, modules, err = _cli(argv)
        assert res.returncode == cli.EXIT_USAGE and match in err and "Traceback" not in err, (argv, err)
        assert modules == []  # nothing ran


def test_an_install_inside_another_git_repository_records_no_commit(tmp_path):
    """A copy of the package in an unrelated repository (a virtual environment inside someone's project): no commit
    of that repository in the provenance, the installed version instead."""
    if shutil.which("git") is None:
        pytest.skip("needs git")
    repo = tmp_path / "someone_elses_project"
    shutil.copytree(ROOT / "parity", repo / "site" / "parity")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q",
                    "--allow-empty", "-m", "x"], check=True)
    env = {k: v for k, v in os.environ.items() if k != "GIT_COMMIT"}
    env["PYTHONPATH"] = str(repo / "site")
    code = "from parity.harness import provenance as p; print(p.git_commit()); print(p.source())"
    out = subprocess.run([sys.executable, "-c", code], cwd=repo, env=env, capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out[0] == "None" and out[1].startswith("installed")
    env["PYTHONPATH"] = str(ROOT)  # this checkout: its HEAD
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out[1] == "checkout" and (out[0] == "None" or len(out[0]) == 40)
