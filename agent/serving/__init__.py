"""Serving: the client API, the request pipeline, the wait queue, the router and the proxy to engines."""
