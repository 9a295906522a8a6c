"""Checks of what the engines need: their binaries, their versions, and the model files."""

from __future__ import annotations

from viiwork.agent.host.doctor.registry import CheckResult, Skip, Verdict, check, config_or_skip, result_for
from viiwork.agent.host.facts import BinaryFact, BinaryState, HostFacts, version_at_least


def _configured_binaries(facts: HostFacts) -> list[tuple[str, BinaryFact]]:
    """The engine binaries the configured models use, each with its subject
    ("llamacpp: llama-server"). Skip when no model is configured; FactUnavailable when the
    binaries could not be gathered."""
    config = config_or_skip(facts)
    if not config.models:
        raise Skip("no model configured")
    return [(f"{b.engine}: {b.binary}", b) for b in facts.need("binaries")]


@check("engine.binary", "Engine binaries")
def check_engine_binary(facts: HostFacts) -> list[CheckResult]:
    """Each engine binary the config uses exists and is executable. A bare name is searched
    on the PATH of the user running the doctor. For a gang's entry, what this host runs: the
    head its serving engine, a worker its part (llama.cpp's `rpc_binary`, vLLM's `ray_binary`),
    a host the entry does not name nothing.

    - **fail**: missing, not executable, or the engine cannot say which binary it runs; the
      models using it cannot start (every backend fails at launch and ends `dead`).
    - **skipped**: no model configured.
    """
    r = result_for("engine.binary")
    results = []
    for subject, b in _configured_binaries(facts):
        models = ", ".join(b.models)
        if b.state is BinaryState.OK:
            # The subject already names the binary: say where PATH found a bare name, not the path twice.
            found = b.resolved and b.resolved != b.binary
            results.append(r(Verdict.OK, f"found at {b.resolved}" if found else "executable", subject=subject))
            continue
        consequence = f"model(s) {models} cannot start: every backend fails at launch and ends dead"
        option = f" or set {b.option_path} to its full path" if b.option_path else ""
        if b.state is BinaryState.MISSING:
            remedy = f"install {b.display_name}{option}"
        elif b.state is BinaryState.NOT_EXECUTABLE:
            remedy = f"`chmod +x {b.resolved}`{option}"
        else:
            remedy = f"fix the engine options of model(s) {models}"
        results.append(r(Verdict.FAIL, b.detail, consequence, remedy, subject=subject))
    return results


@check("engine.version", "Engine versions")
def check_engine_version(facts: HostFacts) -> list[CheckResult]:
    """The installed engine's version, where the engine can say. Engines with a minimum
    version (the adapter's `Version` capability) are compared with it; others show the
    binary's own `--version` line as reported.

    - **fail**: below the adapter's minimum.
    - **degraded**: the version command failed or printed no version (a binary that fails
      `--version` often fails at start too), or the version cannot be compared.
    - **skipped**: the binary is missing (see engine.binary) or no model is configured.
    """
    r = result_for("engine.version")
    results = []
    for subject, b in _configured_binaries(facts):
        if b.state is not BinaryState.OK:
            results.append(r(Verdict.SKIPPED, "binary not usable (see engine.binary)", subject=subject))
            continue
        if b.version_source is None:
            results.append(r(Verdict.SKIPPED, "version not read", subject=subject))
            continue
        if b.version is None:
            results.append(r(Verdict.DEGRADED, b.version_error or "no version printed",
                             "the installed version is unknown; the binary may not run at all",
                             f"run `{b.resolved or b.binary} --version` by hand and fix what it reports",
                             subject=subject))
            continue
        if b.minimum_version:
            ok = version_at_least(b.version, b.minimum_version)
            if ok is False:
                results.append(r(Verdict.FAIL, f"{b.version} is older than the minimum {b.minimum_version}",
                                 "the adapter relies on behaviour this version lacks: backends may fail or misreport load",
                                 f"upgrade {b.display_name} to {b.minimum_version} or newer", subject=subject))
                continue
            if ok is None:
                results.append(r(Verdict.DEGRADED, f"{b.version} cannot be compared with the minimum {b.minimum_version}",
                                 "the version may be too old", f"check {b.display_name} is {b.minimum_version} or newer",
                                 subject=subject))
                continue
        results.append(r(Verdict.OK, b.version, subject=subject))
    return results


