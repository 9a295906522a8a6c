"""GPU pinning and the engine environment (docs/architecture.md, "A backend's life"): environment construction only."""

from __future__ import annotations

import pytest

from viiwork.agent.supervision.pinning import engine_environment, inheritable, pinning_variables

BASE = {"PATH": "/usr/bin:/bin", "HOME": "/var/lib/viiwork", "LANG": "C.UTF-8"}


@pytest.mark.parametrize(
    ("vendor", "gpus", "expected"),
    [
        pytest.param("nvidia", ("0",), {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0"},
                     id="nvidia-one-index"),
        pytest.param("nvidia", ("2", "3"), {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "2,3"},
                     id="nvidia-two-indexes"),
        pytest.param("nvidia", ("GPU-8f2c7e1a-0b1d-4c2e-9f3a-1234567890ab",),
                     {"CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                      "CUDA_VISIBLE_DEVICES": "GPU-8f2c7e1a-0b1d-4c2e-9f3a-1234567890ab"},
                     id="nvidia-uuid"),
        pytest.param("amd", ("1",), {"ROCR_VISIBLE_DEVICES": "1"}, id="amd-index-rocr-only"),
        pytest.param("amd", ("0", "1"), {"ROCR_VISIBLE_DEVICES": "0,1"}, id="amd-two"),
        pytest.param("unknown", ("0",), {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0"},
                     id="unknown-vendor-uses-cuda-variables"),
        pytest.param("cpu", (), {"CUDA_VISIBLE_DEVICES": "-1", "HIP_VISIBLE_DEVICES": "-1",
                                 "ROCR_VISIBLE_DEVICES": "-1"}, id="cpu-hides-every-gpu"),
        pytest.param("nvidia", (), {"CUDA_VISIBLE_DEVICES": "-1", "HIP_VISIBLE_DEVICES": "-1",
                                    "ROCR_VISIBLE_DEVICES": "-1"}, id="no-gpus-is-cpu-whatever-the-vendor"),
    ],
)
def test_pinning_variables(vendor, gpus, expected):
    assert pinning_variables(vendor, gpus) == expected


@pytest.mark.parametrize(
    ("inherited", "absent"),
    [
        pytest.param({"CUDA_VISIBLE_DEVICES": "0"}, "CUDA_VISIBLE_DEVICES", id="inherited-cuda"),
        pytest.param({"HIP_VISIBLE_DEVICES": "0"}, "HIP_VISIBLE_DEVICES", id="inherited-hip"),
        pytest.param({"GPU_DEVICE_ORDINAL": "1"}, "GPU_DEVICE_ORDINAL", id="inherited-opencl-ordinal"),
        pytest.param({"GGML_VK_VISIBLE_DEVICES": "0"}, "GGML_VK_VISIBLE_DEVICES", id="inherited-vulkan"),
        pytest.param({"CUDA_DEVICE_ORDER": "FASTEST_FIRST"}, "CUDA_DEVICE_ORDER", id="inherited-order"),
        pytest.param({"NOTIFY_SOCKET": "/run/systemd/notify"}, "NOTIFY_SOCKET", id="notify-socket"),
        pytest.param({"WATCHDOG_USEC": "30000000"}, "WATCHDOG_USEC", id="watchdog"),
        pytest.param({"WATCHDOG_PID": "12"}, "WATCHDOG_PID", id="watchdog-pid"),
        pytest.param({"LISTEN_FDS": "2"}, "LISTEN_FDS", id="socket-activation"),
        pytest.param({"LISTEN_PID": "12"}, "LISTEN_PID", id="socket-activation-pid"),
        pytest.param({"INVOCATION_ID": "abc"}, "INVOCATION_ID", id="invocation-id"),
        pytest.param({"CREDENTIALS_DIRECTORY": "/run/credentials/viiwork.service"}, "CREDENTIALS_DIRECTORY",
                     id="credentials"),
        pytest.param({"VIIWORK_URL": "http://x"}, "VIIWORK_URL", id="viiwork-prefix"),
        pytest.param({"VIIWORK_CA_KEY_PASSPHRASE": "s3cret"}, "VIIWORK_CA_KEY_PASSPHRASE", id="viiwork-secret"),
    ],
)
def test_inherited_device_and_agent_variables_are_stripped(inherited, absent):
    env = engine_environment({**BASE, **inherited}, vendor="nvidia", gpus=("1",))
    assert absent not in env or env[absent] != inherited[absent]
    for key, value in BASE.items():
        assert env[key] == value


def test_inherited_cuda_visible_devices_is_replaced_not_kept():
    env = engine_environment({**BASE, "CUDA_VISIBLE_DEVICES": "0"}, vendor="nvidia", gpus=("3",))
    assert env["CUDA_VISIBLE_DEVICES"] == "3"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def test_amd_backend_does_not_keep_an_inherited_cuda_list():
    # HIP reads CUDA_VISIBLE_DEVICES too: an inherited one would narrow the AMD pinning.
    env = engine_environment({**BASE, "CUDA_VISIBLE_DEVICES": "0"}, vendor="amd", gpus=("1",))
    assert "CUDA_VISIBLE_DEVICES" not in env
    assert env["ROCR_VISIBLE_DEVICES"] == "1"


@pytest.mark.parametrize(
    ("model_env", "engine_env", "key", "value"),
    [
        pytest.param({"OMP_NUM_THREADS": "4"}, {}, "OMP_NUM_THREADS", "4", id="model-env-added"),
        pytest.param({"CUDA_VISIBLE_DEVICES": "5"}, {}, "CUDA_VISIBLE_DEVICES", "5",
                     id="model-env-overrides-pinning"),
        pytest.param({}, {"GGML_VK_VISIBLE_DEVICES": "1"}, "GGML_VK_VISIBLE_DEVICES", "1",
                     id="engine-env-added"),
        pytest.param({"X": "model"}, {"X": "engine"}, "X", "engine", id="engine-env-wins-over-model-env"),
        pytest.param({"PATH": "/opt/engine/bin"}, {}, "PATH", "/opt/engine/bin", id="model-env-overrides-inherited"),
    ],
)
def test_layers_in_order(model_env, engine_env, key, value):
    env = engine_environment(BASE, vendor="nvidia", gpus=("1",), model_env=model_env, engine_env=engine_env)
    assert env[key] == value


def test_cpu_environment_hides_gpus_and_keeps_the_rest():
    env = engine_environment({**BASE, "CUDA_VISIBLE_DEVICES": "0,1", "VIIWORK_X": "y"}, vendor="cpu", gpus=())
    assert env == {**BASE, "CUDA_VISIBLE_DEVICES": "-1", "HIP_VISIBLE_DEVICES": "-1", "ROCR_VISIBLE_DEVICES": "-1"}


def test_input_is_not_modified():
    inherited = {**BASE, "CUDA_VISIBLE_DEVICES": "0"}
    before = dict(inherited)
    engine_environment(inherited, vendor="nvidia", gpus=("1",), model_env={"A": "b"})
    assert inherited == before


@pytest.mark.parametrize(
    ("name", "expected"),
    [("PATH", True), ("HOME", True), ("VIIWORKER", True), ("VIIWORK_", False),
     ("LISTEN_FDNAMES", False), ("JOURNAL_STREAM", False), ("ROCR_VISIBLE_DEVICES", False)],
)
def test_inheritable(name, expected):
    assert inheritable(name) is expected
