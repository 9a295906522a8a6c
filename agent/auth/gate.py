"""Client keys enforced on the client API and on forwards from peers (docs/security.md, "Client keys").

``AuthGate`` sits in front of the request pipeline (``[auth] mode = "keys"``):

- ``/health`` is open.
- Inference (docs/routing.md, "Endpoints"; Anthropic's error shape on ``/v1/messages*``) and
  ``/v1/models`` need a key with the ``inference`` scope: 401 ``invalid_api_key`` for every
  ``InvalidApiKey`` reason, 403 ``permission_denied`` without the scope. Once the body names the
  model (``admit``): 403 ``model_not_allowed`` for a model outside the key's ``models``, then the
  key's limits (agent/auth/limits.py; an answer's ``usage`` replaces the token estimate, a
  stream cut before it is charged the events relayed; no ``max_tokens``: estimated at what the
  key has left;
  in a mesh, counted with the peers' reports and paced first: agent/peering/usage_share.py):
  429 ``rate_limit_exceeded`` with ``Retry-After`` and OpenAI's ``x-ratelimit-*`` headers, which
  an admitted request's answer carries too.
- ``/v1/status``, ``/metrics``, ``/v1/mesh`` and the dashboard's data (``/ui/api/state``) need
  the ``read`` scope, unless ``auth.open_loopback_reads`` and the client is on loopback. The
  dashboard's page and static files (``/ui``, ``/ui/static/*``) are open: they hold no data, and
  the page asks for a read key (kept in the tab's ``sessionStorage``) that its ``fetch`` sends.
- A request forwarded to a peer carries the key (``FORWARD_KEY_HEADER``, over the mesh's
  mutual TLS); the serving node verifies it again with its own ``Verifier`` (``check_forwarded``)
  and refuses a forward without a valid key, or for a model the key does not allow.

The key is never logged (the ``jti`` is) and never sent to an engine (agent/serving/proxy.py
builds an engine's headers from scratch, with the backend's own key). With no issuer key
installed the agent still starts: every request that needs a key gets a 401 saying how to
install one (docs/install.md, "Client keys").
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from viiwork.agent.auth.claims import KeyClaims, Scope
from viiwork.agent.auth.errors import InvalidApiKey, Reason, RevocationReason, RevocationRefused
from viiwork.agent.auth.headers import token_from_request
from viiwork.agent.auth.keyset import INSTALL_HINT, IssuerKeyError, KeySet
from viiwork.agent.auth.limits import Admission, Limiter, LimitExceeded, estimate_tokens, prompt_tokens_estimate
from viiwork.agent.auth.revocations import RevocationList, RevocationStore
from viiwork.agent.auth.verifier import Verifier
from viiwork.agent.config.schema import Config, auth_audience, is_loopback
from viiwork.agent.serving.errors import error_response
from viiwork.agent.serving.tokens import RELAYED_STREAM, USAGE, Usage
from viiwork.engines.contract import ENDPOINT_PATHS, GENERATING_ENDPOINTS

log = logging.getLogger(__name__)

#: The header that carries a client's key on a forward to a peer (mutual TLS only).
FORWARD_KEY_HEADER = "X-Viiwork-Api-Key"
INFERENCE_PATHS = frozenset(ENDPOINT_PATHS.values())  # every inference endpoint (engines/contract.py)
_GENERATING = frozenset(e.path for e in GENERATING_ENDPOINTS)  # the others: no completion is estimated
READ_PATHS = frozenset({"/v1/status", "/metrics", "/v1/mesh"})
DASHBOARD_STATE_PATH = "/ui/api/state"  # the dashboard's data; its page and static files are open
OPEN_PATHS = frozenset({"/health"})

# Per-request state, on the aiohttp request (its mapping interface).
_CLAIMS = "viiwork.auth.claims"
_TOKEN = "viiwork.auth.token"
_ADMISSION = "viiwork.auth.admission"
_PROMPT_ESTIMATE = "viiwork.auth.prompt_estimate"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class AuthStartError(Exception):
    """Keys mode cannot start as configured (the revocation state is unreadable); the message
    names the file and the fix."""


def is_loopback_address(remote: str | None) -> bool:
    """Whether a peer address (``request.remote``) is loopback (127.0.0.0/8, ::1, ::ffff:127.x)."""
    if not remote:
        return False
    try:
        address = ipaddress.ip_address(remote)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return bool(address.is_loopback or (mapped is not None and mapped.is_loopback))


def forward_headers(request: web.Request) -> dict[str, str]:
    """The header a forward of ``request`` to a peer carries: its client's key, when one was
    checked here (empty otherwise)."""
    token = request.get(_TOKEN)
    return {FORWARD_KEY_HEADER: token} if isinstance(token, str) else {}


def claims_of(request: web.Request) -> KeyClaims | None:
    """The verified key of ``request`` (None: keys are off, or the path needs none)."""
    claims = request.get(_CLAIMS)
    return claims if isinstance(claims, KeyClaims) else None


class AuthGate:
    """The client-key checks of one node (see the module doc).

    ``verifier``: None when no issuer key could be loaded (``unavailable`` says why and how to
    fix it: every request that needs a key gets it in a 401). ``revocations``: the node's
    revocation list store, which the verifier's list comes from (None: lists cannot be taken,
    for want of an issuer key). ``limiter``: this node's per-key limits. Counters: ``refused``
    by reason (the Verifier's reasons, ``no_issuer_key``, ``scope``, ``model``, ``forwarded``),
    the limiter's own, and the store's refused lists by reason.
    """

    def __init__(self, verifier: Verifier | None, *, limiter: Limiter | None = None,
                 open_loopback_reads: bool = False, unavailable: str | None = None,
                 revocations: RevocationStore | None = None) -> None:
        if verifier is None and unavailable is None:
            raise ValueError("without a verifier, say why (unavailable)")
        self.verifier = verifier
        self.revocations = revocations
        self._offering = asyncio.Lock()  # one list at a time through the store (it has one owner)
        self.limiter = limiter or Limiter()
        self.open_loopback_reads = open_loopback_reads
        self.unavailable = unavailable
        self.refused: Counter[str] = Counter()
        self._warned: set[str] = set()
        #: Set in a mesh (agent/peering/usage_share.py, ``UsageShare.pace``): holds a request of a
        #: limited key until it fits this node's share of what the key has left mesh-wide.
        self.pacer: Callable[[KeyClaims, int], Awaitable[None]] | None = None

    @classmethod
    def at_start(cls, config: Config, api_host: str) -> AuthGate | None:
        """:meth:`from_config`, with the warnings docs/security.md promises at start: keys off
        while the API (``api_host``) listens beyond loopback; keys on in an open mesh."""
        if config.auth.mode == "none":
            if not is_loopback(api_host):
                log.warning("client keys are off ([auth] mode = \"none\") and the API listens on %s: anyone who "
                            "reaches it can use every model; set [auth] mode = \"keys\" (docs/security.md, "
                            "\"Client keys\")", config.api.listen)
            return None
        if config.mesh is not None and config.mesh.trust == "open":  # allowed only with allow_open_mesh
            log.warning("client keys are on in an open mesh (auth.allow_open_mesh): any host that knows mesh id "
                        "%r can join and receive forwarded keys; use trust = \"ca\" outside labs",
                        config.mesh.mesh_id)
        return cls.from_config(config)

    @classmethod
    def from_config(cls, config: Config) -> AuthGate | None:
        """The gate of ``config`` (None when ``auth.mode`` is ``none``). A missing or unusable
        issuer key is logged (ERROR) and every request needing a key refused; the revocation
        state of ``node.state_dir`` is read (AuthStartError when it exists but is unreadable)."""
        auth = config.auth
        if auth.mode != "keys":
            return None
        limiter = Limiter(auth.max_tracked_keys)
        try:
            keys = KeySet.from_path(auth.issuer_keys)
        except IssuerKeyError as exc:
            reason = f"no usable issuer key ({exc}): " + INSTALL_HINT.format(path=auth.issuer_keys)
            log.error("client keys: %s", reason)
            return cls(None, limiter=limiter, open_loopback_reads=auth.open_loopback_reads, unavailable=reason)
        audience = auth_audience(config)
        verifier = Verifier(keys, issuer=auth.issuer, audiences=[audience], leeway_s=auth.leeway_s)
        try:
            store = RevocationStore(config.node.state_dir, keys, issuer=auth.issuer, audiences=[audience])
        except Exception as exc:  # RevocationStateError, or an OSError reading it
            raise AuthStartError(str(exc)) from None
        verifier.use_revocations(store.current)
        log.info("client keys on: %d issuer key(s) from %s, issuer %r, audience %r, revocation list version %d",
                 len(keys), auth.issuer_keys, auth.issuer, audience, store.current.ver)
        return cls(verifier, limiter=limiter, open_loopback_reads=auth.open_loopback_reads, revocations=store)

    # -- revocation lists --------------------------------------------------------------

    async def offer_revocations(self, token: str) -> RevocationList:
        """Take the signed list ``token`` if it verifies and is newer than the one held: it is
        persisted (off the loop: the store fsyncs) and then checked by every request. Returns the
        list now held. Raises RevocationRefused (counted by the store: a forged, malformed or
        stale list), or RevocationRefused(malformed) when this node has no issuer key to check
        it with; an OSError writing the state file propagates (the list is not taken)."""
        store, verifier = self.revocations, self.verifier
        if store is None or verifier is None:
            raise RevocationRefused(RevocationReason.MALFORMED,
                                    f"this node cannot check revocation lists: {self.unavailable}")
        async with self._offering:  # the store's one owner: its offers never overlap
            held = await asyncio.to_thread(store.offer, token)
        verifier.use_revocations(held)
        log.info("revocation list version %d taken: %d revoked key(s)", held.ver, len(held.revoked))
        return held

    def held_revocations(self) -> RevocationList | None:
        """The list this node checks keys against (None: it has no issuer key)."""
        return None if self.revocations is None else self.revocations.current

    # -- the checks --------------------------------------------------------------------

    def _refuse(self, reason: str, detail: str, request: web.Request) -> None:
        self.refused[reason] += 1
        # A client can repeat a bad key per request: WARNING once per reason, then DEBUG.
        level = logging.DEBUG if reason in self._warned else logging.WARNING
        self._warned.add(reason)
        log.log(level, "client key refused (%s) for %s %s from %s: %s", reason, request.method, request.path,
                request.remote, detail)

    def authenticate(self, request: web.Request, token: str | None = None) -> KeyClaims | web.Response:
        """The key of ``request`` (its ``Authorization``/``x-api-key``, or ``token``) as claims,
        or the 401 ``invalid_api_key`` answer."""
        if self.verifier is None:
            assert self.unavailable is not None
            self._refuse("no_issuer_key", self.unavailable, request)
            return error_response(401, f"client keys are on but this node has {self.unavailable}",
                                  code="invalid_api_key")
        try:
            if token is None:
                token = token_from_request(request.headers)
            claims = self.verifier.verify(token)
        except InvalidApiKey as exc:
            self._refuse(exc.reason.value, exc.detail, request)
            return error_response(401, _message(exc), code="invalid_api_key")
        request[_CLAIMS] = claims
        request[_TOKEN] = token
        return claims

    def _scoped(self, request: web.Request, scope: Scope) -> web.Response | None:
        found = self.authenticate(request)
        if isinstance(found, web.Response):
            return found
        if scope not in found.scope:
            self._refuse("scope", f"key {found.jti} lacks the {scope.value} scope", request)
            return error_response(403, f"this key does not have the {scope.value!r} scope "
                                  f"(it has: {', '.join(sorted(s.value for s in found.scope))})",
                                  code="permission_denied")
        return None

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """The client API's per-path checks; an admitted request's limits are released when its
        handler returns (a stream has been relayed by then)."""
        path = request.path
        refusal: web.Response | None = None
        if path in INFERENCE_PATHS or path == "/v1/models":
            refusal = self._scoped(request, Scope.INFERENCE)
        elif path in READ_PATHS or path == DASHBOARD_STATE_PATH:
            if not (self.open_loopback_reads and is_loopback_address(request.remote)):
                refusal = self._scoped(request, Scope.READ)
        if refusal is not None:
            return refusal
        response: web.StreamResponse | None = None
        try:
            response = await handler(request)
            return response
        finally:
            admission = request.get(_ADMISSION)
            if isinstance(admission, Admission):
                used = _used_tokens(request, response) if admission.tracks_tokens else None
                self.limiter.finish(admission, used)

    async def on_response_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        """An admitted request's answer carries its key's ``x-ratelimit-*`` headers."""
        admission = request.get(_ADMISSION)
        if isinstance(admission, Admission):
            for name, value in admission.quota.headers().items():
                response.headers.setdefault(name, value)

    def _model_refusal(self, claims: KeyClaims, model: str, request: web.Request) -> web.Response | None:
        if claims.models is None or model in claims.models:
            return None
        self._refuse("model", f"key {claims.jti} does not allow model {model!r}", request)
        return error_response(403, f"this key does not allow model {model!r} (it allows: "
                              f"{', '.join(claims.models)})", param="model", code="model_not_allowed")

    async def pace(self, request: web.Request, payload: dict[str, Any]) -> None:
        """Before :meth:`admit` (with no ``await`` between them): in a mesh, wait briefly until
        the request fits this node's share of its key's limits (``pacer``); at once otherwise."""
        claims = claims_of(request)
        if self.pacer is not None and claims is not None and (claims.rpm is not None or claims.tpm is not None):
            await self.pacer(claims, estimate_tokens(payload))

    def admit(self, request: web.Request, model: str, payload: dict[str, Any]) -> web.Response | None:
        """An inference request whose key the middleware verified, once its body names
        ``model``: None (admitted: its limits debited until the request ends), or the 403/429."""
        claims = claims_of(request)
        if claims is None:  # the middleware let it through without a key: cannot happen in keys mode
            return error_response(401, "no key checked for this request", code="invalid_api_key")
        refusal = self._model_refusal(claims, model, request)
        if refusal is not None:
            return refusal
        prompt = prompt_tokens_estimate(payload)
        request[_PROMPT_ESTIMATE] = prompt
        unbounded = 0
        if claims.tpm is not None and request.path in _GENERATING:
            # An answer without max_tokens may use what the key has left in this window, no
            # more: one such request at a time (docs/security.md, "Limits").
            _, tokens, _, peer_tokens = self.limiter.usage_of(claims.jti)
            unbounded = max(1, claims.tpm - tokens - peer_tokens - prompt)
        try:
            admission = self.limiter.admit(claims, estimate_tokens(payload, unbounded))
        except LimitExceeded as exc:
            log.debug("request for %s by key %s refused: %s", model, claims.jti, exc)
            return error_response(429, str(exc), code="rate_limit_exceeded", retry_after_s=exc.retry_after_s,
                                  headers=exc.quota.headers())
        request[_ADMISSION] = admission
        log.debug("request for %s admitted for key %s (tenant %s, about %d tokens)", model, claims.jti,
                  claims.tenant, admission.tokens)
        return None

    def visible_models(self, request: web.Request, models: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        """``/v1/models``' entries the request's key allows."""
        claims = claims_of(request)
        allowed = None if claims is None else claims.models
        return [m for m in models if allowed is None or m.get("id") in allowed]

    def check_forwarded(self, request: web.Request, model: str) -> web.Response | None:
        """A forward from a peer: its ``FORWARD_KEY_HEADER`` verified again by this node (a
        member cannot change the key's tenant, models or priority), with the inference scope
        and ``model`` allowed. None when it may run; else the 401/403 the origin relays."""
        token = request.headers.get(FORWARD_KEY_HEADER)
        if not token:
            self._refuse("forwarded", "a forwarded request carries no client key", request)
            return error_response(401, "the forwarded request carries no client key (client keys are on here)",
                                  code="invalid_api_key")
        found = self.authenticate(request, token)
        if isinstance(found, web.Response):
            return found
        if Scope.INFERENCE not in found.scope:
            self._refuse("scope", f"key {found.jti} lacks the inference scope", request)
            return error_response(403, "this key does not have the 'inference' scope", code="permission_denied")
        return self._model_refusal(found, model, request)

    # -- observability -----------------------------------------------------------------

    def metric_families(self) -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
        """``viiwork_auth_refused_total{reason}``, ``viiwork_auth_limited_total{limit}``,
        ``viiwork_auth_revocation_lists_refused_total{reason}`` and
        ``viiwork_auth_revocation_list_version``."""
        refused = CounterMetricFamily("viiwork_auth_refused", "Requests refused for their client key, by reason.",
                                      labels=["reason"])
        counts = Counter(self.refused)
        for reason, count in sorted(counts.items()):
            refused.add_metric([reason], count)
        limited = CounterMetricFamily("viiwork_auth_limited", "Requests refused by their key's limits on this node.",
                                      labels=["limit"])
        for limit in ("requests", "tokens", "concurrency"):
            limited.add_metric([limit], self.limiter.refused[limit])
        lists = CounterMetricFamily("viiwork_auth_revocation_lists_refused",
                                    "Revocation lists refused (forged, malformed, or not newer than the one held), "
                                    "by reason.", labels=["reason"])
        version = GaugeMetricFamily("viiwork_auth_revocation_list_version",
                                    "Version of the revocation list this node checks keys against (0: none).")
        if self.revocations is not None:
            for reason, count in sorted(self.revocations.refused.items()):
                lists.add_metric([reason.value], count)
        held = self.held_revocations()
        version.add_metric([], held.ver if held is not None else 0)
        return [refused, limited, lists, version]

    def status(self) -> dict[str, Any]:
        """The /v1/status ``auth`` section."""
        verifier = self.verifier
        return {"mode": "keys", "issuer_key": verifier is not None, "problem": self.unavailable,
                "issuer_keys": len(verifier.keys) if verifier is not None else 0,
                "revocations_version": verifier.revocations.ver if verifier is not None else 0,
                "revocations_refused": {r.value: n for r, n in sorted(self.revocations.refused.items())}
                if self.revocations is not None else {},
                "refused": dict(sorted(self.refused.items())), "limited": dict(self.limiter.refused),
                "tracked_keys": len(self.limiter)}


#: A whole answer larger than this is not parsed for its usage (its estimate stands).
MAX_USAGE_BODY_BYTES = 1 << 20


def _used_tokens(request: web.Request, response: web.StreamResponse | None) -> int | None:
    """The tokens an admitted request used: the engine's count when the relay read it
    (``USAGE``: a stream's usage event, which the agent asks for on every stream,
    agent/serving/tokens.py; a whole answer this node's engine gave), else ``usage.total_tokens``
    of a whole 2xx JSON answer; for a stream that ended without the engine's usage (its client
    went away, the engine broke off), the events relayed (``RELAYED_STREAM``, one a token)
    plus the prompt's estimate. None for an error or an answer without usage (the estimate
    stands)."""
    usage: Usage | None = response.get(USAGE) if response is not None else None
    if usage is None:
        tail = request.get(RELAYED_STREAM)
        usage = tail.delivered() if tail is not None else None
    if usage is not None and usage.total_tokens is not None:
        if usage.prompt_tokens is None:  # the engine did not say: the estimate the admission used
            prompt = request.get(_PROMPT_ESTIMATE)
            return usage.total_tokens + (prompt if isinstance(prompt, int) else 0)
        return usage.total_tokens
    if not isinstance(response, web.Response) or not 200 <= response.status < 300:
        return None
    body = response.body
    if not isinstance(body, bytes) or len(body) > MAX_USAGE_BODY_BYTES or b'"usage"' not in body:
        return None
    try:
        usage_doc = json.loads(body).get("usage")
    except (ValueError, AttributeError, RecursionError):
        return None
    total = usage_doc.get("total_tokens") if isinstance(usage_doc, dict) else None
    return total if isinstance(total, int) and not isinstance(total, bool) and total >= 0 else None


def _message(exc: InvalidApiKey) -> str:
    """The client's 401 message: the reason in words (the detail may name claims; never the key)."""
    words = {
        Reason.MISSING: "no API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
        Reason.MALFORMED: "the API key is malformed",
        Reason.BAD_SIGNATURE: "the API key's signature does not verify",
        Reason.UNKNOWN_KID: "the API key is signed by an issuer key this node does not know",
        Reason.WRONG_ISSUER: "the API key is from another issuer",
        Reason.WRONG_AUDIENCE: "the API key is not for this mesh or node",
        Reason.BAD_ALG: "the API key is not signed with EdDSA",
        Reason.EXPIRED: "the API key has expired",
        Reason.NOT_YET_VALID: "the API key is not valid yet",
        Reason.REVOKED: "the API key is revoked",
        Reason.BAD_CLAIMS: "the API key's claims are invalid",
    }
    return f"{words.get(exc.reason, 'invalid API key')} ({exc.reason.value})"

