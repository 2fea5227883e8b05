"""pdserve-router: the load balancer of pdserve (aiohttp only; never imports torch)."""

__version__ = "0.1.0"
