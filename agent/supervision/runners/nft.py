"""Running Debian's ``nft`` for the nftables tables a unit owns (``LaunchRequest.firewall``).

The systemd runner hands ``nft``'s path to the manager (``ExecStartPre=``/``ExecStopPost=``);
the process runner runs it itself around its child (:func:`run_nft`). Both find it with
:func:`nft_binary`, and both refuse to start a unit with rules when it is missing: an
engine whose ports were meant to be confined never runs open by accident.
"""

from __future__ import annotations

import asyncio
import shutil

from viiwork.agent.supervision.runners.base import RunnerError

#: Where nft is looked for (Debian's nftables package installs /usr/sbin/nft).
NFT_PATH = "/usr/sbin:/sbin:/usr/bin:/bin"
#: nft loads a table of a few rules in milliseconds; this bounds a hung netlink socket.
NFT_TIMEOUT_S = 10.0


def nft_binary(path: str = NFT_PATH) -> str:
    """The absolute path of ``nft``; RunnerError naming the fix when it is not installed."""
    found = shutil.which("nft", path=path)
    if found is None:
        raise RunnerError("nft not found (install Debian's nftables package, or set the model's "
                          "gang_firewall = false to run its gang without rules: docs/security.md)")
    return found


async def run_nft(argv: tuple[str, ...], timeout_s: float = NFT_TIMEOUT_S) -> None:
    """Run ``argv`` (an nft command); RunnerError with nft's own message when it fails
    (not root, a syntax error, a table that is not there)."""
    try:
        proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    except OSError as exc:
        raise RunnerError(f"cannot run {argv[0]}: {exc.strerror or exc}") from exc
    try:
        async with asyncio.timeout(timeout_s):
            out, _ = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise RunnerError(f"{argv[0]} did not finish within {timeout_s:.0f} s") from None
    if proc.returncode != 0:
        text = out.decode(errors="replace").strip().splitlines()
        raise RunnerError(f"nft failed (status {proc.returncode}): {text[0] if text else 'no message'}")
