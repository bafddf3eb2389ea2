"""Shared fixtures: real digits, a real sqlite MLflow store made once, a real copy of the repo."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stages.config import DataConfig
from stages.data import SPLITS, Split
from stages.sources import build_meta, load_digits, resize, stratified_split

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
GIT_ID = {"GIT_AUTHOR_NAME": "test", "GIT_AUTHOR_EMAIL": "test@example.com",
          "GIT_COMMITTER_NAME": "test", "GIT_COMMITTER_EMAIL": "test@example.com"}


def digits_data() -> tuple[dict[str, Split], dict]:
    """The digits as prepare splits them with the default params: (splits, meta)."""
    cfg = DataConfig(channels=1)  # the digits' own, as auto resolves them
    x, y, classes = load_digits()
    x = resize(x, cfg.image_size, cfg.channels)
    parts = stratified_split(y, cfg.val_fraction, cfg.test_fraction, seed=0)
    splits = {k: Split(x[parts[k]], y[parts[k]]) for k in SPLITS}
    return splits, build_meta(splits, classes, cfg)


@pytest.fixture(autouse=True)
def _keep_mlflow_tracking_uri():
    """MLflow's tracking URI is process-global: a test that points it at another store (a
    read-only copy, another workspace's) left the next test of its worker reading there, which
    then missed what it had just registered."""
    before = sys.modules["mlflow"].get_tracking_uri() if "mlflow" in sys.modules else None
    yield
    if before is not None:
        sys.modules["mlflow"].set_tracking_uri(before)


@pytest.fixture(scope="session")
def digits() -> tuple[dict[str, Split], dict]:
    return digits_data()


@pytest.fixture(scope="session")
def mlflow_uri(tmp_path_factory) -> str:
    """One sqlite store for the session: creating one runs migrations (~6 s)."""
    import mlflow

    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.search_experiments()
    return uri


# A test's traffic stays on this machine: no MLflow telemetry, no DVC analytics (the repos tests
# `dvc init` lack the project's `core.analytics = false`, and each of their commands would fork
# a process, a second of CPU, to send a report). For the tests' processes and this one's.
OFFLINE = {"DO_NOT_TRACK": "true", "DVC_NO_ANALYTICS": "1"}


def env_with(**extra: str) -> dict[str, str]:
    # Without make's own variables too: under `make test` a make the test runs would be
    # `make[1]`, and its messages would differ from what a user sees. Nor what this test
    # process's own imports set (MLflow's telemetry session, Inductor's cache folder once a test
    # compiled), which a user's shell does not have.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DVC_", "MLFLOW_", "MAKE", "MFLAGS", "_MLFLOW_"))
           and k != "TORCHINDUCTOR_CACHE_DIR"}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(GIT_ID)
    env.update(OFFLINE)
    env.update(extra)
    return env


def run(cmd: list[str], cwd: Path, env: dict | None = None, check: bool = True,
        timeout: float = 600) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, cwd=cwd, env=env or env_with(), capture_output=True, text=True,
                       timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {p.returncode}\n{p.stdout[-3000:]}\n"
                             f"{p.stderr[-5000:]}")
    return p


# What a user's experiments change in the workspace (`dvc exp run` applies its params, results
# and lock there): tests take these as committed, so an experiment in progress never fails them.
EXPERIMENT_STATE = ("params.yaml", "dvc.lock", "data/", "models/")


def committed(path: str) -> bytes:
    """A file of this repo as HEAD has it; the working copy outside a git checkout."""
    shown = subprocess.run(["git", "show", f"HEAD:{path}"], cwd=ROOT, capture_output=True)
    return shown.stdout if shown.returncode == 0 else (ROOT / path).read_bytes()


def copy_params(folder: Path) -> Path:
    """The committed params.yaml into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "params.yaml").write_bytes(committed("params.yaml"))
    return folder / "params.yaml"