@check("gang.firewall", "Gang firewall")
def check_gang_firewall(facts: HostFacts) -> CheckResult:
    """`nft` (Debian's `nftables`) is installed when a gang entry needs nftables rules: a
    vLLM or SGLang entry with `hosts` and `gang_firewall` on (the default), whose parts bind
    Ray's or torch's ports; the rules admit only the gang's hosts to them (docs/security.md).
    The process runner also needs the agent to run as root to load them.

    - **fail**: nft is missing: those gang parts fail to start, so the models never serve.
    - **skipped**: no gang entry needs rules.
    """
    r = result_for("gang.firewall")
    config_or_skip(facts)
    fact = facts.need("gang_firewall")
    if not fact.models:
        raise Skip("no gang entry needs nftables rules")
    models = ", ".join(fact.models)
    if fact.nft is None:
        return r(Verdict.FAIL, f"nft is not installed; model(s) {models} need it",
                 f"the gang parts of model(s) {models} cannot start: those models never serve",
                 "`apt install nftables`, or set gang_firewall = false in those entries (their engines' "
                 "ports are then open to whatever reaches the host)")
    return r(Verdict.OK, f"{fact.nft}, for model(s) {models}")


@check("model.path", "Model files")
def check_model_path(facts: HostFacts) -> list[CheckResult]:
    """Local model paths (absolute, or starting with `./` or `~`) exist, are what the
    engine loads and can be read by the user running the doctor (engines run as the
    `viiwork` user, which needs read access too). A llama.cpp model is a regular file (a
    GGUF, or a symlink to one); a vLLM or SGLang model is a regular file or a directory (a
    Hugging Face folder). Hub ids (`org/name`) are not checked.

    - **fail**: missing, unreadable, empty (0 bytes, as /proc files are), a directory where
      the engine takes a file, or neither a file nor a directory (a FIFO, a device, a
      socket): the backend fails at load and, after its respawns, ends `dead`. The path is
      only `stat`ed, never opened.
    - **skipped**: no model has a local path.
    """
    r = result_for("model.path")
    config_or_skip(facts)
    paths = facts.need("model_paths")
    if not paths:
        raise Skip("no model has a local path")
    results = []
    for p in paths:
        subject = f"models[{p.index}].path"
        if not p.exists:
            results.append(r(Verdict.FAIL, f"{p.path} does not exist (model {p.model})",
                             f"model {p.model} cannot load: its backends end dead",
                             f"put the model file at {p.path} or fix {subject}", subject=subject))
        elif p.kind not in ("file", "directory") or (p.kind == "directory" and not p.directory_ok):
            wanted = "a model file or folder" if p.directory_ok else "a GGUF file"
            results.append(r(Verdict.FAIL, f"{p.path} is not {wanted}: it is "
                             f"{'a directory' if p.kind == 'directory' else p.kind} (model {p.model})",
                             f"model {p.model} cannot load: its backends end dead",
                             f"point {subject} at {wanted}", subject=subject))
        elif p.kind == "file" and p.size_bytes == 0:
            results.append(r(Verdict.FAIL, f"{p.path} is empty: 0 bytes (model {p.model})",
                             f"model {p.model} cannot load: its backends end dead",
                             f"point {subject} at the model file", subject=subject))
        elif not p.readable:
            results.append(r(Verdict.FAIL, f"{p.path} is not readable (model {p.model})",
                             f"model {p.model} cannot load: its backends end dead",
                             f"make it readable by the viiwork user (`chmod a+r {p.path}`)", subject=subject))
        else:
            results.append(r(Verdict.OK, p.path, subject=subject))
    return results
