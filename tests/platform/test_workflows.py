"""The GitHub workflows, run step by step as a runner would, from the workflow files themselves:
a fresh clone of a pull request whose `origin` (a local bare repository) has main and the PR
head, a PATH whose python lacks the project's packages (setup-python's), the GITHUB_* files,
the `${{ }}` expressions substituted. Change a workflow and this test runs the new steps."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from ruamel.yaml import YAML

from tests.conftest import ROOT, VENV_BIN, copy_repo, run, set_params
from tests.support.services import s3  # noqa: F401 - the fixture

WORKFLOWS = ROOT / ".github/workflows"
# What the runner's actions do, done here: checkout is the clone, setup-python the PATH below.
ACTIONS = {"actions/checkout", "actions/setup-python", "actions/upload-artifact"}
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def workflow(name: str) -> dict:
    return YAML(typ="safe").load((WORKFLOWS / name).read_text())


def test_ci_runs_the_ci_entry_point():
    """ci.yml's one step is `.ci/run`, the script CI itself runs on every submission."""
    (job,) = workflow("ci.yml")["jobs"].values()
    runs = [s["run"].strip() for s in job["steps"] if "run" in s]
    assert runs == ["bash .ci/run"]
    assert {s["uses"].split("@")[0] for s in job["steps"] if "uses" in s} <= ACTIONS


def setup_python(tmp: Path) -> str:
    """A python on PATH without the project's packages, as actions/setup-python leaves it."""
    bin_dir = tmp / "setup-python/bin"
    bin_dir.mkdir(parents=True)
    for name in ("python", "python3"):
        (bin_dir / name).symlink_to(sys._base_executable)
    probe = subprocess.run([bin_dir / "python", "-c", "import omegaconf"], capture_output=True)
    assert probe.returncode != 0, "the runner's python must lack the project's packages"
    return f"{bin_dir}{os.pathsep}{SYSTEM_PATH}"


def substitute(script: str, context: dict[str, str]) -> str:
    def value(match: re.Match) -> str:
        key = match[1].strip()
        assert key in context, f"this test does not know ${{{{ {key} }}}}: add it to its context"
        return context[key]

    return re.sub(r"\$\{\{(.*?)\}\}", value, script)


def run_job(job: dict, workdir: Path, context: dict[str, str], path: str) -> tuple[str, dict]:
    """Every step in order, as GitHub's runner does: `run:` through `bash -e`, job and step
    env, GITHUB_PATH lines prepended to PATH for the later steps. Returns the job summary and
    each step's output and wall time."""
    gh = workdir.parent / f"{workdir.name}-github"
    gh.mkdir()
    files = {k: gh / k.lower() for k in ("GITHUB_STEP_SUMMARY", "GITHUB_OUTPUT", "GITHUB_PATH",
                                          "GITHUB_ENV")}
    for f in files.values():
        f.touch()
    home = gh / "home"  # a runner's: no git identity
    home.mkdir()
    base = {"HOME": str(home), "CI": "true", "GITHUB_ACTIONS": "true",
            "GITHUB_WORKSPACE": str(workdir), **{k: str(v) for k, v in files.items()},
            **{k: substitute(str(v), context) for k, v in job.get("env", {}).items()}}
    steps = {}
    for step in job["steps"]:
        if "uses" in step:
            assert step["uses"].split("@")[0] in ACTIONS, f"unknown action {step['uses']}"
            continue
        added = files["GITHUB_PATH"].read_text().split()
        env = {**base, **{k: substitute(str(v), context) for k, v in step.get("env", {}).items()},
               "PATH": os.pathsep.join([*reversed(added), path])}
        for line in files["GITHUB_ENV"].read_text().splitlines():
            key, _, val = line.partition("=")
            env[key] = val
        t = time.perf_counter()
        p = subprocess.run(["bash", "-e", "-c", substitute(step["run"], context)], cwd=workdir,
                           env=env, capture_output=True, text=True, timeout=1200)
        name = step.get("name", step["run"].strip().splitlines()[0])
        assert p.returncode == 0, f"step {name!r} exited {p.returncode}\n{p.stdout[-3000:]}\n" \
                                  f"{p.stderr[-5000:]}"
        steps[name] = {"out": p.stdout + p.stderr, "s": time.perf_counter() - t}
    return files["GITHUB_STEP_SUMMARY"].read_text(), steps