def copy_repo(dest: Path, params_edit: dict[str, str] | None = None) -> Path:
    """This repo in a fresh git repository, as a clone would have it: the code of the working
    tree (tracked and new files), the params, lock and results as committed."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        if (ROOT / f).is_file() and not f.startswith("tests/"):
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dest / f)
            if f.startswith(EXPERIMENT_STATE):
                (dest / f).write_bytes(committed(f))
    if params_edit:
        set_params(dest / "params.yaml", params_edit)
    run(["git", "init", "-q", "-b", "main"], dest)
    run(["git", "add", "-A"], dest)
    run(["git", "commit", "-qm", "init"], dest)
    return dest


def start_queue(repo: Path, env: dict, jobs: int) -> None:
    """`dvc queue start`, returning as it does in a terminal. Its detached worker inherits the
    command's stdout: through run()'s pipe, the call would last until the queue was done."""
    log = repo.parent / f"{repo.name}-queue-start.log"
    with open(log, "w") as out:
        p = subprocess.run(["dvc", "queue", "start", "-j", str(jobs)], cwd=repo, env=env,
                           stdout=out, stderr=subprocess.STDOUT, timeout=120)
    assert p.returncode == 0, log.read_text()


def wait_for_queue(repo: Path, env: dict, timeout: float = 900) -> str:
    """`dvc queue status` once nothing is queued or running (what `dvc queue start` began)."""
    import time

    deadline = time.time() + timeout
    while True:
        status = run(["dvc", "queue", "status"], repo, env=env).stdout
        if "Queued" not in status and "Running" not in status:
            return status
        assert time.time() < deadline, status
        time.sleep(5)


def rendered_dom(page: Path, tmp_path: Path) -> str:
    """The DOM of a local page after headless Chromium ran its scripts; skips without chromium."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        pytest.skip("no chromium: `apt-get install chromium` to render the page")
    return subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
         "--virtual-time-budget=15000", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120).stdout


def set_params(path: Path, values: dict[str, str]) -> None:
    """Edit params.yaml as a user would, keeping its comments: `section.key: value` lines."""
    lines = path.read_text().splitlines()
    for dotted, value in values.items():
        section, _, key = dotted.rpartition(".")
        current = None
        for i, line in enumerate(lines):
            if line and not line.startswith((" ", "#")):
                current = line.split(":")[0]
            name = line.strip().split(":")[0]
            if name == key and (current == section if section else not line.startswith(" ")):
                indent = line[: len(line) - len(line.lstrip())]
                lines[i] = f"{indent}{key}: {value}"
                break
        else:
            raise KeyError(dotted)
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture
def tiny_train_cfg():
    from stages.config import TrainConfig

    return TrainConfig(warmup_epochs=0.5, log_every=1000)


# The model-file and predict tests' models (tests/support/workspaces.py has their other helpers).
@pytest.fixture
def exported(tmp_path, digits):
    """What export writes, for a small real model: model.pt2, model.safetensors, model.json,
    and two real test images."""
    from PIL import Image
    from safetensors.torch import save_file

    from stages.export import export_program, export_pt2
    from tests.support.training import cnn

    splits, meta = digits
    out = tmp_path / "export"
    out.mkdir()
    model = cnn(width=8).eval()
    export_pt2(export_program(model, torch.zeros(2, 1, 16, 16)), out / "model.pt2")
    save_file(model.state_dict(), out / "model.safetensors")
    (out / "model.json").write_text(json.dumps({
        "model_params": {"arch": "cnn", "width": 8, "dropout": 0.1}, "classes": meta["classes"],
        "mean": meta["mean"], "std": meta["std"], "input_shape": [1, 16, 16]}))
    for i in range(2):
        Image.fromarray(splits["test"].x[i, 0].numpy()).save(tmp_path / f"img{i}.png")
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory, digits, mlflow_uri):
    """A real tiny training run: models/train/ with its MLflow run."""
    from tests.support.workspaces import workspace

    w = workspace(tmp_path_factory.mktemp("trained"), digits, epochs="2")
    run([sys.executable, "-m", "stages.train"], w,
        env=env_with(PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=mlflow_uri))
    return w


# Under `make test`'s workers, one thread each, for this process and every subprocess it
# starts (stages, dvc, torchrun): two processes of two OpenMP threads on two cores spin against
# each other, and the in-process training tests ran ten times slower.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
else:
    torch.set_num_threads(min(2, torch.get_num_threads()))

