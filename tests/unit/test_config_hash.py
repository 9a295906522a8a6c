"""The config hash across releases: an entry that does not use keys added later hashes as it did
before they existed, so an upgraded agent adopts the engines it finds (docs/systemd.md)."""

from __future__ import annotations

import pytest

from viiwork.agent.config.load import parse_config
from viiwork.agent.supervision.launch import config_hash

HEAD = '[node]\nname = "n"\n[[models]]\nname = "m"\n'

# Hashes computed by the release before issue 21 (commit 4ef6926) for the same entries.
BEFORE_GANGS = {
    "llamacpp": ('engine = "llamacpp"\npath = "/tmp/m.gguf"\n',
                 "bd4aca12e6ea65624ef4aa5a9f73397e9f3dc3abba4999b50cb63b576f8a5420"),
    "llamacpp with options": ('engine = "llamacpp"\npath = "/tmp/m.gguf"\ngpus = [0, 1]\n'
                              '[models.llamacpp]\nthreads = 4\ngpu_layers = 20\n',
                              "22535df47757432bf6a3f7653f2ead6621bad3c689c8d936aa6cd206b32f074e"),
    "vllm": ('engine = "vllm"\npath = "/tmp/m"\ngpus = [0]\n',
             "c807fe7b5b48f92384d4f16bdb63dde944683047f5ae0f340f517ca07100e2ef"),
    "sglang": ('engine = "sglang"\npath = "/tmp/m"\ngpus = [0]\n',
               "e143449c1cc0f813003ac68c7d7977c8e221ae72fb84ab0fb3fa075faa060086"),
}


@pytest.mark.parametrize("name", BEFORE_GANGS)
def test_an_entry_without_the_keys_added_later_hashes_as_before(name: str) -> None:
    entry, before = BEFORE_GANGS[name]
    assert config_hash(parse_config(HEAD + entry).models[0]) == before


def test_a_key_added_later_counts_once_set() -> None:
    entry, before = BEFORE_GANGS["llamacpp with options"]
    changed = parse_config(HEAD + entry + 'split_mode = "row"\n').models[0]
    assert config_hash(changed) != before
    renamed = parse_config(HEAD + entry + 'rpc_binary = "/opt/llama/rpc-server"\n').models[0]
    assert config_hash(renamed) != before
