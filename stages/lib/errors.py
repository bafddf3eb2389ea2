"""The one error every module raises for a problem the user can fix: a stage prints its message,
not a traceback, and exits 1 (stages/lib/cli.py's `run_stage`). Each owner subclasses it for its
own kind (config.ParamsError, lib.images.DataError, checkpoints.CheckpointError, ...)."""


class UserError(Exception):
    """A problem the user can fix: the message names the file, key or value and says how."""


class StageWarning(UserWarning):
    """A problem the stage works around: one `warning:` line in a stage (`run_stage`), where
    Python's form adds the file, the line and its source."""


# What to do about a DataLoader worker that died, after the line that says how it was seen.
KILLED_WORKER = ("a worker killed by SIGKILL is most often the kernel's out-of-memory killer (see "
                 "`dmesg`): lower train.num_workers or batch_size, then rerun; training resumes "
                 "from its last checkpoint")


def worker_died(e: BaseException) -> bool:
    """Whether `e` is torch's word for a DataLoader worker that died: its SIGCHLD handler raises
    it wherever the training process is (in the model's forward, in a tracking call), so no
    handler of what was running there may take it for its own failure."""
    return isinstance(e, RuntimeError) and str(e).startswith("DataLoader worker (pid")