# The slow tier, in one place: the tests that run the real pipeline, a server or a chain
# of processes for seconds ("*": the whole file). `pytest -m "not slow"` is the fast
# tier (under 3 minutes on 2 cores); `make test` runs both.
SLOW: dict[str, str | tuple[str, ...]] = {
    "test_bench.py": (
        "test_quick_bench_runs_every_row_and_writes_its_outputs",
        "test_storage_bench_times_both_remotes_and_leaves_nothing_behind",
        "test_bench_on_the_prepared_split_puts_a_plain_loop_beside_the_repos",
    ),
    "test_byod.py": "test_prepare_says_when_it_resizes_from_what_to_what_and_the_key_that_keeps_the_size",
    "test_checkpoints.py": (
        "test_kill_during_a_checkpoint_write_loses_nothing",
        "test_sigkill_then_rerun_resumes_to_identical_weights",
    ),
    "test_config.py": (
        "test_bad_params_fail_before_any_work",
        "test_the_advice_after_a_refused_exp_run_restores_params_yaml",
        "test_values_that_would_fail_later_are_refused_before_the_data_loads",
    ),
    "test_cuda_path.py": (
        "test_a_streamed_batch_of_256_jpegs_crosses_from_the_workers_under_a_low_open_files_limit",
        "test_each_rank_draws_its_own_dropout_and_a_resumed_ddp_run_ends_where_it_would",
        "test_every_rank_takes_rank_0s_validation_figures_and_decisions",
        "test_resume_across_a_change_of_resolved_precision_warns_and_goes_on",
    ),
    "test_data_names.py": (
        "test_a_broken_symlink_dvc_fails_on_is_refused_naming_it",
        "test_dvc_fails_on_such_a_name_without_naming_it_and_the_check_names_it",
        "test_symlinked_folders_are_refused_exactly_where_dvc_does_not_hash",
    ),
    "test_distributed.py": (
        "test_ddp_update_equals_the_single_process_global_batch",
        "test_two_gloo_processes_train_the_stage_like_one",
    ),
    "test_dvc_yaml.py": "test_a_dataset_added_beside_the_digits_leaves_their_prepare_up_to_date",
    "test_export.py": (
        "test_an_export_that_logs_the_model_prints_no_mlflow_info_line",
        "test_a_stage_over_an_immutable_output_keeps_all_its_previous_outputs",
        "test_an_opset_the_exporter_cannot_write_fails_and_keeps_the_export",
        "test_check_batch_sizes_beyond_the_test_split_fail_before_any_write",
        "test_export_into_a_forbidden_folder_is_one_line_and_keeps_the_export",
        "test_export_on_a_full_disk_is_one_line_and_keeps_the_export",
        "test_export_over_an_immutable_file_keeps_the_whole_previous_export",
        "test_export_past_the_file_size_limit_is_one_line_and_keeps_the_export",
        "test_prepare_on_a_full_disk_is_one_line_and_keeps_the_data",
        "test_prepare_over_an_immutable_file_keeps_the_previous_data",
        "test_prepare_past_the_file_size_limit_is_one_line_and_keeps_the_data",
        "test_the_onnx_file_has_the_opset_model_json_names",
    ),
    "test_first_hour.py": (
        "test_a_lock_whose_models_no_one_shared_says_so_before_training",
        "test_the_data_recipe_as_written_trains_on_the_folder_and_keeps_every_file",
        "test_predict_warns_on_digits_drawn_dark_on_light",
        "test_the_suite_ignores_the_experiment_in_progress",
        "test_the_way_back_to_main_works_where_main_was_never_built",
    ),
    "test_interrupts.py": (
        "test_ctrl_c_in_prepare_is_one_line",
        "test_ctrl_c_in_train_is_one_line_and_the_run_killed",
        "test_params_changed_under_a_training_run_fail_it_naming_the_cause",
    ),
    "test_make.py": (
        "test_make_clean_removes_scratch_and_keeps_runs_data_and_models",
        "test_make_exps_keeps_earlier_commits_experiments_and_shows_no_hashes",
        "test_make_refuses_a_wrong_python_and_never_reuses_its_venv",
        "test_make_repro_says_when_the_model_was_made_under_another_thread_count",
        "test_make_share_sends_every_runs_outputs_not_only_the_workspaces",
        "test_make_share_without_a_usable_remote_is_one_line",
        "test_make_verify_on_another_thread_count_names_the_outputs_and_the_way_back",
        "test_no_target_that_takes_a_url_echoes_its_recipe",
        "test_setup_says_what_pip_does_through_its_silences",
    ),
    "test_model_files.py": (
        "test_a_damaged_model_pt_fails_naming_it_and_logs_nothing",
        "test_a_hostile_pt2_never_runs_its_code",
        "test_a_pt2_zip_bomb_is_refused_without_inflating_it",
    ),
    "test_multinode.py": (
        "test_a_killed_agent_fails_the_other_in_bounded_time_and_a_rerun_resumes",
        "test_a_wrong_interface_fails_each_machine_in_one_line",
        "test_two_agents_on_loopback_train_like_one_process",
        "test_two_agents_on_two_addresses_train_like_one_process",
    ),
    "test_pipeline.py": "*",
    "test_predict.py": (
        "test_folder_of_images_trains_end_to_end_with_bad_files_reported",
        "test_predict_names_a_bad_file_and_still_predicts_the_others",
        "test_predict_reproduces_evaluate_accuracy",
        "test_predict_runs_the_trained_model_pt_as_its_export_would",
        "test_predict_warns_when_the_shapes_model_is_given_the_grayscale_digits",
        "test_registry_moves_champion_only_on_better_accuracy_of_the_same_task",
    ),
    "test_redact.py": (
        "test_a_sweep_never_shows_or_tags_its_storages_password",
        "test_a_tracking_uris_password_reaches_no_file_tag_or_line",
    ),
    "test_s3_dvc.py": "*",
    "test_s3_faults.py": "*",
    "test_s3_mlflow.py": "*",
    "test_serving.py": "*",
    "test_server.py": (
        "test_a_login_the_server_checked_is_trusted_but_never_a_wrong_or_an_old_password",
        "test_a_read_only_user_can_browse_but_not_log",
        "test_a_restart_names_a_member_who_took_a_name_and_a_deleted_experiment",
        "test_a_run_json_naming_a_run_the_server_lacks_gets_a_run_of_its_own",
        "test_a_schema_from_a_newer_mlflow_is_refused_in_one_line",
        "test_docs_member_and_grant_snippets_run_as_written_and_the_member_logs",
        "test_every_stage_logs_to_the_server_and_nothing_stays_local",
        "test_no_password_in_the_servers_output_or_log",
        "test_sigterm_is_a_clean_stop_that_leaves_no_log_folder",
        "test_the_names_every_clone_uses_are_the_admins_before_anyone_logs_in",
        "test_the_server_listens_on_loopback_and_refuses_foreign_host_headers",
        "test_the_server_lives_and_dies_with_its_command",
        "test_two_clones_run_their_queues_at_once",
        "test_two_processes_creating_the_experiment_at_once_both_log",
        "test_without_a_login_or_with_a_wrong_one_the_refusal_is_one_line",
    ),
    "test_prepare_limits.py": (  # each runs prepare in processes of its own
        "test_a_fork_refused_by_the_process_limit_ends_prepare_in_one_line_leaving_no_worker",
        "test_a_killed_prepare_takes_its_workers_along_and_its_rerun_removes_its_scratch",
        "test_a_second_prepare_in_the_same_folder_is_refused_while_the_first_runs",
        "test_prepare_in_a_memory_cgroup_sizes_the_splits_against_its_limit",
        "test_shards_that_outgrow_the_disk_when_re_encoded_name_the_shard_and_the_fix",
        "test_workers_past_the_process_limit_are_refused_in_one_line_naming_it",
    ),
    "test_shards.py": (  # each prepares or trains in processes of its own
        "test_training_on_shards_says_and_records_how_many_workers_auto_gave",
        "test_a_format_changed_back_leaves_only_the_new_one",
        "test_a_folder_whose_decoded_splits_exceed_memory_is_refused_before_decoding",
        "test_a_shard_cut_short_under_training_workers_ends_it_in_one_line_naming_it",
        "test_prepare_deletes_only_a_partial_folder_it_wrote",
        "test_prepare_killed_mid_split_resumes_after_its_whole_shards_to_the_same_bytes",
        "test_prepare_writes_the_same_shards_again",
        "test_the_loader_and_the_format_must_match_in_one_line",
        "test_two_ddp_ranks_stream_the_halves_of_one_process_s_batches",
        "test_31_shards_train_under_an_open_files_limit_of_48_to_the_same_weights",
        "test_a_worker_killed_mid_epoch_ends_training_in_one_line",
        "test_a_val_sample_that_does_not_decode_in_a_worker_is_one_line",
    ),
    "test_slurm.py": (
        "test_a_cancelled_task_shows_as_cancelled",
        "test_a_refused_submission_is_one_line",
        "test_an_array_job_runs_the_command_once_per_task",
    ),
    "test_sweep.py": (
        "test_a_git_remote_with_a_password_is_refused_unseen",
        "test_a_hung_storage_ends_the_sweep_in_seconds_with_one_line",
        "test_a_local_default_dvc_remote_wins_over_the_committed_one_in_the_workers_clones",
        "test_a_local_dvc_remote_reaches_the_workers_clones",
        "test_a_local_s3_remote_reaches_the_workers_with_its_endpoint_and_keys_apart",
        "test_a_sweep_on_slurm_retries_the_trial_of_a_cancelled_task",
        "test_a_sweep_on_two_workers_prunes_restores_and_survives_a_killed_worker",
        "test_a_sweep_whose_every_trial_failed_exits_1_naming_the_cause",
    ),
    "test_sync.py": (
        "test_a_create_whose_answer_is_lost_lands_once",
        "test_a_damaged_spool_is_kept_aside_and_named_in_one_line",
        "test_a_failing_server_spools_the_run_and_sync_lands_it_once",
        "test_a_registration_the_server_fails_lands_once_with_its_model",
        "test_a_spool_sent_already_is_one_line_without_mlflow_or_the_server",
        "test_a_store_of_another_mlflow_is_named_not_the_server",
        "test_server_down_at_start_spools_and_sync_lands_everything_once",
        "test_server_killed_mid_training_loses_nothing_once_it_is_back",
        "test_sync_from_moves_a_workspaces_own_runs_up_once",
        "test_sync_into_an_experiment_an_admin_deleted_refuses_in_one_line",
        "test_sync_refused_by_the_server_is_one_line_naming_the_user",
        "test_sync_to_a_failing_server_is_bounded_and_one_line",
        "test_sync_with_a_bad_http_timeout_names_it_in_one_line",
        "test_two_syncs_at_once_land_each_run_and_version_once",
    ),
    "test_team_code_decides_no_output.py": "*",
    "test_tracking.py": (
        "test_a_failing_stage_leaves_dvc_lock_and_marks_the_run_failed",
        "test_class_folders_named_with_any_character_are_evaluated_and_logged",
        "test_sigterm_marks_the_run_killed",
        "test_tracking_outage_never_stops_training",
        "test_two_processes_log_to_one_new_sqlite_store_at_once",
    ),
    "test_ui.py": "*",
    "test_warm.py": (  # each starts a warm process: 15-20 s of imports before it serves
        "test_a_changed_sitecustomize_starts_another_warm_process",
        "test_a_lone_stage_starts_no_warm_process_and_a_second_one_does",
        "test_a_stage_keeps_its_callers_scheduling_policy_and_io_class",
        "test_a_test_session_stops_the_warm_processes_its_tests_started_and_no_other",
        "test_a_warm_pipeline_writes_the_bytes_a_cold_one_writes",
        "test_a_warm_process_ends_soon_after_its_checkout_is_deleted",
        "test_a_warm_stage_derives_what_imports_set_from_its_own_callers_temp_folder",
        "test_a_warm_stage_draws_its_own_seeds_and_passes_no_interpreter_flags_on",
        "test_a_warm_stage_runs_the_callers_code_and_ends_as_a_cold_one_does",
        "test_a_warm_stage_shows_its_own_name",
        "test_ctrl_c_reaches_a_warm_stage_and_sigkill_takes_it_with_its_caller",
        "test_ctrl_z_stops_a_warm_stage_and_fg_resumes_it",
        "test_shell_prompts_and_an_activated_venv_share_the_warm_process_of_make_and_dvc",
        "test_the_first_start_says_what_it_is_and_how_to_turn_it_off_on_a_terminal",
    ),
    "test_workflows.py": (
        "test_pipeline_workflow_reports_the_pr_against_main_and_reuses_the_remote_run_cache",
    ),
}


