"""What a study has done, for `run` as it goes and `python -m reprotrain.sweep status` at any time: a
line of progress, the table of trials, the picture, and the complete trials' experiments pulled
into this workspace for `make exps`."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

from reprotrain.sweep.spec import SweepError, is_finite
from reprotrain.sweep.study import reach_storage, shown, storage_uri
from reprotrain.sweep.worker import dvc, has_dvc_remote, last_error, remote_for_clones


def status(study_name: str, workdir: Path) -> None:
    import optuna

    uri = storage_uri(None, 1)
    try:
        study = optuna.load_study(study_name=study_name, storage=reach_storage(uri))
    except KeyError:
        raise SweepError(f"no study {study_name!r} in {shown(uri)}") from None
    spec = study.user_attrs["sweep"]
    print(progress(study, spec))
    print(summary(study, spec))
    print(f"picture: {plot(study, spec, workdir / study_name / 'trials.png')}")


def progress(study, spec: dict) -> str:
    trials = study.get_trials(deepcopy=False)
    c = Counter(t.state.name for t in trials)
    retried = retries(trials)  # a failed trial queued again is done once its retry is
    done = c["COMPLETE"] + c["PRUNED"] + c["FAIL"] - retried
    line = (f"{done}/{spec['trials']} done: {c['COMPLETE']} complete, {c['PRUNED']} pruned, "
            f"{c['FAIL']} failed ({retried} retried), {c['RUNNING']} running, "
            f"{c['WAITING']} waiting")
    if c["COMPLETE"]:
        best = study.best_trial
        line += f"; best {spec['objective']['metric']} {best.value:.4f} (trial {best.number}: " \
                f"{fmt(best.params)})"
    return line


def retries(trials) -> int:
    return sum("failed_trial" in t.system_attrs for t in trials)


def fmt(params: dict) -> str:
    return " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def summary(study, spec: dict) -> str:
    """One line per trial: its state, objective, point and what happened to it."""
    trials = study.get_trials(deepcopy=False)
    retried_as = {t.system_attrs["failed_trial"]: t.number for t in trials
                  if "failed_trial" in t.system_attrs}
    metric = spec["objective"]["metric"]
    width = max(7, len(metric))
    rows = []
    for t in trials:
        if t.state.name == "COMPLETE":
            note = "trained" if t.user_attrs.get("retrained") else "restored from the run-cache"
        elif t.state.name == "PRUNED":
            note = f"pruned after epoch {t.user_attrs.get('pruned_at_epoch')}"
            if t.value is not None:  # the epoch's figure the pruner judged, not the objective
                note += f" ({spec['objective']['per_epoch']} {t.value:.4f} then)"
        elif t.state.name == "FAIL":
            note = failure(t)
            if t.number in retried_as:
                note += f"; retried as trial {retried_as[t.number]}"
        else:
            note = t.state.name.lower()
        value = f"{t.value:.4f}" if t.value is not None and t.state.name != "PRUNED" else "-"
        secs = t.user_attrs.get("run_s")
        rows.append(f"  {t.number:>3} {t.state.name:<8} {value:>{width}} {fmt(t.params):<28} "
                    f"{f'{secs:.0f}s' if secs else '':>5} {note}")
    c = Counter(t.state.name for t in trials)
    restored = sum(t.state.name == "COMPLETE" and not t.user_attrs.get("retrained") for t in trials)
    return "\n".join([f"study {study.study_name}: {c['COMPLETE']} complete ({restored} restored from "
                      f"the run-cache), {c['PRUNED']} pruned, {c['FAIL']} failed",
                      f"  {'#':>3} {'state':<8} {metric:>{width}} "
                      f"{'params':<28} {'time':>5}", *rows])


def failure(trial) -> str:
    """Why a failed trial failed: its `dvc exp run`'s last error, or its worker's death."""
    return trial.user_attrs.get("fail_reason") or \
        f"its worker {trial.user_attrs.get('worker', '?')} stopped sending heartbeats"


def none_completed(study, dvc_remote: str, logs: Path) -> str:
    """The one line a sweep without a complete trial ends with: the first failure's cause."""
    trials = study.get_trials(deepcopy=False)
    c = Counter(t.state.name for t in trials)
    line = f"no trial of study {study.study_name} completed: {c['FAIL']} failed, {c['PRUNED']} pruned"
    failed = [t for t in trials if t.state.name == "FAIL"]
    if not failed:  # the pruner stopped every one: it had no complete trial to judge by
        return f"{line}; start pruning later (pruner.n_startup_trials) or use pruner: {{name: none}}"
    why = failure(failed[0])
    # The workers get the keys of this workspace's default DVC remote, or the environment's.
    fix = f"give the DVC remote its keys: `dvc remote modify --local {dvc_remote or 'NAME'} " \
          "access_key_id ...` and `secret_access_key ...`, or AWS_ACCESS_KEY_ID and " \
          "AWS_SECRET_ACCESS_KEY in the environment" if "Unable to locate credentials" in why \
        else f"the workers' logs: {logs}"
    return f"{line}; trial {failed[0].number}: {why}; {fix}"


def plot(study, spec: dict, out: Path) -> Path:
    """The picture, `figure`, written to `out` whole or not at all."""
    import matplotlib.pyplot as plt

    fig = figure(study, spec)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(out)
    return out


