"""Watching the instances: their vLLM metrics and process figures, collected in the background.

scrape.py (parse, relabel, merge, summarize an instance's Prometheus text), procstats.py (CPU and
memory of a process tree), numa.py (memory per NUMA node from numa_maps), rates.py (tokens/s
from counter samples), collector.py (the background task and its cached snapshot), families.py
(vsup's own per-instance families), fmt.py (human units for status, top and the page), page.py
(the proxy's /status HTML page), bandwidth.py (each NUMA node's memory bandwidth, by a pinned triad:
`vsup doctor` reports it, `vsup tune` measures layouts against it).
"""