# `make test` runs modules longest first (it keeps this order with --no-loadscope-reorder), so
# the workers end together instead of one starting the 3-minute workflow test when the
# other is nearly done. The seconds are the last whole run's, kept in pytest's cache; a fresh
# clone (CI) takes tests/module_seconds.json, a copy of a run's: ordered by each module's count
# of slow tests instead, that run's times would have ended its two workers 48 s apart. Refresh
# it after a whole `make test`: cp .pytest_cache/v/reprotrain/module_seconds tests/module_seconds.json
DURATIONS_KEY = "reprotrain/module_seconds"
DURATIONS_FILE = Path(__file__).with_name("module_seconds.json")
_seconds: dict[str, float] = {}


@pytest.hookimpl(tryfirst=True)  # marked before `-m` selects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        names = SLOW.get(item.path.name, ())
        if names == "*" or getattr(item, "originalname", item.name) in names:
            item.add_marker(pytest.mark.slow)
    cache = getattr(config, "cache", None)  # absent under -p no:cacheprovider
    last = (cache.get(DURATIONS_KEY, None) if cache else None) or json.loads(DURATIONS_FILE.read_text())
    items.sort(key=lambda item: -last.get(item.path.name, 0.0))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    name = Path(report.nodeid.split("::")[0]).name
    _seconds[name] = _seconds.get(name, 0.0) + report.duration


