"""The packaged unit gives the agent the time its stop path takes (docs/systemd.md, "Stopping")."""

from __future__ import annotations

import configparser
from pathlib import Path

from viiwork.agent.config.schema import HealthConfig, SupervisorConfig

UNIT = Path(__file__).resolve().parents[2] / "systemd" / "viiwork.service"
MARGIN_S = 5.0  # the agent's own bound: drain + engine stop + 5 s


def test_timeout_stop_sec_is_the_drain_and_engine_stop_defaults_plus_the_margin() -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read_string(UNIT.read_text())
    value = unit["Service"]["TimeoutStopSec"]
    assert value.endswith("s") and value[:-1].isdigit(), value
    expected = HealthConfig().drain_timeout_s + SupervisorConfig().stop_timeout_s + MARGIN_S
    assert float(value[:-1]) == expected
