"""`python -m reprotrain.team.share`: `dvc push --run-cache`, completed, so another machine restores every
stage from the DVC remote instead of rerunning it.

DVC 3.67 pushes the run-cache entries and the cached outputs they name, but not its copies of
the `cache: false` outputs (metrics, history, confusion rows, PNGs): `--pull` on another
machine then finds the entry, misses those files and reruns the stage. This pushes them too.
"""

from __future__ import annotations

import contextlib
import logging
import logging.handlers
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ruamel.yaml import YAML

from reprotrain.redact import masked
from stages.lib.cli import run_stage
from stages.lib.errors import UserError


class ShareError(UserError):
    """The DVC remote is missing, unusable or unreachable; the message says what to do. Masked
    whole: the remote's URL, and DVC's words that repeat it, may hold a token or password
    (`https://alice:TOKEN@host/dvc`)."""

    def __init__(self, message: str) -> None:
        super().__init__(masked(message))


def main() -> None:
    from dvc.config import NoRemoteError
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    with Repo() as repo, dvc_problems() as problems:
        name = repo.config["core"].get("remote")
        url = repo.config["remote"].get(name, {}).get("url")
        remote = f"the DVC remote {name!r} ({url})"
        try:
            if str(url).startswith("s3://"):
                fail_fast()
                check_bucket(repo, name, url)
            print(push(repo, problems))
        except NoRemoteError:
            raise ShareError("no DVC remote to share to: add one with `dvc remote add -d NAME "
                             "URL` (a folder, s3://..., ssh://...), then rerun `make share`") from None
        except ImportError as e:  # "s3 is supported, but requires 'dvc-s3' to be installed"
            plugin = re.search(r"requires '([\w-]+)'", str(e))
            if not plugin:
                raise
            raise ShareError(f"{remote} needs the package {plugin[1]}: `.venv/bin/pip install "
                             f"{plugin[1]}`, then rerun `make share`") from None
        except s3_no_credentials():
            raise ShareError(f"{remote} needs credentials and this machine has none: "
                             f"{set_keys(name)}") from None
        except s3_unreachable() as e:  # down, or gone mid-push: botocore's traceback, before
            raise ShareError(unreachable(repo, name, remote, e)) from None
        except (DvcException, OSError) as e:  # OSError: a folder remote under a file, ...
            why = next((f" ({r.exc_info[1] if r.exc_info else r.getMessage()})"
                        for r in problems if r.levelno >= logging.ERROR), "")
            # s3fs turns S3's 403s (a wrong secret, an unknown key) into PermissionError; on a
            # folder remote the same class is a file's mode, which the advice below covers.
            if isinstance(e, PermissionError) and str(url).startswith("s3://"):
                raise ShareError(f"{remote} refused this machine's credentials: {e}{why}; "
                                 f"{set_keys(name)}") from None
            gone = next((unwrapped(r.exc_info[1]) for r in problems if r.levelno >= logging.ERROR
                         and r.exc_info and isinstance(unwrapped(r.exc_info[1]), s3_unreachable())),
                        None)
            if gone is not None:  # the server went away mid-push: each file failed alike
                raise ShareError(unreachable(repo, name, remote, gone)) from None
            full = storage_refused(problems) if str(url).startswith("s3://") else None
            if full:
                bucket = url.removeprefix("s3://").split("/", 1)[0]
                raise ShareError(f"{remote} would not store the files: {e} ({full} from "
                                 f"{endpoint(repo, name)}), which a bucket over its quota or a "
                                 f"full disk answers: free space in the bucket {bucket!r} or have "
                                 "its quota raised, then rerun `make share`: what this push sent "
                                 "stays there, and a rerun sends the rest") from None
            raise ShareError(f"could not push to {remote}: {e}{why}; check its URL and that "
                             "this machine reaches it (`dvc remote list`, `dvc remote modify`)"
                             ) from None
    for record in problems:  # the warnings of a push that worked
        print(f"WARNING: {masked(record.getMessage())}", file=sys.stderr)


# What S3 servers answer a write they have no room for: Ceph's quota, MinIO's quota and full
# disk, a 507; SeaweedFS 4.48 answers a bucket over its quota (made read-only by
# `s3.bucket.quota.enforce`) with a bare InternalError, its log "read only: /buckets/B/ (e.g.
# bucket over quota)".
FULL = ("QuotaExceeded", "XMinioAdminBucketQuotaExceeded", "XMinioStorageFull",
        "InsufficientStorage", "InternalError")


def storage_refused(problems: list[logging.LogRecord]) -> str | None:
    """The S3 error code of the first upload the server refused for want of room, if that is
    why the push failed (s3fs keeps the code only in the botocore error it wraps)."""
    for record in problems:
        error = record.exc_info[1] if record.exc_info else None
        while error is not None:
            code = getattr(error, "response", {}).get("Error", {}).get("Code")
            if code in FULL:
                return code
            error = error.__cause__
    return None


