"""`vsup tune`: measure layouts of this machine with this model and pick the best (docs/tune.md).

candidates.py (what to try, pure) · search.py (screen, successive halving, tweaks; pure) ·
objective.py (score and SLO, pure) · metrics.py (vllm bench serve's definitions, pure) ·
workload.py (prompts) · load.py (the streaming load generator) · roofline.py (memory bandwidth) ·
configs.py (candidate and winner YAML) · runner.py (one candidate through `vsup run`) ·
results.py (the JSONL file and --resume) · report.py (table, chart, summary)."""
