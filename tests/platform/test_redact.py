"""Every form a password takes in a URI or a connection string is masked (reprotrain/redact.py), and
what is not a password stays, so that a message still names its database."""

from __future__ import annotations

import pytest

from reprotrain.redact import holds_credentials, holds_password, masked
from tests.conftest import env_with
from tests.support.services import create_database, postgres  # noqa: F401 - the fixture

SECRET = "S3cr3t-pw"
FORMS = {
    # userinfo
    f"postgresql://mlflow:{SECRET}@db/mlflow": "postgresql://***@db/mlflow",
    f"postgresql+psycopg://u:{SECRET}@h:5432/db": "postgresql+psycopg://***@h:5432/db",
    f"mysql+pymysql://u:p%40{SECRET}@h/db": "mysql+pymysql://***@h/db",
    f"postgresql://u:pa@{SECRET}@h/db": "postgresql://***@h/db",  # an unescaped @ in it
    # an unescaped / in it (base64 passwords hold them): SQLAlchemy's password ends at the first @
    f"postgresql://u:ab/{SECRET}+q==@h/db": "postgresql://***@h/db",
    f"cannot open postgresql+psycopg://u:/{SECRET}/@h:5432/db: refused":
        "cannot open postgresql+psycopg://***@h:5432/db: refused",
    f"http://alice:{SECRET}@mlflow.example.com:5000": "http://***@mlflow.example.com:5000",
    # query parameters
    f"postgresql://u@h/db?password={SECRET}": "postgresql://***@h/db?password=***",
    f"postgresql://u@h/db?sslmode=require&password={SECRET}&connect_timeout=5":
        "postgresql://***@h/db?sslmode=require&password=***&connect_timeout=5",
    f"postgresql://u@h/db?passwd={SECRET}": "postgresql://***@h/db?passwd=***",
    f"postgresql://u@h/db?PWD={SECRET}": "postgresql://***@h/db?PWD=***",
    f"postgresql://u@h/db?sslpassword={SECRET}": "postgresql://***@h/db?sslpassword=***",
    f"mssql+pyodbc://h/db?client_secret={SECRET}#x": "mssql+pyodbc://h/db?client_secret=***#x",
    f"postgresql://h/db?api_token={SECRET}": "postgresql://h/db?api_token=***",
    f"https://h/x?api_key={SECRET}&apikey={SECRET}": "https://h/x?api_key=***&apikey=***",
    f"https://b.s3/k?X-Amz-Credential=AK&X-Amz-Signature={SECRET}":
        "https://b.s3/k?X-Amz-Credential=***&X-Amz-Signature=***",
    # libpq keyword strings
    f"host=db password={SECRET} dbname=mlflow": "host=db password=*** dbname=mlflow",
    f"host=db password = {SECRET} dbname=mlflow": "host=db password = *** dbname=mlflow",
    f"host=db password='{SECRET} with blanks' dbname=mlflow": "host=db password=*** dbname=mlflow",
    f"host=db password='it''s {SECRET}\\' x' user=u": "host=db password=*** user=u",
    f"password=\"{SECRET} x\" user=u": "password=*** user=u",
    f"host=db password='{SECRET} never closed": "host=db password=***",
    f"DB=host=db passwd={SECRET}": "DB=host=db passwd=***",
    f"PGPASSWORD={SECRET} make server": "PGPASSWORD=*** make server",
    # inside a message, two URIs
    f"cannot open postgresql://u@h/db?password={SECRET}&sslmode=disable: refused, and "
    f"http://a:{SECRET}@b/": "cannot open postgresql://***@h/db?password=***&sslmode=disable: "
                             "refused, and http://***@b/",
    # a connection string inside a query value, percent-encoded (ODBC), and ODBC's own form
    f"mssql+pyodbc://u@host/db?odbc_connect=DRIVER%3Dx%3BUID%3Du%3BPWD%3D{SECRET}":
        "mssql+pyodbc://***@host/db?odbc_connect=***",
    f"DRIVER=x;UID=u;PWD={SECRET};DATABASE=d": "DRIVER=x;UID=u;PWD=***;DATABASE=d",
    f"Driver={{ODBC}};Uid=u;Pwd={{{SECRET};a b}}}}c}};Database=d": "Driver={ODBC};Uid=u;Pwd=***;Database=d",
    # a token as the user name: nothing tells it from a user, so no user name is shown
    f"https://sweeper:{SECRET}@host/team/repo.git": "https://***@host/team/repo.git",
}
KEPT = ["postgresql://h:5432/db?sslmode=require",
        "sqlite:////srv/mlflow.db", "sqlite:///sweep.db", "host=db dbname=mlflow user=mlflow",
        "http://127.0.0.1:5000/#/experiments/1/runs?viewStateShareKey=reprotrain",
        "postgresql://h/db?passfile_hint"]
