"""viiworkctl keys: the issuer of client API keys (run on the operator's workstation).

``issuer init --out DIR``, ``issue``, ``list``, ``inspect TOKEN``, ``revoke`` run where the
issuer key lives; ``push-revocations FILE`` hands a signed list to a running agent through its
admin socket, which takes it and pushes it to every live peer (agent/peering/revocation_sync.py).
The keys are Ed25519-signed JWTs (agent/auth, docs/security.md "Client keys").

Exit codes: 0 done, 1 a failure (a file that cannot be used, a token that does not verify),
2 a usage error. Errors are one line on stderr; a token is printed only by ``issue``, once.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import jwt
from rich.console import Console
from rich.table import Table
from rich.text import Text

from viiwork.agent.auth.claims import MAX_LIMIT, NAME_PATTERN, KeyClaims, Priority, Scope, claims_from_payload
from viiwork.agent.auth.errors import InvalidApiKey, RevocationRefused
from viiwork.agent.auth.issuing import (
    PUB_FILE,
    REVOCATIONS_FILE,
    Issuer,
    IssuerDirError,
    append_record,
    init_issuer,
    load_issuer,
    new_jti,
    read_records,
    sign_key,
    sign_revocations,
)
from viiwork.agent.auth.keyset import IssuerKeyError, KeySet
from viiwork.agent.auth.revocations import MAX_LIST_BYTES, RevocationList, empty_list, read_revocations
from viiwork.agent.auth.verifier import Verifier
from viiwork.agent.cli.control import add_socket_args, send
from viiwork.agent.cli.tables import cell
from viiwork.agent.control import BY_NAME

DURATION = re.compile(r"([1-9][0-9]{0,6})([smhd])")
UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_EXPIRES_S = 3650 * 86400


class KeysFailure(Exception):
    """A failure reported as one line and exit status 1."""


def _duration(text: str) -> int:
    match = DURATION.fullmatch(text)
    if not match or int(match[1]) * UNIT_S[match[2]] > MAX_EXPIRES_S:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 90d, 12h, 30m (at most 3650d)")
    return int(match[1]) * UNIT_S[match[2]]


def _limit(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= MAX_LIMIT:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer 1..{MAX_LIMIT}")
    return int(text)


def _tenant(text: str) -> str:
    if not NAME_PATTERN.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r}: a tenant is 1..64 letters, digits and ._- (a letter or digit first)")
    return text


def _scope(text: str) -> frozenset[Scope]:
    words = [w for w in text.replace(",", " ").split() if w]
    allowed = {s.value for s in Scope}
    if not words or not set(words) <= allowed:
        raise argparse.ArgumentTypeError(f"{text!r}: scope is one or more of {', '.join(sorted(allowed))}")
    return frozenset(Scope(w) for w in words)


def _models(text: str) -> tuple[str, ...]:
    names = tuple(m.strip() for m in text.split(",") if m.strip())
    if not names:
        raise argparse.ArgumentTypeError("--models needs at least one model name (leave it out for every model)")
    return names


def register(subparsers: argparse._SubParsersAction) -> None:
    keys = subparsers.add_parser(
        "keys", help="client API keys: issuer, issue, list, inspect, revoke, push-revocations",
        description="Issue and revoke client API keys (Ed25519-signed JWTs). Run on the operator's workstation, "
                    "where the issuer key lives; nodes get issuer.pub. push-revocations runs on a node (or "
                    "wherever its admin socket is reachable) and spreads a list to the whole mesh.")
    keys.set_defaults(func=lambda args: _usage(keys))
    sub = keys.add_subparsers(dest="keys_command", metavar="SUBCOMMAND")

    issuer = sub.add_parser("issuer", help="issuer key pair tools", description="Issuer key pair tools.")
    issuer.set_defaults(func=lambda args: _usage(issuer))
    issuer_sub = issuer.add_subparsers(dest="issuer_command", metavar="SUBCOMMAND")
    init = issuer_sub.add_parser("init", help="create an issuer key pair in DIR",
                                 description="Create DIR/issuer.key (mode 0600), DIR/issuer.pub and DIR/issuer.json. "
                                             "Refuses to overwrite an existing issuer.")
    init.add_argument("--out", type=Path, required=True, metavar="DIR", help="directory for the issuer's files")
    init.add_argument("--name", default=None, metavar="NAME",
                      help="the iss claim of its keys (default viiwork-issuer); nodes check it")
    init.set_defaults(func=_run_init)

    issue = sub.add_parser("issue", help="issue a key; prints the token alone, once",
                           description="Sign a new client key and print the token on stdout (once: it is not "
                                       "kept). Its id, tenant and claims are recorded in issued.jsonl beside the "
                                       "issuer key.")
    issue.add_argument("--issuer-key", type=Path, required=True, metavar="FILE", help="the issuer.key file")
    issue.add_argument("--tenant", type=_tenant, required=True, metavar="T", help="who the key belongs to")
    issue.add_argument("--audience", required=True, action="append", metavar="AUD",
                       help="the mesh id, or a node name for a standalone node (repeat for several)")
    issue.add_argument("--models", type=_models, metavar="A,B", help="allowed models (default every model)")
    issue.add_argument("--rpm", type=_limit, metavar="N", help="requests per minute")
    issue.add_argument("--tpm", type=_limit, metavar="N", help="tokens per minute")
    issue.add_argument("--concurrency", type=_limit, metavar="N", help="requests in flight")
    issue.add_argument("--priority", choices=[p.value for p in Priority], default="normal",
                       help="scheduling priority (default normal)")
    issue.add_argument("--scope", type=_scope, default=frozenset({Scope.INFERENCE}), metavar="S",
                       help="inference, read, or both as 'inference,read' (default inference)")
    issue.add_argument("--expires", type=_duration, default=90 * 86400, metavar="DURATION",
                       help="lifetime, e.g. 90d, 12h (default 90d, at most 3650d)")
    issue.set_defaults(func=_run_issue)

    listing = sub.add_parser("list", help="the keys this issuer has issued (never the tokens)",
                             description="Read issued.jsonl beside the issuer key: ids, tenants, claims.")
    listing.add_argument("--issuer-key", type=Path, required=True, metavar="FILE", help="the issuer.key file")
    listing.add_argument("--json", action="store_true", help="one JSON array of the records")
    listing.set_defaults(func=_run_list)

    inspect = sub.add_parser("inspect", help="decode a token's header and claims (untrusted unless --issuer-pub)",
                             description="Print a token's header and claims without trusting them; with "
                                         "--issuer-pub, verify it as a node would (signature, iss, times).")
    inspect.add_argument("token", metavar="TOKEN")
    inspect.add_argument("--issuer-pub", type=Path, metavar="FILE", help="issuer.pub (or a directory of *.pub)")
    inspect.add_argument("--issuer-name", default=None, metavar="NAME",
                         help="expected iss (default: issuer.json beside --issuer-pub, else viiwork-issuer)")
    inspect.set_defaults(func=_run_inspect)

    revoke = sub.add_parser("revoke", help="write the next version of the signed revocation list",
                            description="Add key JTI to the revocation list and write the next version to FILE "
                                        "(and revocations.jwt beside the issuer key). Earlier revoked ids are "
                                        "kept. The current list is --current, else revocations.jwt beside the key.")
    revoke.add_argument("--issuer-key", type=Path, required=True, metavar="FILE", help="the issuer.key file")
    revoke.add_argument("--id", required=True, metavar="JTI", help="the key id (jti) to revoke")
    revoke.add_argument("--out", type=Path, required=True, metavar="FILE", help="where to write the new list")
    revoke.add_argument("--current", type=Path, metavar="FILE", help="the list to extend (default beside the key)")
    revoke.add_argument("--audience", action="append", default=[], metavar="AUD",
                        help="address the list to AUD too (it goes to every audience of the issued keys and of "
                             "the current list already)")
    revoke.set_defaults(func=_run_revoke)

    push = sub.add_parser("push-revocations", help=BY_NAME["push-revocations"].help,
                          description="Give the signed revocation list FILE (from keys revoke) to the agent on "
                                      "this host through its admin socket: it checks the list (signature, issuer, "
                                      "a version above the one it holds), keeps it, and pushes it at once to every "
                                      "live peer over mutual TLS. Prints the version taken and each peer's outcome.")
    push.add_argument("file", type=Path, metavar="FILE", help="the signed list (keys revoke --out FILE)")
    add_socket_args(push, "seconds to wait for the agent's answer (default 120)")
    push.add_argument("--json", action="store_true", help="print the agent's JSON answer")
    push.set_defaults(func=_run_push)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _fail(args: argparse.Namespace, message: str) -> int:
    name = " ".join(w for w in ("keys", getattr(args, "keys_command", None)) if w)
    print(f"viiworkctl {name}: {message}", file=sys.stderr)
    return 1


def _guard(run: Any) -> Any:
    def wrapped(args: argparse.Namespace) -> int:
        try:
            return int(run(args))
        except (IssuerKeyError, IssuerDirError, KeysFailure) as exc:
            return _fail(args, str(exc))
    wrapped.__doc__ = run.__doc__
    return wrapped


@_guard
def _run_init(args: argparse.Namespace) -> int:
    issuer = init_issuer(args.out, args.name) if args.name else init_issuer(args.out)
    print(f"issuer {issuer.name!r} key {issuer.kid}: {args.out / 'issuer.key'} (0600, keep it here), "
          f"{args.out / PUB_FILE} (install on every node)")
    return 0


@_guard
def _run_issue(args: argparse.Namespace) -> int:
    issuer = load_issuer(args.issuer_key)
    now = int(time.time())
    claims = KeyClaims(iss=issuer.name, aud=tuple(dict.fromkeys(args.audience)), jti=new_jti(),
                       exp=now + args.expires, tenant=args.tenant, iat=now, models=args.models, rpm=args.rpm,
                       tpm=args.tpm, concurrency=args.concurrency, priority=Priority(args.priority),
                       scope=args.scope)
    try:
        claims_from_payload(claims.to_payload())  # what a node will check, checked here first
    except InvalidApiKey as exc:
        raise KeysFailure(exc.detail) from None
    token = sign_key(issuer, claims)
    try:
        append_record(issuer, claims)
    except OSError as exc:
        raise KeysFailure(f"cannot record the key in {issuer.directory}: {exc.strerror}; no key issued") from None
    print(token)
    print(f"issued key {claims.jti} for tenant {claims.tenant}", file=sys.stderr)
    return 0


def _cell(value: Any) -> Text:
    if value is None:
        return cell("-")
    if isinstance(value, list):
        return cell(",".join(str(v) for v in value))
    return cell(value)


@_guard
def _run_list(args: argparse.Namespace) -> int:
    if not args.issuer_key.is_file():
        raise KeysFailure(f"{args.issuer_key} does not exist: the issued keys are recorded beside the issuer key")
    records = read_records(args.issuer_key.parent)
    if args.json:
        print(json.dumps(records, indent=2, sort_keys=True))
        return 0
    if not records:
        print("no keys issued yet")
        return 0
    table = Table(box=None, pad_edge=False)
    for column in ("ID", "TENANT", "EXPIRES", "MODELS", "RPM", "TPM", "CONC", "PRIO", "SCOPE"):
        table.add_column(column, overflow="fold", no_wrap=column == "ID")
    for record in records:
        claims = record["claims"]
        exp = claims.get("exp")
        expires = time.strftime("%Y-%m-%d", time.gmtime(exp)) if isinstance(exp, int) else "?"
        table.add_row(_cell(record.get("jti")), _cell(record.get("tenant")), expires, _cell(claims.get("models") or "all"),
                      _cell(claims.get("rpm")), _cell(claims.get("tpm")), _cell(claims.get("concurrency")),
                      _cell(claims.get("priority")), _cell(claims.get("scope")))
    Console(width=min(100, Console().width), highlight=False).print(table)
    return 0


def _issuer_name_beside(pub: Path) -> str:
    meta = (pub if pub.is_dir() else pub.parent) / "issuer.json"
    try:
        name = json.loads(meta.read_text()).get("name")
    except (OSError, ValueError, AttributeError):
        name = None
    return name if isinstance(name, str) and name else "viiwork-issuer"


@_guard
def _run_inspect(args: argparse.Namespace) -> int:
    token = args.token.strip()
    try:
        header = jwt.get_unverified_header(token)
        payload = jwt.decode(token, options={"verify_signature": False})
    except (jwt.PyJWTError, ValueError, TypeError):
        raise KeysFailure("not a JWT (a compact JWS with a JSON header and claims)") from None
    print(json.dumps({"header": header, "claims": payload}, indent=2, sort_keys=True))
    if args.issuer_pub is None:
        print("NOT VERIFIED: the header and claims above are as the token states them; "
              "pass --issuer-pub FILE to verify", file=sys.stderr)
        return 0
    keys = KeySet.from_path(args.issuer_pub)
    aud = payload.get("aud")
    audiences = [aud] if isinstance(aud, str) else [a for a in aud if isinstance(a, str)] if isinstance(aud, list) else []
    verifier = Verifier(keys, issuer=args.issuer_name or _issuer_name_beside(args.issuer_pub), audiences=audiences)
    try:
        claims = verifier.verify(token)
    except InvalidApiKey as exc:
        raise KeysFailure(f"does not verify: {exc.reason.value} ({exc.detail})") from None
    print(f"verified: key {claims.jti} of tenant {claims.tenant}, signed by issuer key {header.get('kid')} "
          "(the audience is as the token names it; a node checks its own)", file=sys.stderr)
    return 0


def _current_list(issuer: Issuer, path: Path | None) -> RevocationList:
    path = path or issuer.directory / REVOCATIONS_FILE
    try:
        token = path.read_text().strip()
    except FileNotFoundError:
        if path == issuer.directory / REVOCATIONS_FILE:
            return empty_list(issuer.name)
        raise KeysFailure(f"{path} does not exist") from None
    except OSError as exc:
        raise KeysFailure(f"cannot read {path}: {exc.strerror}") from None
    try:
        header_aud = jwt.decode(token, options={"verify_signature": False}).get("aud")
    except (jwt.PyJWTError, ValueError, TypeError):
        raise KeysFailure(f"{path} is not a signed revocation list") from None
    audiences = [header_aud] if isinstance(header_aud, str) else header_aud if isinstance(header_aud, list) else []
    try:
        return read_revocations(token, KeySet.of([issuer.key.public_key()]), issuer=issuer.name,
                                audiences=[a for a in audiences if isinstance(a, str)])
    except RevocationRefused as exc:
        raise KeysFailure(f"{path} is not a list of this issuer: {exc.reason.value} ({exc.detail})") from None


@_guard
def _run_revoke(args: argparse.Namespace) -> int:
    if not NAME_PATTERN.fullmatch(args.id):
        raise KeysFailure(f"{args.id!r} is not a key id (see `viiworkctl keys list`)")
    issuer = load_issuer(args.issuer_key)
    current = _current_list(issuer, args.current)
    if args.id in current.revoked:
        raise KeysFailure(f"key {args.id} is already revoked in version {current.ver}")
    records = read_records(issuer.directory)
    known = {r.get("jti") for r in records}
    if args.id not in known:
        print(f"viiworkctl keys revoke: warning: {args.id} is not in this issuer's record; revoking it anyway",
              file=sys.stderr)
    audiences: set[str] = set(current.aud) | set(args.audience)
    for record in records:
        aud = record["claims"].get("aud")
        audiences.update([aud] if isinstance(aud, str) else [a for a in aud or [] if isinstance(a, str)])
    if not audiences:
        raise KeysFailure("no audience known: issue a key first (the list is addressed to the keys' audiences)")
    nxt = RevocationList(iss=issuer.name, aud=tuple(sorted(audiences)), ver=current.ver + 1,
                         revoked=current.revoked | {args.id}, iat=int(time.time()))
    token = sign_revocations(issuer, nxt)
    for path in dict.fromkeys([args.out, issuer.directory / REVOCATIONS_FILE]):
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_text(token + "\n")
            tmp.replace(path)
        except OSError as exc:
            raise KeysFailure(f"cannot write {path}: {exc.strerror}") from None
    print(f"revocation list version {nxt.ver}: {len(nxt.revoked)} revoked key(s), written to {args.out}")
    return 0


@_guard
def _run_push(args: argparse.Namespace) -> int:
    try:
        with open(args.file, "rb") as f:
            token = f.read(MAX_LIST_BYTES + 2).strip()
    except OSError as exc:
        raise KeysFailure(f"cannot read {args.file}: {exc.strerror}") from None
    if not token or len(token) > MAX_LIST_BYTES:
        raise KeysFailure(f"{args.file} is not a signed revocation list (empty, or over {MAX_LIST_BYTES} bytes)")
    sent = send(BY_NAME["push-revocations"], args, body=token)
    if sent is None:
        return 1
    status, doc = sent
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0 if status < 400 else 1
    if status >= 400:
        raise KeysFailure(str(doc.get("error", {}).get("message", doc)))
    peers: dict[str, str] = doc.get("peers") or {}
    what = "taken" if doc.get("taken") else "already held"
    print(f"revocation list version {doc.get('version')} {what}: {doc.get('revoked')} revoked key(s); "
          f"pushed to {len(peers)} peer(s)")
    for name, outcome in sorted(peers.items()):
        print(f"  {name}: {outcome}")
    return 0