def test_pipeline_workflow_reports_the_pr_against_main_and_reuses_the_remote_run_cache(tmp_path,
                                                                                        s3):  # noqa: F811
    # The user's repo: main with a DVC remote on S3 (a real server on loopback, its URL and
    # endpoint committed as docs/data.md shows), and a PR that changes lr. The runner gets the
    # keys from the repository's secrets only.
    base = copy_repo(tmp_path / "base", {"epochs": "3"})  # the workflow, not the model, is tested
    run(["dvc", "remote", "add", "-d", "team", f"s3://team-dvc/{tmp_path.name}"], base)
    run(["dvc", "remote", "modify", "team", "endpointurl", s3.endpoint], base)
    run(["git", "commit", "-qam", "a DVC remote on S3"], base)
    run(["git", "clone", "-q", "--bare", str(base), str(tmp_path / "origin.git")], tmp_path)
    run(["git", "checkout", "-qb", "pr"], base)
    set_params(base / "params.yaml", {"lr": "0.01"})
    run(["git", "commit", "-qam", "lr 0.01"], base)
    run(["git", "push", "-q", str(tmp_path / "origin.git"), "pr"], base)
    head = run(["git", "rev-parse", "HEAD"], base).stdout.strip()
    context = {"github.event.pull_request.head.sha": head,
               "secrets.AWS_ACCESS_KEY_ID": s3.access_key,
               "secrets.AWS_SECRET_ACCESS_KEY": s3.secret_key}
    (job,) = workflow("pipeline.yml")["jobs"].values()
    assert job["env"]["FAST"].startswith("-S ")
    job["env"]["FAST"] = "-S epochs=2 -S model.width=8"  # the steps as written, smaller runs
    path = setup_python(tmp_path)

    def fresh_run(name: str, job: dict) -> tuple[str, dict]:
        work = tmp_path / name
        run(["git", "clone", "-q", str(tmp_path / "origin.git"), str(work)], tmp_path)
        run(["git", "checkout", "-q", head], work)
        (work / ".venv").symlink_to(VENV_BIN.parent)  # the locked environment, installed once
        return run_job(job, work, context, path)

    site = Path(sysconfig.get_paths()["purelib"])
    installed = site.stat().st_mtime_ns
    summary, first = fresh_run("first", job)
    assert "## Params: workspace vs ci-main" in summary
    lr_row = next(ln for ln in summary.splitlines() if re.match(r"\|\s*params.yaml\s*\|\s*lr\s", ln))
    assert "0.003" in lr_row and "0.01" in lr_row, summary
    acc_row = next(ln for ln in summary.splitlines() if "models/eval/metrics.json" in ln
                   and "| accuracy" in ln)
    assert len(re.findall(r"0\.\d{3}", acc_row)) >= 2, acc_row  # main's value and the PR's
    assert "ci-main" in summary and "ci-pr" in summary and "DVC failed" not in summary
    main_step = next(v for k, v in first.items() if "ci-main" in k)
    assert "Running stage 'train'" in main_step["out"]

    # A rerun on another runner (fresh clone, empty cache): nothing changed, nothing retrains.
    # Less `make verify`, which reruns every stage on purpose and was checked above (37 s).
    restore = job | {"steps": [s for s in job["steps"] if "reproducible" not in s.get("name", "")]}
    summary2, second = fresh_run("second", restore)
    assert len(second) == len(first) - 1
    for name, step in second.items():
        # The params check has no outputs to restore: it reruns (a fraction of a second).
        assert not re.search(r"Running stage '(?!params')", step["out"]), \
            f"{name} reran:\n{step['out'][-3000:]}"
    verified = [first[k]["out"] for k in first if "reproducible" in k]
    assert len(verified) == 1 and "verified: every output is byte-identical" in verified[0]
    main_step2 = next(v for k, v in second.items() if "ci-main" in k)
    assert "restored" in main_step2["out"] or "is cached" in main_step2["out"], main_step2["out"]
    def report(text: str) -> list[str]:  # the diff's lines; DVC may order the files otherwise
        return sorted(text.split("## Experiments")[0].splitlines())

    assert report(summary2) == report(summary)
    # The secrets stayed in the runner's environment: in no file of either clone, its git
    # history or its DVC cache.
    for clone in (tmp_path / "first", tmp_path / "second"):
        for f in (f for f in clone.rglob("*") if f.is_file() and not f.is_symlink()):
            assert s3.secret_key.encode() not in f.read_bytes(), f
    # The runners shared the installed venv and installed nothing into it (the lock unchanged).
    assert site.stat().st_mtime_ns == installed
    pipeline_s = [sum(v["s"] for k, v in r.items() if "pipeline" in k) for r in (first, second)]
    print(f"\npipeline steps: {pipeline_s[0]:.1f} s trained, {pipeline_s[1]:.1f} s restored "
          f"from the remote's run-cache\n--- job summary ---\n{summary}")


def test_the_pipeline_uses_a_remote_only_where_the_runner_can_reach_it(tmp_path):
    """A fork's pull request runs without the repository's secrets: an S3 remote is then left
    out (the runs train) instead of failing the pull with "Unable to locate credentials"."""
    (job,) = workflow("pipeline.yml")["jobs"].values()
    (step,) = [s for s in job["steps"] if "GITHUB_ENV" in s.get("run", "")]
    cases = [("s3://bucket/dvc", "KEYID", "--pull"), ("s3://bucket/dvc", "", ""),
             (str(tmp_path / "folder"), "", "--pull"), (None, "KEYID", "")]
    for i, (url, key, expected) in enumerate(cases):
        repo = tmp_path / f"repo{i}"
        run(["git", "init", "-q", str(repo)], tmp_path)
        run(["dvc", "init", "-q"], repo)
        if url:
            run(["dvc", "remote", "add", "-d", "team", url], repo)
        context = {"secrets.AWS_ACCESS_KEY_ID": key, "secrets.AWS_SECRET_ACCESS_KEY": key}
        run_job({"env": job["env"], "steps": [step]}, repo, context,
                f"{VENV_BIN}{os.pathsep}{SYSTEM_PATH}")
        written = (tmp_path / f"repo{i}-github/github_env").read_text()
        assert written == f"PULL={expected}\n", (url, key, written)

