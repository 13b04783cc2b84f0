"""POST /rollout calls back only a trainer host it is allowed to, at a base URL."""

from __future__ import annotations

from pathlib import Path

import pytest

from store.settings import Settings
from workers.rollout.remote_request import check_trainer_host, parse_rollout_request

REQUEST = {"rollout_id": "r1", "server_url": "http://127.0.0.1:9/", "tokenizer_name": "qwen3",
           "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("url", ["http://127.0.0.1:9/x?y=1", "http://127.0.0.1:9/#frag",
                                 "http://user:pw@127.0.0.1:9"])
def test_query_fragment_and_credentials_are_refused(url: str) -> None:
    with pytest.raises(ValueError, match="server_url"):
        parse_rollout_request({**REQUEST, "server_url": url})


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://localhost:1", "http://[::1]:2",
                                 "http://127.9.9.9"])
def test_loopback_is_allowed_by_default(url: str, tmp_path: Path) -> None:
    check_trainer_host(url, Settings(data_dir=tmp_path))


@pytest.mark.parametrize("url", ["http://169.254.169.254/latest", "http://10.0.0.5:8000",
                                 "https://example.com"])
def test_other_hosts_need_the_setting(url: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="TRAJSTORE_ROLLOUT_TRAINER_HOSTS"):
        check_trainer_host(url, Settings(data_dir=tmp_path))
    check_trainer_host(url, Settings(data_dir=tmp_path, rollout_trainer_hosts="*"))


def test_an_allowlist_names_exact_host_and_port(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path,
                        rollout_trainer_hosts="gpu-1:8000, GPU-2:9000, [::1]:7000, trainer:443")
    check_trainer_host("http://gpu-2:9000", settings)
    check_trainer_host("http://gpu-1:8000/v1/completions", settings)
    check_trainer_host("http://[::1]:7000", settings)
    check_trainer_host("https://trainer", settings)  # https's port
    for url in ("http://gpu-2:9001", "http://gpu-1", "http://gpu-1:80", "http://trainer",
                "http://127.0.0.1:8000",  # the list replaces loopback
                "http://[::1]:7001", "http://gpu-3:8000"):
        with pytest.raises(ValueError, match="server_url"):
            check_trainer_host(url, settings)


@pytest.mark.parametrize("entry", ["gpu-1", "gpu-1:", "gpu-1:x", "[::1]"])
def test_an_entry_without_a_port_is_refused_naming_the_setting(entry: str,
                                                               tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, rollout_trainer_hosts=entry)
    with pytest.raises(ValueError, match="TRAJSTORE_ROLLOUT_TRAINER_HOSTS entry"):
        check_trainer_host("http://gpu-1:8000", settings)
