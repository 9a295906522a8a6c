"""Browser safety of the client API: DNS rebinding and cross-site requests (docs/security.md,
"Browsers: DNS rebinding and cross-site requests").

A web page the operator visits can make the browser send requests to the agent: to
``http://localhost:8086`` (cross-site request forgery: a ``text/plain`` or form POST needs
no CORS preflight, and the API parses any body as JSON), or, by re-pointing its own name at
127.0.0.1 (DNS rebinding), to its own origin, whose answers it may then read. Four checks,
in this order, on every request of the client API (:func:`middleware`):

- **Host** (:func:`host_allowed`): on a connection that arrived on a loopback address, the
  ``Host`` must be a loopback name (``localhost``, ``*.localhost``, a loopback IP literal),
  any port: a tunnel (``ssh -L 9000:localhost:8086``) keeps the client side's port. On any
  other address: an IP literal, this machine's hostname, its FQDN or ``<hostname>.local``,
  any port, or a loopback name. Plus ``api.allowed_hosts`` everywhere (``"*"``: no check). A
  request without ``Host`` passes (no browser sends one without), and so does ``GET``/``HEAD
  /health`` (a load balancer's probe by any alias; the answer is a state and a count). Else
  403 ``host_not_allowed``.
- **Origin** (:func:`origin_allowed`): a request with an ``Origin`` header passes only when
  its host and port equal the ``Host``'s (same origin: the dashboard's own fetches) or it is
  in ``api.allowed_origins`` (``"*"``: all). ``Origin: null`` (sandboxed frames, file pages)
  never passes. No ``Origin`` (curl, SDKs, peers) passes. Else 403 ``origin_not_allowed``.
- **Fetch site** (:func:`fetch_site_refused`): a request without ``Origin`` whose
  ``Sec-Fetch-Site`` is ``cross-site`` or ``same-site`` and whose ``Sec-Fetch-Mode`` is not
  ``navigate``: another site's ``<img>``, ``<script>`` or no-cors ``fetch`` (a GET carries no
  ``Origin``), which would otherwise reach every route and fill the dashboard's errors. 403
  ``cross_site_not_allowed``. A link from a peer's dashboard (a navigation), the dashboard's
  own fetches (``same-origin``) and clients that send no ``Sec-Fetch-*`` pass, and so does
  everything when ``api.allowed_origins`` holds ``"*"``. (A request with ``Origin`` was the
  Origin check's to decide.)
- **Content type** (:func:`content_type_refused`): a POST whose ``Content-Type`` is one a
  browser sends cross-site without a preflight (``text/plain``,
  ``application/x-www-form-urlencoded``, ``multipart/form-data``, or none) from a browser
  (an ``Origin`` header, or ``Sec-Fetch-Site`` other than ``same-origin``/``none``) gets 415
  ``unsupported_media_type``. curl's ``-d`` (form type, no ``Origin``) passes.

The decisions are pure functions of header values and the connection's local address;
:class:`BrowserGuard` holds the policy and counts the refusals (``browser`` in /v1/status,
``viiwork_api_browser_refused_total`` on /metrics).
"""

from __future__ import annotations

import ipaddress
import socket
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web
from prometheus_client.core import CounterMetricFamily

from viiwork.agent.serving.errors import ErrorCode, error_response

#: Headers on every dashboard answer and on every refusal here.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}

#: Content types a browser may POST cross-site without a CORS preflight (the Fetch
#: standard's "CORS-safelisted" request types); "" is a POST without Content-Type.
SIMPLE_CONTENT_TYPES = frozenset({"text/plain", "application/x-www-form-urlencoded", "multipart/form-data", ""})
_DEFAULT_PORTS = {"http": 80, "https": 443}
CHECKS = ("host", "origin", "fetch_site", "content_type")


@dataclass(frozen=True)
class BrowserPolicy:
    """What passes. ``allowed_hosts``: lowercase ``host`` (any port) or ``host:port``
    strings, or ``"*"``; ``allowed_origins``: lowercase ``scheme://host[:port]``, or ``"*"``;
    ``own_names``: this machine's names (hostname, FQDN, ``<hostname>.local``), lowercase,
    accepted as Host on a non-loopback address."""

    allowed_hosts: frozenset[str] = frozenset()
    allowed_origins: frozenset[str] = frozenset()
    own_names: frozenset[str] = frozenset()

    @classmethod
    def of_this_host(cls, allowed_hosts: Iterable[str] = (), allowed_origins: Iterable[str] = ()) -> BrowserPolicy:
        """The policy with this machine's names (``socket.getfqdn`` may ask DNS: call it off the loop)."""
        hostname = socket.gethostname().lower().rstrip(".")
        names = {hostname, f"{hostname}.local", socket.getfqdn().lower().rstrip(".")} - {""}
        return cls(frozenset(h.lower() for h in allowed_hosts),
                   frozenset(_normal_origin(o) or o.lower() for o in allowed_origins), frozenset(names))