def s3_no_credentials() -> tuple[type[Exception], ...]:
    """botocore's error for a request it could not sign, which DVC lets through as a traceback."""
    try:
        from botocore.exceptions import NoCredentialsError
    except ImportError:  # no dvc-s3: no S3 remote could have got this far
        return ()
    return (NoCredentialsError,)


def s3_unreachable() -> tuple[type[Exception], ...]:
    """botocore's errors for an endpoint that does not answer, drops the connection or whose
    certificate is not trusted (SSLError is one of its ConnectionErrors)."""
    try:
        from botocore.exceptions import ConnectionError, HTTPClientError
    except ImportError:
        return ()
    return (ConnectionError, HTTPClientError)


def endpoint(repo, name: str) -> str:
    return repo.config["remote"][name].get("endpointurl") or "AWS S3"


def unreachable(repo, name: str, remote: str, e: Exception) -> str:
    from botocore.exceptions import SSLError

    where = endpoint(repo, name)
    if isinstance(e, SSLError) or "CERTIFICATE_VERIFY_FAILED" in str(e):
        return (f"{remote}: the certificate of {where} is not trusted (signed by a CA this "
                "machine does not know): give that CA's certificate with `export "
                f"AWS_CA_BUNDLE=/path/ca.pem` or `dvc remote modify --local {name} ssl_verify "
                "/path/ca.pem`, then rerun `make share`")
    return (f"could not reach {remote} at {where} ({type(e).__name__}): is the S3 server up? "
            f"Check the address (`dvc remote modify {name} endpointurl URL`), then rerun `make "
            "share`: what this push sent stays there, and a rerun sends the rest")


def check_bucket(repo, name: str, url: str) -> None:
    """The bucket answers these keys, before anything is sent: DVC's run-cache upload (s3fs)
    creates a missing bucket where the keys may, so a typo in the URL would make a new bucket,
    and where they may not, it logs one error per file and carries on."""
    bucket = url.removeprefix("s3://").split("/", 1)[0]
    s3 = repo.cloud.get_remote(name).fs.fs  # s3fs, with the remote's keys, endpoint and CA
    try:
        # A listing, not a HEAD: a refusal then comes with S3's reason in its body.
        s3.call_s3("list_objects_v2", Bucket=bucket, MaxKeys=1)
    except FileNotFoundError:
        raise ShareError(f"the DVC remote {name!r} ({url}) names the bucket {bucket!r}, which "
                         f"does not exist on {endpoint(repo, name)}: create it (`aws s3 mb "
                         f"s3://{bucket}`, or ask whoever runs the S3 server) or point the remote "
                         f"at one that does (`dvc remote modify {name} url s3://BUCKET/PATH`), "
                         "then rerun `make share`") from None
    except PermissionError as e:  # s3fs's 403: a wrong secret, an unknown key, no right to list
        raise ShareError(f"the DVC remote {name!r} ({url}) refused this machine's credentials: "
                         f"Forbidden ({e}); {set_keys(name)}") from None


class EndpointGone(Exception):
    """A request refused before it is sent: an earlier one found the endpoint gone (args[0])."""


def unwrapped(e: BaseException | None) -> BaseException | None:
    return e.args[0] if isinstance(e, EndpointGone) else e


def fail_fast() -> None:
    """Once a request finds the endpoint gone (after botocore's tries: 5, 13 s), every later one
    fails at once: a server that dies mid-push would otherwise cost each file still to send its
    own 13 s, 4 per CPU at a time (137 s for 139 files here). What was sent stays, and a rerun
    sends the rest. Configured, not patched: fsspec's config gives every s3fs instance DVC makes
    (one per remote lookup) a botocore session with two event hooks; EndpointGone is no
    connection error, so neither botocore nor s3fs retries it. botocore's retry settings
    (AWS_MAX_ATTEMPTS) would cut every request's tries, not only those after the endpoint went."""
    import fsspec.config
    from aiobotocore.session import AioSession

    gone: list[BaseException] = []

    def note(exception: BaseException | None = None, **_) -> None:  # a call failed, tries spent
        if isinstance(exception, s3_unreachable()) and not gone:
            gone.append(exception)

    def refuse(**_) -> None:
        if gone:
            raise EndpointGone(gone[0])

    session = AioSession()
    session.register("after-call-error.s3", note)
    session.register("before-send.s3", refuse)
    fsspec.config.conf.setdefault("s3", {})["session"] = session


def set_keys(name: str) -> str:
    return (f"set its keys with `dvc remote modify --local {name} access_key_id KEY` and `dvc "
            f"remote modify --local {name} secret_access_key SECRET` (or AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY), then rerun `make share`")


