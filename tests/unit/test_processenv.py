"""What the processes the product starts inherit: an allowlist (shared/infrastructure/processenv.py)."""

from __future__ import annotations

from shared.infrastructure import processenv

SHELL = {
    "PATH": "/usr/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "AWS_SECRET_ACCESS_KEY": "aws",
    "GITHUB_TOKEN": "ghp",
    "SANDBOX_API_KEY": "key",
    "SBX_ORG_KEYS": "/etc/keys",
    "SBX_POOL_MIN_IDLE": "2",
    "SBX_GH_TOKEN": "proxy-credential",
    "NATS_URL": "nats://x",
    "NATS_TOKEN": "tok",
}


def test_system_is_only_what_programs_need_to_run():
    assert processenv.system(SHELL) == {"PATH": "/usr/bin", "HOME": "/root", "LANG": "C.UTF-8"}


def test_a_service_gets_its_settings_and_nats_but_no_key_or_credential():
    env = processenv.service(SHELL, withhold=["SBX_GH_TOKEN"])
    assert env == processenv.system(SHELL) | {
        "SBX_POOL_MIN_IDLE": "2",
        "NATS_URL": "nats://x",
        "NATS_TOKEN": "tok",
    }


def test_the_keys_only_when_asked_and_credentials_only_by_name():
    gateway = processenv.service(SHELL, keys=True, withhold=["SBX_GH_TOKEN"])
    assert gateway["SANDBOX_API_KEY"] == "key" and gateway["SBX_ORG_KEYS"] == "/etc/keys"
    assert "SBX_GH_TOKEN" not in gateway and "GITHUB_TOKEN" not in gateway
    scaler = processenv.service(SHELL, extra=["SBX_GH_TOKEN", "GITHUB_TOKEN"], withhold=["SBX_GH_TOKEN"])
    assert scaler["SBX_GH_TOKEN"] == "proxy-credential" and scaler["GITHUB_TOKEN"] == "ghp"
    assert "SANDBOX_API_KEY" not in scaler and "AWS_SECRET_ACCESS_KEY" not in scaler


def test_a_sandboxs_open_files_stay_far_below_the_hosts_file_table():
    from shared.runtime.local import bwrap

    for pids in (8, 512, 4096, 1_000_000):
        for file_max in (100_000, 2_466_126, 2**63 - 1):
            limit = bwrap.nofile(pids, file_max)
            assert bwrap.NOFILE_MIN <= limit <= bwrap.NOFILE_MAX
            if limit > bwrap.NOFILE_MIN:
                assert limit * pids <= file_max // 8
