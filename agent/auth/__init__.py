"""Client API keys: Ed25519-signed JWTs (RFC 7519, RFC 8037) checked by every node on its own.

One module per concern:

- ``errors``: the closed set of reasons a key is refused (``InvalidApiKey``), and a
  revocation list's (``RevocationRefused``).
- ``keyset``: the issuer's public keys by ``kid`` (``KeySet``), the issuer's private key file.
- ``claims``: a key's claims as a frozen value (``KeyClaims``), checked for types and bounds.
- ``jws``: the one signature check both keys and revocation lists go through (EdDSA only).
- ``headers``: ``Authorization: Bearer`` / ``x-api-key`` to a token (a pure function).
- ``verifier``: ``Verifier``, a token to ``KeyClaims`` or one ``InvalidApiKey``, with a
  bounded cache and counters per reason.
- ``revocations``: the signed, versioned revocation list and the state file that keeps the
  highest version seen.
- ``issuing``: what the issuer's workstation does (``viiworkctl keys``): sign keys and lists.

Enforcement in the request path and mesh-wide push of revocations build on these.
"""