# The warm processes this session's tests start (reprotrain/warm.py) end with it, not 5 idle
# minutes later; a user's own, in the same venv, serve on. Every process a test starts inherits
# this session's mark (env_with copies os.environ), and so does a warm process it starts.
WARM_MARK = "REPROTRAIN_TEST_SESSION"


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # xdist's workers inherit the controller's
        import uuid

        os.environ[WARM_MARK] = uuid.uuid4().hex
        os.environ.update(OFFLINE)


def stop_warm_processes() -> None:
    """SIGTERM to each warm process of this venv that carries this session's mark. A pid file
    may outlive its process (SIGKILL), and the pid be another's since: only a process whose
    command line still names the pid file's socket is one."""
    mark = f"{WARM_MARK}={os.environ[WARM_MARK]}".encode()
    for pid_file in (Path(sys.prefix) / "var" / "reprotrain-warm").glob("*.pid"):
        try:
            proc = Path("/proc") / pid_file.read_text().strip()
            if str(pid_file.with_suffix(".sock")).encode() in (proc / "cmdline").read_bytes() \
                    and mark in (proc / "environ").read_bytes().split(b"\0"):
                os.kill(int(proc.name), signal.SIGTERM)
        except (OSError, ValueError):
            pass  # gone meanwhile


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """On the controller (xdist workers report to it), after a whole run only: a `-k` or
    single-file run would make every other module look free."""
    config = session.config
    if not hasattr(config, "workerinput"):  # after every worker's tests
        stop_warm_processes()
    whole = (config.args_source == pytest.Config.ArgsSource.TESTPATHS
             and not config.option.keyword and not config.option.markexpr)
    if getattr(config, "cache", None) and _seconds and not hasattr(config, "workerinput") and whole:
        config.cache.set(DURATIONS_KEY, {k: round(v, 1) for k, v in sorted(_seconds.items())})