# A user name is no password, but may be a token: never shown.
USERS = {"postgresql://mlflow@db-host:5432/mlflow": "postgresql://***@db-host:5432/mlflow",
         f"https://ghp_{SECRET}@host/team/repo.git": "https://***@host/team/repo.git",
         f"git remote origin is https://ghp_{SECRET}@host/r.git": "git remote origin is https://***@host/r.git"}


# Forms that masking once cut short, showing the rest of the secret (issue 55): no part of the
# secret, written in halves around what ended it, may be left.
HALVES = ("S3cr", "etHALF2")
SPLIT = {
    # an ODBC value in braces holds blanks, raw or percent-encoded, in a query value
    "mssql+pyodbc://u@h/db?odbc_connect=DRIVER={ODBC};UID=u;PWD={S3cr etHALF2};DATABASE=d":
        "mssql+pyodbc://***@h/db?odbc_connect=***",
    "mssql+pyodbc://u@h/db?odbc_connect=DRIVER%3D%7Bx%7D%3BPWD%3D%7BS3cr%20etHALF2%7D":
        "mssql+pyodbc://***@h/db?odbc_connect=***",
    # libpq's unquoted value: a backslash escapes a blank or a quote
    r"host=db password=S3cr\ etHALF2 dbname=mlflow": "host=db password=*** dbname=mlflow",
    r"host=db password=S3cr\'\\etHALF2 user=u": "host=db password=*** user=u",
    # the key percent-encoded, as the server decodes it
    "postgresql://u@h/db?pass%77ord=S3cretHALF2&sslmode=require":
        "postgresql://***@h/db?pass%77ord=***&sslmode=require",
    "postgresql://u@h/db?%70assword=S3cretHALF2": "postgresql://***@h/db?%70assword=***",
    # a tab in the user info: in the password, in the user name (a token)
    "postgresql://u:S3cr\tetHALF2@h/db": "postgresql://***@h/db",
    "https://S3cr\tetHALF2@h/team/repo.git": "https://***@h/team/repo.git",
    # a fragment
    "postgresql://u@h/db#password=S3cretHALF2": "postgresql://***@h/db#password=***",
    "https://h/cb#access_token=S3cretHALF2&state=x": "https://h/cb#access_token=***&state=x",
}


@pytest.mark.parametrize("text", list(SPLIT))
def test_no_part_of_a_secret_is_left_where_masking_once_stopped(text):
    from reprotrain.redact import masked_uri

    for shown in (masked(text), masked_uri(text)):
        assert shown == SPLIT[text]
        assert not any(half in shown for half in HALVES), shown
    assert holds_credentials(text)


@pytest.mark.parametrize("text", list(FORMS))
def test_every_form_of_a_password_is_masked(text):
    assert masked(text) == FORMS[text]
    assert SECRET not in masked(text) and holds_password(text)


@pytest.mark.parametrize("text", KEPT)
def test_text_without_a_password_is_left_as_it_is(text):
    assert masked(text) == text and not holds_password(text)


@pytest.mark.parametrize("text", list(USERS))
def test_a_urls_user_name_is_never_shown_yet_is_no_password(text):
    assert masked(text) == USERS[text] and not holds_password(text)


# Raw blanks and quotes, which SQLAlchemy (MLflow's and Optuna's URI parser) takes into the
# password, where free text would end a URI.
RAW = {f"postgresql://u:{SECRET} with blanks@h:5432/db": "postgresql://***@h:5432/db",
       f"postgresql+psycopg://u:'{SECRET}' x@h/db?sslmode=disable":
           "postgresql+psycopg://***@h/db?sslmode=disable",
       f"postgresql://u@h/db?password='{SECRET} x'&sslmode=disable":
           "postgresql://***@h/db?password=***&sslmode=disable"}


@pytest.mark.parametrize("uri", list(RAW))
def test_a_database_uri_is_masked_as_sqlalchemy_reads_it(uri):
    from reprotrain.redact import masked_uri

    assert masked_uri(uri) == RAW[uri] and SECRET not in masked_uri(uri)
    for text, want in FORMS.items():  # what masked() already masks stays as it is
        assert masked_uri(text) == want
    for text in KEPT:
        assert masked_uri(text) == text


