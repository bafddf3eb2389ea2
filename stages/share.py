"""`python -m stages.share`: `dvc push --run-cache`, completed, so another machine restores every
stage from the DVC remote instead of rerunning it.

DVC 3.67 pushes the run-cache entries and the cached outputs they name, but not its copies of
the `cache: false` outputs (metrics, history, confusion rows, PNGs): `--pull` on another
machine then finds the entry, misses those files and reruns the stage. This pushes them too.
"""

from __future__ import annotations

from ruamel.yaml import YAML


def main() -> None:
    from dvc.repo import Repo
    from dvc_data.hashfile.hash_info import HashInfo

    with Repo() as repo:
        repo.push(run_cache=True)
        runs = repo.cache.legacy.fs.join(repo.cache.legacy.path, "runs")
        outs = [out for entry in repo.cache.legacy.fs.find(runs)
                for out in (YAML(typ="safe").load(repo.cache.legacy.fs.read_text(entry)) or {})
                .get("outs", [])]
        objects = {HashInfo(out.get("hash", "md5"), out["md5"]) for out in outs
                   if "md5" in out and not out["md5"].endswith(".dir")}  # dirs: pushed above
        result = repo.cloud.push(objects)
        print(f"pushed the run-cache and {len(result.transferred)} more files it needs "
              f"({len(objects)} outputs named in it)")


if __name__ == "__main__":
    main()