def split_host(value: str) -> tuple[str, int | None] | None:
    """``Host`` header value -> (lowercase host without brackets or a trailing dot, port or
    None); None when it is not ``host[:port]``."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        host, rest = value[1:end], value[end + 1:]
        if rest and not rest.startswith(":"):
            return None
        port_text = rest[1:] if rest else None
    else:
        host, sep, port_text_ = value.partition(":")
        port_text = port_text_ if sep else None
        if ":" in port_text_:
            return None
    port = None
    if port_text is not None:
        if not (port_text.isascii() and port_text.isdigit()) or not 0 < int(port_text) < 65536:
            return None
        port = int(port_text)
    host = host.rstrip(".") if host != "." else host
    return (host, port) if host else None


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return None


def _loopback_name(host: str) -> bool:
    ip = _ip(host)
    if ip is not None:
        return ip.is_loopback
    # RFC 6761 6.3: localhost and every name under it are loopback; browsers resolve them so
    # without DNS, so no page can rebind them.
    return host == "localhost" or host.endswith(".localhost")


def _listed(host: str, port: int | None, allowed: frozenset[str]) -> bool:
    if "*" in allowed:
        return True
    shown = f"[{host}]" if ":" in host else host
    return host in allowed or shown in allowed or (port is not None and f"{shown}:{port}" in allowed)


def host_allowed(host_header: str | None, local_address: str | None, policy: BrowserPolicy) -> bool:
    """Whether a request whose ``Host`` is ``host_header`` (None: absent), arriving on local
    address ``local_address`` (the socket's own IP; None: a Unix socket or unknown, held to
    the loopback rule), passes the DNS-rebinding check (module doc)."""
    if host_header is None or "*" in policy.allowed_hosts:
        return True
    parsed = split_host(host_header)
    if parsed is None:
        return False
    host, port = parsed
    if _loopback_name(host) or _listed(host, port, policy.allowed_hosts):
        return True
    local = _ip(local_address) if local_address is not None else None
    if isinstance(local, ipaddress.IPv6Address) and local.ipv4_mapped is not None:
        local = local.ipv4_mapped  # a dual-stack "::" listener sees 127.0.0.1 as ::ffff:127.0.0.1
    if local is None or local.is_loopback:
        return False  # a loopback address (or a socket with none): loopback names only
    return _ip(host) is not None or host in policy.own_names


def _normal_origin(value: str) -> str | None:
    """``scheme://host[:port]`` lowercase with the scheme's default port dropped; None when
    ``value`` is no such origin (a path, query, user part or an unknown scheme)."""
    try:
        parts = urlsplit(value.strip().lower())
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in _DEFAULT_PORTS or not parts.hostname or parts.path or parts.query or parts.fragment \
            or parts.username is not None or parts.password is not None:
        return None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}" + ("" if port in (None, _DEFAULT_PORTS[parts.scheme]) else f":{port}")


def origin_allowed(origin: str | None, host_header: str | None, policy: BrowserPolicy) -> bool:
    """Whether a request with ``Origin`` ``origin`` (None: absent) and ``Host`` ``host_header``
    passes the cross-site check: no Origin; the same host and port as Host (a Host without
    port means the Origin scheme's default); or listed in ``allowed_origins``."""
    if origin is None:
        return True
    if origin.strip().lower() == "null":
        return False  # sandboxed frames, file: pages, redirects across sites: never one of ours
    if "*" in policy.allowed_origins:
        return True
    normal = _normal_origin(origin)
    if normal is None:
        return False
    if normal in policy.allowed_origins:
        return True
    parts = urlsplit(normal)
    parsed = split_host(host_header) if host_header is not None else None
    if parsed is None or parts.hostname is None:
        return False
    host, port = parsed
    origin_port = parts.port or _DEFAULT_PORTS[parts.scheme]
    return parts.hostname.rstrip(".") == host and origin_port == (port or _DEFAULT_PORTS[parts.scheme])


def fetch_site_refused(sec_fetch_site: str | None, sec_fetch_mode: str | None, origin: str | None,
                       policy: BrowserPolicy) -> bool:
    """Whether a request is another site's subresource or no-cors request without ``Origin``
    (module doc): ``Sec-Fetch-Site`` ``cross-site``/``same-site`` (the Fetch Metadata headers,
    W3C "Fetch Metadata Request Headers"; None: absent), ``Sec-Fetch-Mode`` other than
    ``navigate``, no ``Origin``, and ``"*"`` not in ``allowed_origins``."""
    if origin is not None or "*" in policy.allowed_origins:
        return False
    site = (sec_fetch_site or "").strip().lower()
    mode = (sec_fetch_mode or "").strip().lower()
    return site in ("cross-site", "same-site") and mode != "navigate"


def content_type_refused(method: str, content_type: str | None, origin: str | None,
                         sec_fetch_site: str | None) -> bool:
    """Whether a request is a browser's preflight-free POST (module doc): POST, a
    :data:`SIMPLE_CONTENT_TYPES` type (parameters ignored), and an ``Origin`` or a
    ``Sec-Fetch-Site`` other than ``same-origin``/``none``."""
    if method != "POST":
        return False
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media not in SIMPLE_CONTENT_TYPES:
        return False
    site = (sec_fetch_site or "").strip().lower()
    return origin is not None or site not in ("", "same-origin", "none")


@dataclass
class BrowserGuard:
    """The checks of the module doc with ``policy``; ``refused``: refusals per check
    (``host``, ``origin``, ``fetch_site``, ``content_type``). Single-threaded: the event loop owns it."""

    policy: BrowserPolicy = field(default_factory=BrowserPolicy)
    refused: Counter[str] = field(default_factory=Counter)

    def check(self, request: web.Request) -> web.Response | None:
        """The refusal for ``request`` (403 or 415, OpenAI-shaped, with :data:`SECURITY_HEADERS`), or None."""
        headers = request.headers
        host, origin = headers.get("Host"), headers.get("Origin")
        if not _health_probe(request) and not host_allowed(host, _local_address(request), self.policy):
            return self._refuse("host", 403, f"Host {host!r} is not a name of this API: a page that re-points its "
                                "own DNS name here (DNS rebinding) is refused; add the name to api.allowed_hosts "
                                "if a proxy or tunnel uses it", ErrorCode.HOST_NOT_ALLOWED)
        if not origin_allowed(origin, host, self.policy):
            return self._refuse("origin", 403, f"Origin {origin!r} is another site than this API (Host {host!r}): "
                                "cross-site requests are refused; add it to api.allowed_origins to allow it",
                                ErrorCode.ORIGIN_NOT_ALLOWED)
        if fetch_site_refused(headers.get("Sec-Fetch-Site"), headers.get("Sec-Fetch-Mode"), origin, self.policy):
            return self._refuse("fetch_site", 403, f"a {headers.get('Sec-Fetch-Site')} browser request "
                                f"(Sec-Fetch-Mode {headers.get('Sec-Fetch-Mode', '')!r}) is refused: another "
                                "site's page embeds or fetches this URL; open it as a link, or call the API "
                                "from its own origin", ErrorCode.CROSS_SITE_NOT_ALLOWED)
        if content_type_refused(request.method, headers.get("Content-Type"), origin, headers.get("Sec-Fetch-Site")):
            return self._refuse("content_type", 415, f"a browser's POST with Content-Type "
                                f"{headers.get('Content-Type', '')!r} is refused (a cross-site form can send it "
                                "without asking); send Content-Type: application/json",
                                ErrorCode.UNSUPPORTED_MEDIA_TYPE)
        return None

    def _refuse(self, check: str, status: int, message: str, code: ErrorCode) -> web.Response:
        self.refused[check] += 1
        return error_response(status, message, code=code, headers=SECURITY_HEADERS)

    def middleware(self) -> Callable[..., Awaitable[web.StreamResponse]]:
        """An aiohttp middleware running :meth:`check` before every handler of its app."""
        @web.middleware
        async def browser_guard(request: web.Request,
                                handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                                ) -> web.StreamResponse:
            return self.check(request) or await handler(request)
        return browser_guard

    def status(self) -> dict[str, Any]:
        """The ``browser`` section of /v1/status: ``{"refused_host", "refused_origin",
        "refused_fetch_site", "refused_content_type"}`` (requests since start), and whether any check is off."""
        return {**{f"refused_{c}": self.refused[c] for c in CHECKS},
                "allowed_hosts": sorted(self.policy.allowed_hosts), "allowed_origins": sorted(self.policy.allowed_origins)}

    def metric_families(self) -> list[CounterMetricFamily]:
        """The refusals' counter for /metrics (read now)."""
        family = CounterMetricFamily("viiwork_api_browser_refused", "Client API requests refused by the browser "
                                     "checks (Host: DNS rebinding, Origin: cross-site, fetch_site: another "
                                     "site's subresource or no-cors request, content_type: a preflight-free "
                                     "browser POST).", labels=["check"])
        for c in CHECKS:
            family.add_metric([c], self.refused[c])
        return [family]


def _health_probe(request: web.Request) -> bool:
    """A load balancer's probe (``GET``/``HEAD /health``), exempt from the Host check: it may use
    any DNS alias of the box, and the answer holds only a state and a backend count."""
    return request.path == "/health" and request.method in ("GET", "HEAD")


def _local_address(request: web.Request) -> str | None:
    """The IP the request's connection arrived on; None for a Unix socket or a closed transport."""
    transport = request.transport
    sockname = transport.get_extra_info("sockname") if transport is not None else None
    if isinstance(sockname, tuple) and len(sockname) >= 2:
        return str(sockname[0])
    return None
