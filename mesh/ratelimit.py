"""Per-peer receive rate limits: a token bucket per sender, bounded in number."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class _Bucket:
    tokens: float
    updated_ms: float


class PeerRateLimiter:
    """``allow(peer, now_ms)``: True while ``peer`` stays within ``rate_per_s`` messages per
    second with bursts up to ``burst``. At most ``max_buckets`` peers are tracked (least
    recently seen evicted: an evicted peer restarts with a full bucket, which costs at most
    one burst)."""

    def __init__(self, rate_per_s: float, burst: float, max_buckets: int = 4096):
        if rate_per_s <= 0 or burst < 1:
            raise ValueError("rate_per_s must be > 0 and burst >= 1")
        self.rate_per_ms = rate_per_s / 1000.0
        self.burst = float(burst)
        self.max_buckets = max_buckets
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()

    def allow(self, peer: str, now_ms: float) -> bool:
        bucket = self._buckets.get(peer)
        if bucket is None:
            bucket = self._buckets[peer] = _Bucket(self.burst, now_ms)
            if len(self._buckets) > self.max_buckets:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(peer)
            elapsed = max(0.0, now_ms - bucket.updated_ms)
            bucket.tokens = min(self.burst, bucket.tokens + elapsed * self.rate_per_ms)
            bucket.updated_ms = now_ms
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return True
        return False