def test_the_server_and_the_sweep_mask_with_the_one_owner():
    from reprotrain.sweep.study import shown
    from reprotrain.team import server

    for text, want in FORMS.items():
        assert server.masked(text) == want and shown(text) == want
    for uri, want in RAW.items():
        assert shown(uri) == want and server.masked_uri(uri) == want


def test_a_sweep_never_shows_or_tags_its_storages_password(tmp_path, postgres):  # noqa: F811
    """`make sweep STORAGE=...?password=...`, for real: the storage unreachable (the error
    line), then reachable (the line it prints, the MLflow parent run's tag). PostgreSQL's trust
    auth ignores the password, so the study opens with it in the URI."""
    import signal
    import subprocess
    import sys
    import time

    import mlflow

    from tests.conftest import run
    from tests.platform.test_sweep import TINY, project

    repo = project(tmp_path, TINY)
    env = env_with()
    refused = run([sys.executable, "-m", "reprotrain.sweep", "run", "sweeps/tiny.yaml", "--storage",
                   f"postgresql://nobody@127.0.0.1:1/none?password={SECRET}&connect_timeout=3"],
                  repo, env=env, check=False)
    assert refused.returncode == 1 and "cannot open the study storage" in refused.stderr
    assert SECRET not in refused.stdout + refused.stderr, refused.stderr
    assert "password=***" in refused.stderr

    uri = create_database(postgres, "masked_sweep", schema=False) + f"?password={SECRET}&sslmode=disable"
    proc = subprocess.Popen([sys.executable, "-m", "reprotrain.sweep", "run", "sweeps/tiny.yaml",
                             "--trials", "1", "--study", "masked", "--storage", uri], cwd=repo,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # Workers start once the parent run is open with its tags: enough, the trial need not run.
        deadline = time.monotonic() + 180
        while not (repo / ".dvc/tmp/sweeps/masked/worker-0.log").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGINT)
        text = proc.communicate(timeout=120)[0]
    assert SECRET not in text and "masked_sweep?password=***&sslmode=disable" in text, text
    mlflow.set_tracking_uri(f"sqlite:///{repo / 'mlflow.db'}")
    (parent,) = [r for r in mlflow.search_runs(search_all_experiments=True, output_format="list")
                 if r.info.run_name == "masked"]
    assert parent.data.tags["optuna_storage"] == masked(uri)
    assert SECRET not in str(parent.data.tags) + str(parent.data.params)


def test_a_tracking_uris_password_reaches_no_file_tag_or_line(tmp_path, digits, postgres):  # noqa: F811
    """MLFLOW_TRACKING_URI with a database password, for real (issue 55): train logs to one
    database with `?password=`, evaluate to another with the password in the user info, a `/` in
    it; evaluate's run then names the training's store in a tag. run.json (0644), every tag and
    param of both stores and every line name the stores masked. Trust auth ignores the password."""
    import json
    import sys

    import mlflow

    from tests.conftest import ROOT, run
    from tests.support.workspaces import workspace

    w = workspace(tmp_path / "w", digits, epochs="1")
    trained_in = create_database(postgres, "masked_train")
    evaluated_in = create_database(postgres, "masked_eval")
    host, _, db = evaluated_in.removeprefix("postgresql://postgres@").partition("/")
    query = f"{trained_in}?password={SECRET}&sslmode=disable"
    userinfo = f"postgresql://postgres:pw/{SECRET}%40x@{host}/{db}"
    said = ""
    for stage, uri in (("train", query), ("evaluate", userinfo)):
        p = run([sys.executable, "-m", f"stages.{stage}"], w,
                env=env_with(PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=uri))
        said += p.stdout + p.stderr
        link = (w / "models/train/run.json").read_text()
        assert SECRET not in link and json.loads(link)["tracking_uri"] == masked(uri), link
    assert SECRET not in said, said
    tags = {}
    for uri in (trained_in, evaluated_in):
        client = mlflow.MlflowClient(uri)
        for r in client.search_runs([e.experiment_id for e in client.search_experiments()]):
            assert SECRET not in str(r.data.params), r.data.params
            tags |= r.data.tags
    assert tags["training_tracking_uri"] == masked(query)
    assert SECRET not in str(tags), tags
