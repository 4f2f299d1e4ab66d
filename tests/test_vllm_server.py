"""Server lifecycle: loopback only, clear errors for a dead or failing server, always stopped."""

import pytest

from pipeline.config import load_profile
from pipeline.vllm_server import ServerError, free_port, server_command, vllm_server


@pytest.mark.unit
def test_command_binds_loopback_and_carries_the_profile():
    profile = load_profile("configs/kimi-k2.5.yaml")
    cmd = server_command(profile, "moonshotai/Kimi-K2.5", 8000)
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "8"
    assert cmd[cmd.index("--kv-cache-dtype") + 1] == "auto"
    assert "--trust-remote-code" in cmd and "--enforce-eager" not in cmd
    assert cmd[cmd.index("--reasoning-parser") + 1] == "kimi_k2"


@pytest.mark.unit
def test_dead_base_url_gives_a_clear_error(tmp_path):
    port = free_port()
    profile = load_profile(
        "configs/tiny.yaml",
        [f"server.base_url=http://127.0.0.1:{port}/v1", "server.startup_timeout_s=2"],
    )
    with (
        pytest.raises(ServerError, match=r"not healthy after 2s; raise server.startup_timeout_s"),
        vllm_server(profile, "unused", tmp_path / "log"),
    ):
        pass


@pytest.mark.e2e
def test_a_server_that_fails_to_load_reports_its_log_and_is_gone(tmp_path):
    profile = load_profile("configs/tiny.yaml", ["server.startup_timeout_s=300"])
    missing = tmp_path / "no-such-model"
    missing.mkdir()
    with (
        pytest.raises(ServerError, match="vLLM exited with status") as err,
        vllm_server(profile, str(missing), tmp_path / "vllm.log"),
    ):
        pass
    assert str(tmp_path / "vllm.log") in str(err.value)