@contextmanager
def dvc_problems() -> Iterator[list[logging.LogRecord]]:
    """DVC's warnings and errors, kept instead of printed: a remote that does not answer logs
    one error per file, and the first one's cause belongs in the one line that ends the run."""
    kept = logging.handlers.BufferingHandler(capacity=10**6)
    kept.setLevel(logging.WARNING)
    loggers = {logging.getLogger(n): logging.getLogger(n).handlers for n in
               ("dvc", "dvc_objects", "dvc_data")}
    for logger, handlers in loggers.items():
        logger.handlers = [h for h in handlers if h.level < logging.WARNING] + [kept]
    try:
        yield kept.buffer
    finally:
        for logger, handlers in loggers.items():
            logger.handlers = handlers


def push(repo, problems: list[logging.LogRecord]) -> str:
    """The outputs, then the files the run-cache names, then the run-cache entries: an
    entry on the remote only once what it names is there, so another machine that finds an
    entry finds its files, even after a push that stopped halfway. DVC's own
    `push(run_cache=True)` (`dvc push --run-cache`) sends the entries first, and of the files
    only the workspace's: the `cache: false` copies of other runs would never arrive."""
    from dvc.exceptions import UploadError
    from dvc.stage.cache import RunCacheNotSupported
    from dvc_data.hashfile.hash_info import HashInfo
    from dvc_data.hashfile.tree import Tree

    sent = repo.push()  # the number of files it sent
    runs = repo.cache.legacy.fs.join(repo.cache.legacy.path, "runs")
    outs = [out for entry in repo.cache.legacy.fs.find(runs)
            for out in (YAML(typ="safe").load(repo.cache.legacy.fs.read_text(entry)) or {})
            .get("outs", [])]
    # `repo.push()` sent the workspace's outputs only: the other runs' go here, a folder as its
    # files and its `.dir` (which DVC sends last). One gone from this cache: DVC warns.
    objects = {HashInfo(out.get("hash", "md5"), out["md5"]) for out in outs if "md5" in out}
    for folder in [oid for oid in objects if oid.isdir]:
        with contextlib.suppress(FileNotFoundError):
            objects.update(oid for _, _, oid in Tree.load(repo.cache.local, folder))
    result = repo.cloud.push(objects)
    if result.failed:
        raise UploadError(len(result.failed))
    errors = sum(r.levelno >= logging.ERROR for r in problems)
    try:
        entries = repo.stage_cache.push(None)  # logs a failed entry and goes on: counted here
    except RunCacheNotSupported:  # an http remote: `dvc push --run-cache` skips it too
        entries = []
    if sum(r.levelno >= logging.ERROR for r in problems) > errors:
        raise UploadError(sum(r.levelno >= logging.ERROR for r in problems) - errors)
    return (f"pushed {sent} files of the workspace's data and outputs, then the run-cache "
            f"({len(entries)} entries) and {len(result.transferred)} more files it names (of "
            f"{len(objects)}: the rest were there)")


def unrestored(stage: str) -> str | None:
    """Why `dvc repro` will run `stage` although dvc.lock names its outputs for these very
    params and code: this machine has no copy of them and DVC found none on a remote (DVC then
    reruns and never looks at the run-cache, which may hold this machine's own run). `make
    repro`'s first line, before minutes of work; None when the lock is another run's or its
    outputs are cached here."""
    try:
        return _unrestored(stage)
    except Exception:  # noqa: BLE001 - advice only: a lock it cannot read never stops a stage
        return None


def _unrestored(stage: str) -> str | None:
    from omegaconf import OmegaConf

    from stages.lib.files import file_hash

    stages = OmegaConf.to_container(OmegaConf.load("dvc.lock"))["stages"]
    lock = stages[stage]
    params = OmegaConf.to_container(OmegaConf.load("params.yaml"))
    # The stage and those whose outputs it reads (prepare's data): other params or code there
    # is another run, which nobody expects to be restored.
    inputs = {dep["path"] for dep in lock.get("deps", [])}
    for each in [lock, *(s for s in stages.values()
                         if any(o["path"] in inputs for o in s.get("outs", [])))]:
        if any(params.get(k) != v for k, v in each.get("params", {}).get("params.yaml", {}).items()):
            return None
        if any(Path(dep["path"]).is_file() and file_hash(Path(dep["path"]), "md5") != dep.get("md5")
               for dep in each.get("deps", [])):
            return None
    from dvc.repo import Repo

    with Repo() as repo:
        missing = [o["path"] for o in lock.get("outs", [])
                   if o.get("md5") and not repo.cache.local.exists(o["md5"])]
    if not missing:
        return None
    named = missing[0] + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
    return (f"{stage}: no copy of what dvc.lock names for these params and code ({named}) is "
            "here or on a DVC remote this machine pulled from: dvc.lock was committed on another "
            "machine that did not `make share` it (or on another CPU, whose results differ in "
            f"their last bits); dvc repro runs {stage} again. To restore instead: `make share` where "
            "dvc.lock was made, or commit this machine's dvc.lock after its `make share`")


def advise() -> None:
    """`python -m reprotrain.team.share --advise`, as `make repro` starts: the advice above."""
    note = unrestored("train")
    if note:
        print(note, flush=True)


if __name__ == "__main__":
    run_stage(advise if sys.argv[1:] == ["--advise"] else main)