def figure(study, spec: dict):
    """The objective per trial (best so far as a line, pruned trials at their last reported
    figure) and against each swept parameter."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    trials = study.get_trials(deepcopy=False)
    done = [t for t in trials if t.state.name == "COMPLETE"]
    pruned = [t for t in trials if t.state.name == "PRUNED" and t.intermediate_values]
    obj = spec["objective"]
    if not done and not pruned:
        return nothing_to_draw(study)
    keys = list(spec["space"])
    fig, axes = plt.subplots(1, 1 + len(keys), figsize=(5 * (1 + len(keys)), 4), squeeze=False)
    ax = axes[0][0]
    ax.scatter([t.number for t in done], [t.value for t in done], label="complete")
    last = [t.intermediate_values[max(t.intermediate_values)] for t in pruned]
    ax.scatter([t.number for t in pruned], last, marker="x", color="tab:red",
               label=f"pruned (last {obj['per_epoch']})")
    best, line = None, []
    pick = max if obj["direction"] == "maximize" else min
    for t in sorted(done, key=lambda t: t.number):
        best = t.value if best is None else pick(best, t.value)
        line.append((t.number, best))
    if line:
        ax.step(*zip(*line, strict=True), where="post", color="tab:green", label="best so far")
    failed = [t.number for t in trials if t.state.name == "FAIL"]
    for n in failed:
        ax.axvline(n, color="grey", linestyle=":", label="failed" if n == failed[0] else None)
    # A loss spans decades (2.3 for an lr that learns nothing, 0.02 for a good one): on a linear
    # axis every good trial sits on one flat line at the bottom.
    shown_values = [t.value for t in done] + last
    y_log = bool(shown_values) and min(shown_values) > 0 and max(shown_values) >= 10 * min(shown_values)
    ax.set(xlabel="trial", ylabel=obj["metric"], title=f"{study.study_name}: {obj['metric']} per trial")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # trial numbers, not 0.2, 0.4, ...
    ax.legend(fontsize=8)
    for ax in axes[0] if y_log else ():
        ax.set_yscale("log")
    for ax, key in zip(axes[0][1:], keys, strict=True):
        ax.scatter([t.params[key] for t in done if key in t.params],
                   [t.value for t in done if key in t.params], label="complete")
        ax.scatter([t.params[key] for t in pruned], last, marker="x", color="tab:red", label="pruned")
        # An empty axis spans 0..1, which a log scale cannot draw (every trial failed).
        if log_axis(spec["space"][key]) and any(key in t.params for t in done + pruned):
            ax.set_xscale("log")
        ax.set(xlabel=key, ylabel=obj["metric"], title=f"{obj['metric']} against {key}")
    fig.tight_layout()
    return fig


def nothing_to_draw(study):
    """No trial has a value: in words, since empty axes (-0.05 to 0.05, and a legend of markers
    drawn nowhere) read as a broken picture."""
    import textwrap

    import matplotlib.pyplot as plt

    trials = study.get_trials(deepcopy=False)
    c = Counter(t.state.name for t in trials)
    yet = " yet" if c["RUNNING"] + c["WAITING"] else ""
    lines = [f"{c['FAIL']} failed, {c['PRUNED']} pruned, {c['RUNNING']} running, "
             f"{c['WAITING']} waiting"]
    failed = [t for t in trials if t.state.name == "FAIL"]
    if failed:
        lines += textwrap.wrap(f"trial {failed[0].number}: {failure(failed[0])}", 90)
    lines.append(f"every trial: python -m reprotrain.sweep status --study {study.study_name}")
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.axis("off")
    ax.set_title(f"{study.study_name}: no trial completed{yet}", fontsize=14)
    ax.text(0.5, 0.5, "\n".join(lines), ha="center", va="center", transform=ax.transAxes,
            fontsize=11, linespacing=1.6)
    return fig


def log_axis(dist: dict) -> bool:
    """A log range, or choices that are positive numbers spanning 100x or more."""
    values = dist.get("values") or []
    numbers = values and all(is_finite(v, float) and v > 0 for v in values)
    return bool(dist.get("log")) or bool(numbers and max(values) >= 100 * min(values))


def pull(study, spec: dict) -> None:
    """Every complete trial's experiment into this workspace, for `make exps`."""
    names = [t.user_attrs["dvc_exp"] for t in study.get_trials(deepcopy=False)
             if t.state.name == "COMPLETE"]
    if not names:
        return
    remote = study.user_attrs["remote"]
    p = subprocess.run([dvc(), "exp", "pull", *([] if has_dvc_remote(Path.cwd()) else ["--no-cache"]),
                        remote, *names], capture_output=True, text=True)
    if p.returncode:
        print(f"warning: dvc exp pull: {last_error(p.stdout + p.stderr)}", file=sys.stderr)
        return
    obj = spec["objective"]
    order = "desc" if obj["direction"] == "maximize" else "asc"
    print(f"pulled {len(names)} experiments; sorted by the objective: make exps "
          f"EXPS_SORT={obj['file']}:{obj['metric']} EXPS_ORDER={order}")
    if has_dvc_remote(Path.cwd()):  # the outputs are on the DVC remote, not only here
        # As a branch, and only its stage's outputs: the later stages' lines in its dvc.lock
        # are the sweep commit's, whose outputs the remote may not hold (`dvc exp apply` fails).
        best = study.best_trial.user_attrs["dvc_exp"]
        print(f"best: {best}; its outputs on another machine, without training, in a clone of "
              f"{remote}: {remote_for_clones(Path.cwd())}dvc exp pull origin {best} && dvc exp "
              f"branch {best} {best} && git checkout {best} && dvc pull {obj['stage']}")
