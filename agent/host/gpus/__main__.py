"""``python -m viiwork.agent.host.gpus``: print this host's GPU inventory, or record NVML's answers.

    python -m viiwork.agent.host.gpus                 # a short table
    python -m viiwork.agent.host.gpus --json          # the inventory as JSON
    python -m viiwork.agent.host.gpus --record-nvml   # an NVML recording (for a bug report)
"""

from __future__ import annotations

import argparse
import json
import sys

from viiwork.agent.host.gpus.amd import AmdSysfsReader
from viiwork.agent.host.gpus.inventory import read_inventory
from viiwork.agent.host.gpus.nvml import NvmlReader
from viiwork.agent.host.gpus.nvml_record import record_nvml
from viiwork.agent.host.gpus.udev import enumerate_pci_gpus


def _mib(value: int | None) -> str:
    return "?" if value is None else f"{value // (1024 * 1024)} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m viiwork.agent.host.gpus", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="inventory and PCI GPUs as JSON")
    parser.add_argument("--record-nvml", action="store_true", help="print an NVML recording (JSON)")
    parser.add_argument("--provenance", default="", help="text stored in the recording (box, driver, date)")
    args = parser.parse_args(argv)
    if args.record_nvml:
        print(json.dumps(record_nvml(provenance=args.provenance), indent=2))
        return 0
    reader = NvmlReader()
    try:
        inventory = read_inventory([reader, AmdSysfsReader("/")])
    finally:
        reader.close()
    try:
        pci = [g.to_json() for g in enumerate_pci_gpus()]
    except Exception as exc:  # udev unavailable: the inventory still stands
        pci = [{"error": f"{type(exc).__name__}: {exc}"}]
    if args.json:
        print(json.dumps({**inventory.to_json(), "pci": pci}, indent=2))
        return 0
    for source in inventory.sources:
        print(f"{source.vendor.value}: {source.state.value}: {source.detail}")
    for gpu in inventory.gpus:
        print(f"  {gpu.label()}  memory {_mib(gpu.memory_used_bytes)}/{_mib(gpu.memory_total_bytes)}"
              f"  util {gpu.utilization_percent if gpu.utilization_percent is not None else '?'}%"
              f"  power {gpu.power_watts if gpu.power_watts is not None else '?'} W"
              f"  temp {gpu.temperature_c if gpu.temperature_c is not None else '?'} C")
    print(f"PCI GPUs: {len(pci)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
