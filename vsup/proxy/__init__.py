"""The proxy: one OpenAI-compatible endpoint in front of the ready instances.

server.py (ProxyServer: app, own endpoints, start/drain), forward.py (one request to one instance),
exchange.py (a request in flight: phase and time limit), codec.py (header filtering, JSON body
parsing), upstream.py (connection pools per instance), upstream_conn.py (one connection: llhttp
parsing, reading/relaying an answer), balancer.py (round_robin, least_outstanding, least_loaded),
affinity.py (prefix_affinity), load.py (the instances' load figures), models.py (merged
/v1/models), auth.py (Bearer key), errors.py (OpenAI-shaped errors), metrics.py (vsup_* Prometheus
metrics), healthcheck.py (active /health checks for standalone `vsup proxy`), runloop.py (uvloop
when available).
"""

from vsup.proxy.server import ProxyServer

__all__ = ["ProxyServer"]
